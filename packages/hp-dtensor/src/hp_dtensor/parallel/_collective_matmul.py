"""Tensor-parallel linears with the sequence-parallel collective fused into the matmul (what
torchtitan calls async TP and Ascend's MC2): a column-parallel linear whose input arrives
sharded along the sequence all-gathers it chunk by chunk while multiplying the chunks already
there; a row-parallel linear whose output leaves sharded along the sequence reduce-scatters
each chunk of the product as soon as it is computed. Backward pairs them the other way round:
the column-parallel input's gradient is a matmul + reduce-scatter, the row-parallel one's an
all-gather + matmul.

The kernels are supplied, not imported (``hp_dtensor`` sits below the kernel packages): a
:class:`CollectiveMatmul` holds the two functions, with ``hp_kernels.mc2``'s signatures.
:data:`UNFUSED` is the plain-collective reference (all-gather, then matmul; matmul, then
reduce-scatter), bit-for-bit the math of the unfused styles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import HPDTensorTypeError

__all__ = ["UNFUSED", "CollectiveMatmul"]


@dataclass(frozen=True)
class CollectiveMatmul:
    """The two fused kernels a tensor-parallel linear uses with ``collective_matmul=``.

    ``all_gather_matmul(x_shard, weights, *, group, gather_dim, return_gathered)`` returns
    ``(gathered, [gathered @ w for w in weights])`` (``hp_kernels.mc2.all_gather_matmul``);
    ``matmul_reduce_scatter(x, weight, *, group, scatter_dim)`` returns the reduce-scatter
    (sum) of ``x @ weight`` along ``scatter_dim`` (``hp_kernels.mc2.matmul_reduce_scatter``).
    Weights are ``(K, N)``: ``x @ w``.
    """

    all_gather_matmul: Callable
    matmul_reduce_scatter: Callable
    name: str = "custom"

    def __post_init__(self) -> None:
        for arg in ("all_gather_matmul", "matmul_reduce_scatter"):
            if not callable(getattr(self, arg)):
                raise HPDTensorTypeError(
                    f"CollectiveMatmul: {arg}={getattr(self, arg)!r} is not callable: pass a "
                    "function with hp_kernels.mc2's signature"
                )


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(y: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    moved = y.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def _unfused_all_gather_matmul(
    x_shard, weights: Sequence[torch.Tensor], *, group=None, gather_dim=0, return_gathered=False
):
    gathered = _all_gather(x_shard, group, gather_dim)
    outs = [torch.matmul(gathered, w) for w in weights]
    return (gathered, outs) if return_gathered else outs


def _unfused_matmul_reduce_scatter(x, weight, *, group=None, scatter_dim=0, reduce_op="sum"):
    return _reduce_scatter(torch.matmul(x, weight), group, scatter_dim)


#: the plain-collective reference: all-gather then matmul, matmul then reduce-scatter
UNFUSED = CollectiveMatmul(
    _unfused_all_gather_matmul, _unfused_matmul_reduce_scatter, name="unfused"
)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    """``all_gather(x, dim) @ w.T + b`` (column-parallel: ``w`` holds this rank's output
    features); backward: the input's gradient is ``reduce_scatter(dy @ w, dim)``."""

    @staticmethod
    def forward(ctx, x, w, b, kernels: CollectiveMatmul, group, dim: int):
        gathered, (y,) = kernels.all_gather_matmul(
            x.contiguous(), [w.t()], group=group, gather_dim=dim, return_gathered=True
        )
        if b is not None:
            y = y + b
        ctx.save_for_backward(gathered, w)
        ctx.kernels, ctx.group, ctx.dim, ctx.has_bias = kernels, group, dim, b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.kernels.matmul_reduce_scatter(dy, w, group=ctx.group, scatter_dim=ctx.dim)
        dw = _rows(dy).t() @ _rows(gathered) if ctx.needs_input_grad[1] else None
        db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter(x @ w.T, dim) + b`` (row-parallel: ``x`` and ``w`` hold this rank's
    input features, ``b`` is whole); backward: the input's gradient is ``all_gather(dy, dim) @
    w``, the bias's this rank's partial sum (the caller marks it ``Partial``)."""

    @staticmethod
    def forward(ctx, x, w, b, kernels: CollectiveMatmul, group, dim: int):
        y = kernels.matmul_reduce_scatter(x.contiguous(), w.t(), group=group, scatter_dim=dim)
        if b is not None:
            y = y + b
        ctx.save_for_backward(x, w)
        ctx.kernels, ctx.group, ctx.dim, ctx.has_bias = kernels, group, dim, b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        gathered, (dx,) = ctx.kernels.all_gather_matmul(
            dy, [w], group=ctx.group, gather_dim=ctx.dim, return_gathered=True
        )
        dw = _rows(gathered).t() @ _rows(x) if ctx.needs_input_grad[1] else None
        db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def all_gather_linear(x, weight, bias, kernels: CollectiveMatmul, group, dim: int):
    """Column-parallel ``linear(all_gather(x, dim), weight, bias)`` on local tensors."""
    return _AllGatherLinear.apply(x, weight, bias, kernels, group, dim)


def linear_reduce_scatter(x, weight, bias, kernels: CollectiveMatmul, group, dim: int):
    """Row-parallel ``reduce_scatter(linear(x, weight), dim) + bias`` on local tensors."""
    return _LinearReduceScatter.apply(x, weight, bias, kernels, group, dim)
