"""Rules for matrix products, embedding, softmax, normalisation, attention and losses."""

from __future__ import annotations

from .._placement import Partial, Placement, Replicate, Shard
from ._core import PSUM, REPLICATE, Call, Strategy, normalize_dim, per_mesh_dim

__all__ = [
    "contraction_rule",
    "matmul_labels",
    "embedding_rule",
    "softmax_rule",
    "norm_rule",
    "sdpa_rule",
    "loss_rule",
    "einsum_rule",
    "log_softmax_rule",
    "rotary_rule",
]


def _move_cost(p: Placement, q: Placement, numel: int) -> float:
    if p == q:
        return 0.0
    if isinstance(p, Replicate):
        return 1e-3 * numel  # chunk or partition: local
    if isinstance(p, Partial):
        return (1.0 if isinstance(q, Shard) else 2.0) * numel
    if isinstance(q, Partial):
        return 1e-2 * numel  # pad: local
    return 1.0 * numel  # all-gather or all-to-all


def contraction_rule(
    call: Call,
    labels: list[str | None],
    out_labels: str,
    *,
    bias: tuple[int, ...] = (),
) -> Strategy:
    """Generic rule for products described by index labels (einsum style).

    ``labels[i]`` labels each dim of tensor ``i`` (``"."`` for a broadcast dim that must be
    replicated); ``out_labels`` labels the output. Tensors listed in ``bias`` are added to the
    product (so they must be Partial when the product is). Per mesh dimension the cheapest of
    these is chosen: all replicated; shard an output label; shard a contracted label (output
    Partial); pass one Partial factor through.
    """
    ts = call.tensors
    factors = [i for i in range(len(ts)) if i not in bias]
    out_set = set(out_labels)
    contracted = sorted({c for i in factors for c in labels[i] if c not in out_set and c != "."})
    shardable_out = [c for c in out_labels if c != "."]

    def target_for(label) -> tuple[list[Placement], Placement]:
        tgt: list[Placement] = []
        for i in range(len(ts)):
            lab = labels[i]
            if label in lab:
                tgt.append(Shard(lab.index(label)))
            elif i in bias and label not in out_set:
                tgt.append(PSUM)
            else:
                tgt.append(REPLICATE)
        out = Shard(out_labels.index(label)) if label in out_set else PSUM
        return tgt, out

    def choose(d, cur):
        cands: list[tuple[list[Placement], Placement]] = [([REPLICATE] * len(ts), REPLICATE)]
        cands += [target_for(c) for c in shardable_out]
        cands += [target_for(c) for c in contracted if all(c in labels[i] for i in factors)]
        partial = [i for i in factors if isinstance(cur[i], Partial)]
        if len(partial) == 1 and cur[partial[0]].reduce_op in ("sum", "avg"):
            p = cur[partial[0]]
            tgt = [p if (i == partial[0] or i in bias) else REPLICATE for i in range(len(ts))]
            cands.append((tgt, p))
        best = None
        for tgt, out in cands:
            cost = sum(_move_cost(cur[i], tgt[i], ts[i].numel()) for i in range(len(ts)))
            if best is None or cost < best[0]:
                best = (cost, tgt, out)
        return best[1], best[2]

    return per_mesh_dim(call, choose)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def matmul_labels(a_shape, b_shape) -> tuple[str, str, str] | None:
    """Labels for ``torch.matmul`` of shapes ``a_shape`` @ ``b_shape`` (None: unsupported)."""
    na, nb = len(a_shape), len(b_shape)
    if na == 0 or nb == 0:
        return None
    if na == 1 and nb == 1:
        return "K", "K", ""
    if na == 1:
        batch = _LETTERS[: nb - 2]
        return "K", batch + "KN", batch + "N"
    if nb == 1:
        batch = _LETTERS[: na - 2]
        return batch + "MK", "K", batch + "M"
    ba, bb = a_shape[:-2], b_shape[:-2]
    n = max(len(ba), len(bb))
    out_batch = ""
    la, lb = [], []
    for i in range(n):
        sa = ba[i - (n - len(ba))] if i >= n - len(ba) else None
        sb = bb[i - (n - len(bb))] if i >= n - len(bb) else None
        c = _LETTERS[i]
        size = max(s for s in (sa, sb) if s is not None)
        out_batch += c if size != 1 else "."
        if sa is not None:
            la.append(c if sa == size and size != 1 else ".")
        if sb is not None:
            lb.append(c if sb == size and size != 1 else ".")
    return "".join(la) + "MK", "".join(lb) + "KN", out_batch + "MN"


def einsum_rule(call: Call) -> Strategy | None:
    """``torch.einsum(equation, *operands)`` without ellipsis or repeated labels."""
    eq = call.args[0]
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != len(call.tensors) or any(len(set(s)) != len(s) for s in ins + [out]):
        return None
    for s, t in zip(ins, call.tensors):
        if len(s) != t.ndim:
            return None
    return contraction_rule(call, ins, out)


def embedding_rule(call: Call) -> Strategy | None:
    """``F.embedding(input, weight, padding_idx, max_norm, ...)``.

    Row-sharded (vocab) weight: replicated indices, Partial output, local kernel
    ``embedding_vocab`` masking ids outside the local rows. Column-sharded weight: output
    sharded on its last dim. Replicated weight: the output follows the indices.
    """
    if call.arg(3, "max_norm", None) is not None or len(call.tensors) != 2:
        return None
    if call.arg(5, "scale_grad_by_freq", False) and any(
        isinstance(p, Shard) and p.dim == 0 for p in call.tensors[1].placements
    ):
        return None  # frequencies must count the original ids: gather the table
    idx, w = call.tensors
    out_last = idx.ndim
    uses_kernel = []

    def choose(d, cur):
        pi, pw = cur
        if isinstance(pi, Partial):
            pi = REPLICATE
        if isinstance(pw, Shard) and pw.dim == 0:
            uses_kernel.append(d)
            return [REPLICATE, pw], PSUM
        if isinstance(pw, Shard) and pw.dim == 1:
            return [REPLICATE, pw], Shard(out_last)
        if isinstance(pw, Partial) and pw.reduce_op in ("sum", "avg"):
            return [REPLICATE, pw], pw
        if isinstance(pi, Shard):
            return [pi, REPLICATE], Shard(pi.dim)
        return [REPLICATE, REPLICATE], REPLICATE

    st = per_mesh_dim(call, choose)
    if uses_kernel:
        st.kernel = "embedding_vocab"
    return st


def softmax_rule(call: Call) -> Strategy | None:
    """softmax / log_softmax over ``dim``: that dim must be whole; other shards stay."""
    x = call.tensors[0]
    dim = call.arg(1, "dim", None)
    if dim is None:
        return None
    dim = normalize_dim(dim, x.ndim)

    def choose(d, cur):
        p = cur[0]
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == dim):
            p = REPLICATE
        return [p] + [REPLICATE] * (len(cur) - 1), p

    return per_mesh_dim(call, choose)


def norm_rule(call: Call) -> Strategy | None:
    """layer_norm / rms_norm: normalised (trailing) dims whole, weight and bias replicated."""
    x = call.tensors[0]
    shape = call.arg(1, "normalized_shape")
    n_norm = 1 if isinstance(shape, int) else len(shape)
    first = x.ndim - n_norm

    def choose(d, cur):
        p = cur[0]
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= first):
            p = REPLICATE
        return [p] + [REPLICATE] * (len(cur) - 1), p

    return per_mesh_dim(call, choose)


def sdpa_rule(call: Call) -> Strategy | None:
    """scaled_dot_product_attention: shard batch or heads consistently on q, k, v (and mask)."""
    if call.arg(4, "dropout_p", 0.0) not in (0, 0.0):
        return None  # random dropout: the fallback keeps every rank's stream identical
    ts = call.tensors
    q = ts[0]
    nb = q.ndim - 2  # batch-like dims
    ms = call.mesh_shape

    def ok_dim(b, n):
        for t in ts[:3]:
            if t.ndim != q.ndim:
                return False
        if b == nb - 1 and ts[1].shape[b] != q.shape[b]:  # GQA heads must split evenly
            return q.shape[b] % n == 0 and ts[1].shape[b] % n == 0
        return all(t.shape[b] == q.shape[b] for t in ts[:3])

    def choose(d, cur):
        votes: dict[int, int] = {}
        for i, p in enumerate(cur[:3]):
            if isinstance(p, Shard) and p.dim < nb:
                votes[p.dim] = votes.get(p.dim, 0) + ts[i].numel()
        for b in sorted(votes, key=lambda v: -votes[v]):
            if ok_dim(b, ms[d]):
                tgt: list[Placement] = [Shard(b)] * 3
                for t in ts[3:]:
                    k = b - (q.ndim - t.ndim)
                    tgt.append(Shard(k) if k >= 0 and t.shape[k] == q.shape[b] else REPLICATE)
                return tgt, Shard(b)
        return [REPLICATE] * len(cur), REPLICATE

    return per_mesh_dim(call, choose)


def loss_rule(call: Call) -> Strategy | None:
    """cross_entropy / nll_loss with class-index targets.

    Sample (batch or spatial) dims may be sharded: ``reduction="sum"`` gives a Partial(sum)
    result, ``"mean"`` divides by the global weight of the valid targets, ``"none"`` keeps the
    sharding. The class dim may be sharded too (vocabulary parallel): ``cross_entropy`` always,
    ``nll_loss`` inside ``loss_parallel()``; the log-sum-exp and the target logit are reduced
    across the class shards, so logits are never gathered. Both run the local kernel
    ``class_loss`` unless nothing is sharded.
    """
    if call.arg(3, "size_average", None) is not None or call.arg(5, "reduce", None) is not None:
        return None
    reduction = call.arg(6, "reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        return None
    ts = call.tensors
    x, t = ts[0], ts[1]
    if x.ndim < 2 or t.ndim != x.ndim - 1:
        return None  # probabilities as targets, or an unbatched input: use the fallback
    vocab_ok = call.name == "cross_entropy" or call.options.get("loss_parallel", False)

    def t_dim(k):  # target dim matching input dim k (k != 1)
        return 0 if k == 0 else k - 1

    sharded = []

    def choose(d, cur):
        px, pt = cur[0], cur[1]
        rest = [REPLICATE] * (len(cur) - 2)
        if isinstance(px, Shard) and px.dim == 1 and vocab_ok:
            sharded.append(d)
            return [px, REPLICATE] + rest, REPLICATE
        k = None
        if isinstance(px, Shard) and px.dim != 1:
            k = px.dim
        elif isinstance(pt, Shard):
            k = pt.dim if pt.dim == 0 else pt.dim + 1
        if k is None:
            return [REPLICATE] * len(cur), REPLICATE
        sharded.append(d)
        tgt = [Shard(k), Shard(t_dim(k))] + rest
        if reduction == "none":
            return tgt, Shard(t_dim(k))
        return tgt, PSUM

    st = per_mesh_dim(call, choose)
    if sharded:
        st.kernel = "class_loss"
    return st


def log_softmax_rule(call: Call) -> Strategy | None:
    """log_softmax: inside ``loss_parallel()`` a sharded class dim stays sharded (kernel
    ``log_softmax_sharded``); otherwise like softmax."""
    x = call.tensors[0]
    dim = call.arg(1, "dim", None)
    if dim is None or not call.options.get("loss_parallel", False):
        return softmax_rule(call)
    dim = normalize_dim(dim, x.ndim)
    if not any(isinstance(p, Shard) and p.dim == dim for p in x.placements):
        return softmax_rule(call)

    def choose(d, cur):
        p = cur[0]
        if isinstance(p, Partial):
            p = REPLICATE
        return [p] + [REPLICATE] * (len(cur) - 1), p

    st = per_mesh_dim(call, choose)
    st.kernel = "log_softmax_sharded"
    return st


def rotary_rule(call: Call) -> Strategy | None:
    """rotary_position_embedding(q, k, cos, sin), q/k ``[b, s, h, d]``, cos/sin ``[s, d]``:
    batch and heads stay sharded (cos/sin replicated); a sharded sequence splits cos/sin alike;
    head_dim and Partial inputs are made whole."""
    ts = call.tensors
    if len(ts) != 4 or ts[0].ndim != 4 or ts[1].ndim != 4:
        return None

    def choose(d, cur):
        qp, kp = cur[0], cur[1]
        for p in (qp, kp):
            if isinstance(p, Shard) and p.dim in (0, 1, 2):
                k = p.dim
                rope = Shard(ts[2].ndim - 2) if k == 1 else REPLICATE
                return [Shard(k), Shard(k), rope, rope], [Shard(k), Shard(k)]
        return [REPLICATE] * 4, [REPLICATE, REPLICATE]

    return per_mesh_dim(call, choose)
