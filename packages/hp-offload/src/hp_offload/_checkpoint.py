"""Activation checkpointing: full, every-Nth layer, or op-level selective, on top of
``torch.utils.checkpoint``'s non-reentrant machinery and its selective-checkpoint contexts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils import checkpoint as tc

from .errors import OffloadError, OffloadTypeError, OffloadUnsupportedError

__all__ = [
    "CheckpointPolicy",
    "OffloadError",
    "OffloadTypeError",
    "OffloadUnsupportedError",
    "checkpoint",
    "checkpoint_wrapper",
]


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm")
ATTENTION = (
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
)


def _resolve(name: str):
    """``"aten.mm"`` -> ``torch.ops.aten.mm`` (the overload packet); a clear error if unknown."""
    parts = name.split(".")
    if len(parts) != 2:
        raise OffloadError(f"op {name!r}: expected '<namespace>.<op>', e.g. 'aten.mm'")
    ns, op = parts
    try:
        return getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        raise OffloadError(f"policy names an unknown op {name!r} (not in torch.ops.{ns})") from None


@dataclass(frozen=True)
class CheckpointPolicy:
    """What to save and what to recompute.

    - ``mode="full"``: save only the region's inputs; recompute everything in backward.
    - ``mode="selective"``: save the outputs of the ops in ``save`` (default: matmuls and
      attention), recompute the rest (pointwise ops, norms...); ``save_every=k`` saves only every
      k-th call of those ops per region (``2``: every other matmul).
    - ``every``: used where a policy is applied to a list of layers (:class:`OffloadPlan`):
      only every ``every``-th layer is checkpointed (1: all).
    """

    mode: str = "full"
    save: tuple[str, ...] = MATMULS + ATTENTION
    save_every: int = 1
    every: int = 1

    def __post_init__(self) -> None:
        from ._checks import check_int

        if not isinstance(self.mode, str) or self.mode not in ("full", "selective"):
            raise OffloadError(f"mode must be 'full' or 'selective', got {self.mode!r}")
        check_int(self.save_every, "save_every", "CheckpointPolicy", low=1)
        check_int(self.every, "every", "CheckpointPolicy", low=1)
        if isinstance(self.save, (str, bytes)) or not hasattr(self.save, "__iter__"):
            raise OffloadTypeError(
                f"CheckpointPolicy: save={self.save!r} is a {type(self.save).__name__}: give a "
                f"tuple of op names, e.g. ({self.save!r},)"
                if isinstance(self.save, str)
                else f"CheckpointPolicy: save={self.save!r} is a {type(self.save).__name__}: "
                "give a tuple of op names, e.g. ('aten.mm',)"
            )
        object.__setattr__(self, "save", tuple(self.save))
        for i, name in enumerate(self.save):
            if not isinstance(name, str):
                raise OffloadTypeError(
                    f"CheckpointPolicy: save[{i}]={name!r} is a {type(name).__name__}: give an "
                    "op name such as 'aten.mm'"
                )
        for name in self.save:
            if not name.startswith("aten._scaled_dot_product"):  # backend-specific: may be absent
                _resolve(name)

    def _ops(self) -> frozenset:
        out = set()
        for name in self.save:
            try:
                out.add(_resolve(name))
            except OffloadError:
                if not name.startswith("aten._scaled_dot_product"):
                    raise
        return frozenset(out)

    def context_fn(self) -> Callable | None:
        """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (None for full)."""
        if self.mode == "full":
            return None
        ops, k = self._ops(), self.save_every

        def make():
            # one counter per phase: the recompute must take the forward's decisions, call by call
            count = {False: 0, True: 0}

            def policy(ctx, op, *args, **kwargs):
                packet = getattr(op, "overloadpacket", op)
                if packet in ops:
                    count[ctx.is_recompute] += 1
                    if count[ctx.is_recompute] % k == 0:
                        return tc.CheckpointPolicy.MUST_SAVE
                return tc.CheckpointPolicy.PREFER_RECOMPUTE

            return tc.create_selective_checkpoint_contexts(policy)

        return make


def _framework_of_call(fn, args, kwargs) -> str | None:
    """The framework of a call: of ``fn`` if it is a module or cell, else of its first tensor
    argument (``hp_dtensor.framework_of``, the one framework check)."""
    from hp_dtensor import framework_of

    found = framework_of(fn)
    if found is not None:
        return found
    for a in (*args, *kwargs.values()):
        found = framework_of(a)
        if found is not None:
            return found
    return None


def checkpoint(fn: Callable, *args, policy: CheckpointPolicy | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` keeping only what ``policy`` saves; the rest is recomputed
    in backward. Non-reentrant, so it composes with hooks, FSDP and pipeline stages.

    On MindSpore (``fn`` a cell, or its first tensor argument a MindSpore tensor): MindSpore's
    non-reentrant ``mindspore.recompute``, PyNative mode, ``mode="full"`` only (``"selective"``
    raises :class:`OffloadUnsupportedError`)."""
    from ._checks import check_callable, check_type

    check_callable(fn, "fn", "checkpoint")
    check_type(policy, CheckpointPolicy, "policy", "checkpoint", hint="e.g. CheckpointPolicy()")
    for key in ("use_reentrant", "context_fn"):
        if key in kwargs:
            raise OffloadTypeError(
                f"checkpoint: {key}= is set by hp_offload (non-reentrant; the policy's "
                "context_fn): drop it, and give the policy as policy=CheckpointPolicy(...)"
            )
    policy = CheckpointPolicy() if policy is None else policy
    if _framework_of_call(fn, args, kwargs) == "mindspore":
        from ._backend._mindspore import checkpoint_call

        return checkpoint_call(fn, args, kwargs, policy)
    ctx = policy.context_fn()
    extra = {"context_fn": ctx} if ctx is not None else {}
    return tc.checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


class _CheckpointWrapper(nn.Module):
    """A module whose forward runs under :func:`checkpoint`; parameters keep their names
    (``_checkpoint_wrapped_module`` is elided from state-dict keys)."""

    def __init__(self, module: nn.Module, policy: CheckpointPolicy):
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.policy = policy
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args, **kwargs):
        return checkpoint(self._checkpoint_wrapped_module, *args, policy=self.policy, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._checkpoint_wrapped_module, name)


_PREFIX = "_checkpoint_wrapped_module."


def _strip_prefix(module, state_dict, prefix, local_metadata, inner: str = _PREFIX):
    for key in list(state_dict):
        if key.startswith(prefix + inner):
            state_dict[prefix + key[len(prefix + inner) :]] = state_dict.pop(key)
    return state_dict


def _add_prefix(state_dict, prefix, *args, inner: str = _PREFIX):
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + inner):
            state_dict[prefix + inner + key[len(prefix) :]] = state_dict.pop(key)


def checkpoint_wrapper(module: nn.Module, *, policy: CheckpointPolicy | None = None) -> nn.Module:
    """Wrap ``module`` so its forward is checkpointed with ``policy`` (default: full).

    A MindSpore ``nn.Cell`` gets a cell whose forward runs under MindSpore's recompute (its
    Parameters keep their names); only ``mode="full"`` can be honoured there."""
    from hp_dtensor import framework_of

    from ._checks import check_module, check_type

    mindspore = framework_of(module) == "mindspore"
    if not mindspore:
        check_module(module, "module", "checkpoint_wrapper")
    check_type(
        policy, CheckpointPolicy, "policy", "checkpoint_wrapper", hint="e.g. CheckpointPolicy()"
    )
    policy = CheckpointPolicy() if policy is None else policy
    if mindspore:
        from ._backend._mindspore import checkpoint_cell

        return checkpoint_cell(module, policy)
    return _CheckpointWrapper(module, policy)
