"""Pointwise and factory-like rules (broadcast-aware)."""

from __future__ import annotations

from .._placement import Partial, Placement, Replicate, Shard
from ._core import REPLICATE, Call, Strategy, TensorMeta, per_mesh_dim

__all__ = ["pointwise_rule", "like_factory_rule", "broadcast_shape", "cast_rule"]


def broadcast_shape(shapes) -> tuple[int, ...]:
    """The broadcast of several shapes (numpy rules)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        off = ndim - len(s)
        for i, n in enumerate(s):
            if n != 1:
                out[off + i] = n
    return tuple(out)


def _out_dim(t: TensorMeta, k: int, out_shape) -> int | None:
    """Output dim of input dim ``k``, or None when ``k`` is broadcast."""
    o = k + len(out_shape) - t.ndim
    return o if t.shape[k] == out_shape[o] else None


def _in_dim(t: TensorMeta, o: int, out_shape) -> int | None:
    """Input dim feeding output dim ``o`` without broadcasting, or None."""
    k = o - (len(out_shape) - t.ndim)
    if k < 0 or t.shape[k] != out_shape[o]:
        return None
    return k


def pointwise_rule(call: Call, *, linear: str = "none", inplace: bool = False) -> Strategy | None:
    """Rule for elementwise ops.

    ``linear`` says how Partial inputs may pass through: ``"all"`` (the op is linear in every
    tensor: add, sub, neg, casts...), ``"first"`` (linear in the first tensor when the others
    are replicated: div), ``"one"`` (linear in any one tensor when the others are replicated:
    mul), ``"none"``. With ``inplace`` the first tensor keeps its placements.
    """
    ts = call.tensors
    if not ts:
        return None
    if linear == "all" and any(_is_number(a) for a in call.args):
        linear = "none"  # x + 1 on partial values would add 1 on every rank
    if linear == "first" and not isinstance(call.args[0] if call.args else None, TensorMeta):
        linear = "none"  # torch.div(2.0, x): x is the denominator
    out_shape = broadcast_shape([t.shape for t in ts])
    if inplace and ts[0].shape != out_shape:
        return None

    def choose(d, cur: list[Placement]):
        n = len(cur)
        partial_idx = [i for i, p in enumerate(cur) if isinstance(p, Partial)]
        shard_out: dict[int, float] = {}
        for i, p in enumerate(cur):
            if isinstance(p, Shard):
                o = _out_dim(ts[i], p.dim, out_shape)
                if o is not None:
                    shard_out[o] = max(shard_out.get(o, 0), ts[i].numel())
        if inplace:
            self_p = cur[0]
            if isinstance(self_p, Partial):
                return _partial_inplace(cur, self_p, linear)
            target_o = _out_dim(ts[0], self_p.dim, out_shape) if isinstance(self_p, Shard) else None
            return _shard_targets(ts, target_o, out_shape), (
                Shard(target_o) if target_o is not None else REPLICATE
            )
        if partial_idx:
            ops = {cur[i].reduce_op for i in partial_idx}
            if not shard_out and len(ops) == 1:
                op = ops.pop()
                if linear == "all" and op in ("sum", "avg"):
                    return [Partial(op)] * n, Partial(op)
                lin_slots = {"first": (0,), "one": tuple(range(n))}.get(linear, ())
                if len(partial_idx) == 1 and partial_idx[0] in lin_slots and op in ("sum", "avg"):
                    return list(cur), Partial(op)
        if shard_out:
            target_o = max(shard_out, key=lambda o: (shard_out[o], -o))
            return _shard_targets(ts, target_o, out_shape), Shard(target_o)
        return [REPLICATE] * n, REPLICATE

    return per_mesh_dim(call, choose)


def _shard_targets(ts, target_o, out_shape) -> list[Placement]:
    out: list[Placement] = []
    for t in ts:
        k = _in_dim(t, target_o, out_shape) if target_o is not None else None
        out.append(Shard(k) if k is not None else REPLICATE)
    return out


def _partial_inplace(cur, self_p: Partial, linear: str):
    n = len(cur)
    if self_p.reduce_op not in ("sum", "avg"):
        raise _NeedFallback
    if linear == "all":
        return [self_p] * n, self_p
    if linear in ("first", "one"):
        return [self_p] + [REPLICATE] * (n - 1), self_p
    raise _NeedFallback


def _is_number(a) -> bool:
    """A Python number, or anything number-like (a 0-d tensor), among an op's operands."""
    if isinstance(a, (TensorMeta, str, bytes)) or a is None:
        return False
    return isinstance(a, (int, float, complex)) or hasattr(a, "__float__")


def cast_rule(call: Call, *, linear: bool) -> Strategy:
    """Dtype/device casts (``to``, ``type_as``, ``float``...): the output follows the first
    tensor; other tensors (``type_as(other)``) only lend their dtype and never move. Partial
    values pass through only widening float casts (``linear``)."""
    x = call.tensors[0]
    keep = linear and all(
        not isinstance(p, Partial) or p.reduce_op in ("sum", "avg") for p in x.placements
    )
    pl = (
        x.placements
        if keep
        else tuple(REPLICATE if isinstance(p, Partial) else p for p in x.placements)
    )
    inputs = [None if pl == x.placements else pl] + [None] * (len(call.tensors) - 1)
    return Strategy(inputs, pl)


class _NeedFallback(Exception):
    pass


def like_factory_rule(call: Call) -> Strategy:
    """``zeros_like`` and friends: same sharding, values replicated (Partial becomes Replicate).

    Inputs are never moved: only their shape is used.
    """
    t = call.tensors[0]
    out = tuple(REPLICATE if isinstance(p, Partial) else p for p in t.placements)
    return Strategy([None] * len(call.tensors), out)


def safe(rule):
    """Wrap a rule so that an internal ``_NeedFallback`` becomes ``None`` (use the fallback)."""

    def wrapped(call):
        try:
            return rule(call)
        except _NeedFallback:
            return None

    wrapped.__name__ = getattr(rule, "__name__", "rule")
    wrapped.__doc__ = rule.__doc__
    return wrapped


_ = Replicate  # re-exported name used by the table
