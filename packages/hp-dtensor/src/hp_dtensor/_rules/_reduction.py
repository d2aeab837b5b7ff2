"""Reduction rules: sum/mean/amax/... over some dims of one tensor."""

from __future__ import annotations

import math

from .._placement import Partial, Shard
from ._core import REPLICATE, Call, Strategy, TensorMeta, dims_arg, per_mesh_dim

__all__ = ["reduction_rule"]


def _is_even(t: TensorMeta, k: int, mesh_shape, placements) -> bool:
    factor = math.prod(
        s for s, p in zip(mesh_shape, placements) if isinstance(p, Shard) and p.dim == k
    )
    return t.shape[k] % factor == 0


def _has_empty(t: TensorMeta, k: int, mesh_shape, placements) -> bool:
    """True when some rank's shard of dim ``k`` is empty (max/min have no identity there)."""
    factor = math.prod(
        s for s, p in zip(mesh_shape, placements) if isinstance(p, Shard) and p.dim == k
    )
    size = t.shape[k]
    step = -(-size // factor) if size else 0
    return step * (factor - 1) >= size


def reduction_rule(
    call: Call,
    *,
    kind: str | None,
    dim_pos: int = 1,
    keepdim_pos: int | None = 2,
    tuple_out: bool = False,
) -> Strategy | None:
    """Rule for reductions of the first tensor.

    ``kind`` is the partial op a local reduction over a sharded dim produces (``"sum"`` for sum,
    ``"avg"`` for mean on evenly sharded dims, ``"max"``/``"min"``), or None when the sharded
    reduced dims must be gathered first (var, norm, argmax...). ``tuple_out`` for ops returning
    (values, indices) when given a dim.
    """
    if kind == "nansum":  # shards add up, but NaNs inside partial values do not
        partial_in = any(isinstance(p, Partial) for p in call.tensors[0].placements)
        kind = None if partial_in else "sum"
    x = call.tensors[0]
    dim = call.arg(dim_pos, "dim", None)
    if isinstance(dim, tuple) and not dim and call.name in ("amax", "amin"):
        dim = None
    if tuple_out and dim is None:
        tuple_out = False  # max(x) without dim returns one tensor
    reduced = set(dims_arg(dim, x.ndim))
    keepdim = (
        bool(call.arg(keepdim_pos, "keepdim", False))
        if keepdim_pos is not None
        else bool(call.kwargs.get("keepdim", False))
    )

    def out_dim(k):
        return k if keepdim else k - sum(1 for r in reduced if r < k)

    def choose(d, cur):
        p = cur[0]
        rest = [None if i else None for i in range(len(cur))]
        rest = list(cur)
        if isinstance(p, Partial):
            ok = (kind in ("sum", "avg") and p.reduce_op in ("sum", "avg")) or (
                kind is not None and kind == p.reduce_op
            )
            if ok and not tuple_out:
                return rest, p
            rest[0] = REPLICATE
            return rest, ([REPLICATE, REPLICATE] if tuple_out else REPLICATE)
        if isinstance(p, Shard):
            if p.dim in reduced:
                if (
                    kind is None
                    or tuple_out
                    or (kind == "avg" and not _is_even(x, p.dim, call.mesh_shape, x.placements))
                    or (
                        kind in ("max", "min")
                        and _has_empty(x, p.dim, call.mesh_shape, x.placements)
                    )
                ):
                    rest[0] = REPLICATE
                    return rest, ([REPLICATE, REPLICATE] if tuple_out else REPLICATE)
                return rest, Partial(kind)
            o = Shard(out_dim(p.dim))
            return rest, ([o, o] if tuple_out else o)
        return rest, ([REPLICATE, REPLICATE] if tuple_out else REPLICATE)

    return per_mesh_dim(call, choose)
