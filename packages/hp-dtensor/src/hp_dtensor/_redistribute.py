"""Running redistribution plans on local torch tensors, forward and backward.

NOTE [Gradient representation]: backward runs on local tensors through torch autograd. The
local gradient of a DTensor with placements P represents the gradient of the *global* tensor
in the dual placements: ``Shard(k)`` -> this rank's chunk of the gradient; ``Replicate`` and
``Partial`` -> the whole gradient with respect to the global value (the same on every rank).
Each redistribution step therefore has an adjoint that keeps this invariant:

    all_gather  <-> chunk           reduce_scatter <-> all_gather
    chunk       <-> all_gather      all_reduce     <-> identity
    all_to_all  <-> all_to_all      pad / partition <-> chunk / identity

These are Megatron's f/g pairs, generalised to any mesh and any placements. The dispatcher adds
the one remaining correction: a replicated input to an op whose output is sharded or partial
along a mesh dimension contributes only part of its gradient on each rank, so its gradient is
all-reduced over that mesh dimension (``AllReduceGrad``).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ._backend import get_platform
from ._placement import Partial, Replicate, Shard
from ._plan import plan_redistribute
from ._shard_math import chunk_size_and_offset, local_shape_and_offset

__all__ = ["redistribute_local", "Redistribute", "AllReduceGrad", "compile_plan"]


class _Op:
    """One executable step: kind, mesh dim, tensor dims and the state it runs in."""

    __slots__ = ("kind", "d", "src", "dst", "parent", "n", "coord", "op")

    def __init__(self, kind, d, src, dst, parent, n, coord, op=None):
        self.kind, self.d, self.src, self.dst = kind, d, src, dst
        self.parent = parent  # size of each tensor dim at this mesh level (before splitting by d)
        self.n, self.coord, self.op = n, coord, op


def _parent_sizes(global_shape, mesh_shape, coord, state, d):
    """Shape of the piece that mesh dim ``d`` splits (after earlier mesh dims)."""
    shape, _ = local_shape_and_offset(global_shape, mesh_shape[:d], coord[:d], state[:d])
    return shape


_ADJOINT = {
    "all_gather": "chunk",
    "chunk": "all_gather",
    "reduce_scatter": "all_gather",
    "all_reduce": None,
    "all_to_all": "all_to_all",
    "pad": "chunk",
    "partition": None,
}


def _dual(p):
    return Replicate() if isinstance(p, Partial) else p


@lru_cache(maxsize=4096)
def compile_plan(mesh, src, dst, global_shape, rs_dims=frozenset()):
    """Forward and backward op lists for ``src -> dst`` on ``mesh`` (cached).

    ``rs_dims``: mesh dims whose all-gather receives *partial* gradients (NOTE [Gathered
    activations]); their adjoint is a reduce-scatter instead of keeping the local chunk.
    """
    coord = mesh.get_coordinate()
    plan = plan_redistribute(mesh.shape, src, dst, global_shape)
    fwd, bwd = [], []
    state = list(src)
    for d in range(len(state)):  # size-1 mesh dims were relabelled by the planner
        if mesh.shape[d] == 1:
            state[d] = dst[d]
    for step in plan.steps:
        parent = _parent_sizes(global_shape, mesh.shape, coord, state, step.mesh_dim)
        n = mesh.shape[step.mesh_dim]
        c = coord[step.mesh_dim]
        op = (
            step.src.reduce_op
            if isinstance(step.src, Partial)
            else (step.dst.reduce_op if isinstance(step.dst, Partial) else None)
        )
        fwd.append(_Op(step.kind, step.mesh_dim, step.src, step.dst, parent, n, c, op))
        adj = _ADJOINT[step.kind]
        if adj == "all_to_all":
            bwd.append(_Op(adj, step.mesh_dim, step.dst, step.src, parent, n, c, None))
        elif step.kind == "all_gather" and step.mesh_dim in rs_dims:
            bwd.append(
                _Op("reduce_scatter", step.mesh_dim, Partial(), step.src, parent, n, c, "sum")
            )
        elif adj == "chunk":  # adjoint of all_gather and pad: keep this rank's chunk
            bwd.append(_Op(adj, step.mesh_dim, Replicate(), step.src, parent, n, c, None))
        elif adj == "all_gather":  # adjoint of chunk and reduce_scatter
            bwd.append(_Op(adj, step.mesh_dim, step.dst, Replicate(), parent, n, c, None))
        state[step.mesh_dim] = step.dst
    bwd.reverse()
    return tuple(fwd), tuple(bwd)


def _run(ops, x, mesh, async_op=False):
    groups = mesh._groups
    platform = get_platform(mesh.device_type)
    for o in ops:
        x = _STEP[o.kind](x, o, groups[o.d], platform)
    return x


def redistribute_local(x: torch.Tensor, mesh, src, dst, global_shape) -> torch.Tensor:
    """``x`` (local, placements ``src``) as the local tensor of placements ``dst``; no autograd."""
    fwd, _ = compile_plan(mesh, src, dst, global_shape)
    return _run(fwd, x, mesh)


class GatherInfo:
    """NOTE [Gathered activations]: a replicated activation made by all-gathering a shard is
    usually read by split consumers (the column-parallel projections after a sequence-parallel
    norm). Their gradients are partial; instead of all-reducing them and keeping the local chunk,
    the all-gather's adjoint can reduce-scatter them: half the bytes, and no extra node.

    The choice is made by the first consumer: a split one switches the dims to *partial*
    gradients (later replicated consumers scale their exact gradients by 1/n so that the
    reduce-scatter adds them up right); a replicated one first keeps the usual representation
    (later split consumers all-reduce as usual). ``Redistribute`` reads the final state in
    backward.
    """

    __slots__ = ("dims", "state")

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims
        self.state = dict.fromkeys(dims, "undecided")

    def partial_dims(self) -> frozenset:
        return frozenset(d for d, s in self.state.items() if s == "partial")


class Redistribute(torch.autograd.Function):
    """Differentiable redistribution (see NOTE [Gradient representation]).

    ``rs_dims`` (fixed) or ``info`` (a ``GatherInfo`` decided later in forward) name all-gathered
    mesh dims whose incoming gradients are partial: backward reduce-scatters them.
    """

    @staticmethod
    def forward(ctx, x, mesh, src, dst, global_shape, rs_dims=frozenset(), info=None):
        fwd, _ = compile_plan(mesh, src, dst, global_shape)
        ctx.key = (mesh, src, dst, global_shape)
        ctx.rs_dims, ctx.info = rs_dims, info
        ctx.mesh = mesh
        return _run(fwd, x, mesh)

    @staticmethod
    def backward(ctx, g):
        rs = ctx.rs_dims | (ctx.info.partial_dims() if ctx.info is not None else frozenset())
        _, bwd = compile_plan(*ctx.key, rs)
        return _run(bwd, g.contiguous(), ctx.mesh), None, None, None, None, None, None


def gathered_dims(mesh, src, dst, global_shape) -> tuple[int, ...]:
    """Mesh dims that ``src -> dst`` all-gathers into Replicate as their last step."""
    plan = plan_redistribute(mesh.shape, src, dst, global_shape)
    last = {}
    for st in plan.steps:
        last[st.mesh_dim] = st.kind
    return tuple(d for d, k in last.items() if k == "all_gather" and mesh.shape[d] > 1)


class AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over some mesh dims in backward."""

    @staticmethod
    def forward(ctx, x, mesh, dims_ops):
        ctx.mesh = mesh
        ctx.dims_ops = dims_ops
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        platform = get_platform(ctx.mesh.device_type)
        for d, op in ctx.dims_ops:
            platform.all_reduce(g, op, ctx.mesh._groups[d])
        return g, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient multiplied by a constant in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class PartialExtremeGrad(torch.autograd.Function):
    """Identity forward on a Partial(max/min) local value; in backward the gradient of the
    global extreme goes to the ranks whose local value attains it (split evenly on ties)."""

    @staticmethod
    def forward(ctx, x, mesh, dims_ops):
        ctx.mesh, ctx.dims_ops = mesh, dims_ops
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        platform = get_platform(ctx.mesh.device_type)
        full = x.detach().clone()
        for d, op in ctx.dims_ops:
            platform.all_reduce(full, op, ctx.mesh._groups[d])
        mask = (x == full).to(g.dtype)
        count = mask.clone()
        for d, _ in ctx.dims_ops:
            platform.all_reduce(count, "sum", ctx.mesh._groups[d])
        return g * mask / count.clamp_min(1), None, None


# -- the steps -------------------------------------------------------------------------------
def _all_gather(x, o: _Op, group, platform):
    k = o.src.dim
    size = o.parent[k]
    n = o.n
    step = -(-size // n) if size else 0
    xk = x.movedim(k, 0) if k else x
    mine = xk.shape[0]
    if mine != step:
        pad = xk.new_zeros((step - mine,) + tuple(xk.shape[1:]))
        xk = platform.cat([xk, pad], 0)
    xk = xk.contiguous()
    out = xk.new_empty((n * step,) + tuple(xk.shape[1:]))
    platform.all_gather_into(out, xk, group)
    if n * step != size:
        out = out.view((n, step) + tuple(xk.shape[1:]))
        out = platform.cat([out[i, : chunk_size_and_offset(size, n, i)[0]] for i in range(n)], 0)
    return out.movedim(0, k).contiguous() if k else out


def _chunk(x, o: _Op, group, platform):
    k = o.dst.dim
    length, start = chunk_size_and_offset(x.shape[k], o.n, o.coord)
    return x.narrow(k, start, length)


def _reduce_scatter(x, o: _Op, group, platform):
    k = o.dst.dim
    size = x.shape[k]
    n = o.n
    step = -(-size // n) if size else 0
    xk = x.movedim(k, 0) if k else x
    if n * step != size:
        pad = xk.new_zeros((n * step - size,) + tuple(xk.shape[1:]))
        xk = platform.cat([xk, pad], 0)
    xk = xk.contiguous()
    out = xk.new_empty((step,) + tuple(xk.shape[1:]))
    op = o.op
    platform.reduce_scatter_into(out, xk, "sum" if op == "avg" else op, group)
    if op == "avg":
        out = out / n
    length, _ = chunk_size_and_offset(size, n, o.coord)
    if length != step:
        out = out[:length]
    return out.movedim(0, k).contiguous() if k else out


def _all_reduce(x, o: _Op, group, platform):
    out = platform.clone(x.contiguous())
    platform.all_reduce(out, o.op, group)
    return out


def _all_to_all(x, o: _Op, group, platform):
    i, j = o.src.dim, o.dst.dim
    n = o.n
    size_i = o.parent[i]
    size_j = x.shape[j]
    pieces = []
    in_splits = []
    for r in range(n):
        length, start = chunk_size_and_offset(size_j, n, r)
        piece = x.narrow(j, start, length).contiguous()
        pieces.append(piece.reshape(-1))
        in_splits.append(piece.numel())
    send = platform.cat(pieces, 0) if pieces else x.new_empty(0)
    my_j, _ = chunk_size_and_offset(size_j, n, o.coord)
    out_shapes = []
    out_splits = []
    for r in range(n):
        li, _ = chunk_size_and_offset(size_i, n, r)
        shape = list(x.shape)
        shape[i] = li
        shape[j] = my_j
        out_shapes.append(shape)
        numel = 1
        for s in shape:
            numel *= s
        out_splits.append(numel)
    recv = x.new_empty(sum(out_splits))
    platform.all_to_all(recv, send, out_splits, in_splits, group)
    parts = recv.split(out_splits)
    return platform.cat([p.view(tuple(s)) for p, s in zip(parts, out_shapes)], i)


def _pad(x, o: _Op, group, platform):
    k = o.src.dim
    size = o.parent[k]
    length, start = chunk_size_and_offset(size, o.n, o.coord)
    before, after = list(x.shape), list(x.shape)
    before[k], after[k] = start, size - start - length
    return platform.cat([x.new_zeros(tuple(before)), x, x.new_zeros(tuple(after))], k)


def _partition(x, o: _Op, group, platform):
    if o.op == "sum" and o.coord != 0:
        return x.new_zeros(tuple(x.shape))
    return x


_STEP = {
    "all_gather": _all_gather,
    "chunk": _chunk,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "pad": _pad,
    "partition": _partition,
}

_ = Shard
