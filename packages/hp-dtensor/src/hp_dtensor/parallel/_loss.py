"""``loss_parallel()``: cross-entropy on vocabulary-sharded logits without gathering them."""

from __future__ import annotations

import contextlib

from .. import _dtensor

__all__ = ["loss_parallel"]


@contextlib.contextmanager
def loss_parallel():
    """Inside this context, ``log_softmax`` over a sharded class dimension stays sharded
    (log-sum-exp across the group) and ``nll_loss`` reads sharded log-probabilities, so the
    ``log_softmax`` + ``nll_loss`` composition never gathers the logits.

    ``F.cross_entropy`` on class-sharded logits is vocabulary-parallel with or without this
    context (it never gathers): ``ignore_index``, class weights, ``reduction`` none/sum/mean and
    ``label_smoothing`` are supported, forward and backward.

    Example::

        with loss_parallel():
            loss = F.cross_entropy(logits, labels)   # logits: DTensor, Shard(-1) over tp
            loss.backward()
    """
    with _dtensor.dispatch_mode("loss_parallel"):
        yield
