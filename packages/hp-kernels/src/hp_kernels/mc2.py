"""MC2: matmuls fused with the collective that feeds or drains them, chunk by chunk.

``all_gather_matmul`` multiplies each rank's shard as soon as it is there: on CPU ranks the own
shard's product runs while a native thread (GIL released) copies the shard into shared memory,
then every peer's product reads the peer's slot in place, with no gathered copy unless asked for.
``matmul_reduce_scatter`` writes each destination's partial product straight into the shared
slot (``matmul(out=...)``), signals that destination, and goes on with the next chunk; each rank
then sums the partials meant for it, accumulating in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _dtypes
from ._checks import check_bool, check_dim, check_group, is_tensor_on
from .comm import _D_NIN, _D_ROW, _Call, _tensors, _threads
from .errors import KernelsTypeError, KernelsValueError
from .symm_mem import _require_contiguous

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _weight_list(name: str, weights: object) -> list[torch.Tensor]:
    """``weights`` as a list; a lone tensor would be iterated row by row."""
    if isinstance(weights, torch.Tensor):
        raise KernelsTypeError(
            f"{name}: weights is a Tensor; give a list of (K, N) tensors (wrap one weight in a "
            "list: [w])"
        )
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__"):
        raise KernelsTypeError(
            f"{name}: weights={weights!r} is a {type(weights).__name__}; give a list of (K, N) "
            "tensors"
        )
    return list(weights)


def _check_weights(name: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    if x.dim() == 0:
        raise KernelsValueError(f"{name}: the input is 0-dim; it needs shape (..., K)")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise KernelsValueError(f"{name}: weights[{i}] must be a 2-D tensor (K, N)")
        if w.shape[0] != x.shape[-1]:
            raise KernelsValueError(
                f"{name}: weights[{i}] has shape {tuple(w.shape)}; its first dim must equal the "
                f"input's last dim ({x.shape[-1]})"
            )
        if w.dtype != x.dtype or w.device != x.device:
            raise KernelsTypeError(
                f"{name}: weights[{i}] is {w.dtype} on {w.device}; the input is "
                f"{x.dtype} on {x.device}"
            )


def all_gather_matmul(
    x_shard: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    gather_dim: int = 0,
    return_gathered: bool = False,
) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
    """``[all_gather(x_shard, gather_dim) @ w for w in weights]``, overlapped.

    Args:
        x_shard: this rank's shard (same shape on every rank), ``(..., K)``.
        weights: ``(K, N_i)`` matrices.
        group: the ranks of one host (default: the world).
        gather_dim: the dim of ``x_shard`` the shards are stacked along (not the last one).
        return_gathered: also return the gathered input (first element of a pair).
    """
    if is_tensor_on("cuda", x_shard):
        from . import _cuda

        return _cuda.all_gather_matmul(
            x_shard, weights, group=group, gather_dim=gather_dim, return_gathered=return_gathered
        )
    name = "all_gather_matmul"
    check_group(name, group)
    error = _tensors(name, x_shard=x_shard)
    if error is not None:  # joins the call with a stand-in, so that every rank raises
        x_shard = torch.empty(0, 0)
    dim = 0
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        check_bool(name, return_gathered, "return_gathered")
        _require_contiguous(x_shard, "x_shard")
        if x_shard.dim() < 2:
            raise KernelsValueError(
                f"all_gather_matmul: x_shard has shape {tuple(x_shard.shape)}; it needs at least "
                "2 dims (..., K)"
            )
        dim = check_dim(name, gather_dim, "gather_dim", x_shard.dim(), "x_shard")
        if dim == x_shard.dim() - 1:
            raise KernelsValueError(
                f"all_gather_matmul: gather_dim={gather_dim} must name a dim of x_shard other "
                f"than the last (the contraction dim); x_shard has shape {tuple(x_shard.shape)}"
            )
        weights = _weight_list(name, weights)
        _check_weights(name, x_shard, weights)
    except (TypeError, ValueError) as exc:
        error = exc
        dim, weights = 0, []
    nbytes = x_shard.numel() * x_shard.element_size()
    call = _Call(
        "mc2_ag",
        None if group is None else group,
        dtype=x_shard.dtype,
        n_in=x_shard.numel(),
        n_out=0,
        need=nbytes,
        row=x_shard.shape[dim] if x_shard.dim() else 0,
        error=error,
    )
    world, me = call.world, call.rank
    c = call.c
    m = x_shard.shape[dim] if x_shard.dim() else 0
    outs = []
    for w in weights if error is None else ():
        shape = list(x_shard.shape[:-1]) + [w.shape[1]]
        shape[dim] = m * world
        outs.append(torch.empty(shape, dtype=x_shard.dtype))
    gathered = None
    if return_gathered and error is None:
        gshape = list(x_shard.shape)
        gshape[dim] = m * world
        gathered = torch.empty(gshape, dtype=x_shard.dtype)

    def write(mem):
        return c.AsyncCopy(mem.buffer_addr(me), x_shard.data_ptr(), nbytes)

    def local_products():  # runs while the native thread copies the shard out
        for w, out in zip(weights, outs):
            _matmul_into(x_shard, w, out, dim, me * m, m)
        if gathered is not None:
            gathered.narrow(dim, me * m, m).copy_(x_shard)

    descs = call.start(write, between=local_products)
    if any(d[_D_NIN] != x_shard.numel() or d[_D_ROW] != m for d in descs):
        call.finish()
        raise KernelsValueError(
            "all_gather_matmul: ranks disagree on x_shard's size ("
            + ", ".join(f"rank {r}: {d[_D_NIN]} elements" for r, d in enumerate(descs))
            + "); every shard must have the same shape"
        )
    for i in range(1, world):
        p = (me + i) % world
        peer = call.mem.peer(p, shape=x_shard.shape, dtype=x_shard.dtype)
        copy = None
        if gathered is not None and dim == 0:
            dst = gathered.narrow(0, p * m, m)
            copy = c.AsyncCopy(dst.data_ptr(), peer.data_ptr(), nbytes)
        for w, out in zip(weights, outs):
            _matmul_into(peer, w, out, dim, p * m, m)
        if copy is not None:
            copy.wait()
        elif gathered is not None:
            gathered.narrow(dim, p * m, m).copy_(peer)
    call.finish()
    return (gathered, outs) if return_gathered else outs


def _matmul_into(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, dim: int, start: int, size: int
) -> None:
    target = out.narrow(dim, start, size)
    if target.is_contiguous():
        torch.matmul(x, w, out=target)
    else:
        target.copy_(torch.matmul(x, w))


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scatter_dim: int = 0,
    reduce_op: str = "sum",
) -> torch.Tensor:
    """``reduce_scatter(x @ weight, scatter_dim)``: each chunk's partial product is published
    while the next one is computed.

    Args:
        x: ``(..., K)`` (each rank holds a partial contribution, e.g. a row-parallel input).
        weight: ``(K, N)``.
        group: the ranks of one host (default: the world).
        scatter_dim: dim of the product split over the ranks; its size must divide by the
            group size.
        reduce_op: ``"sum"`` or ``"avg"``.
    """
    if is_tensor_on("cuda", x):
        from . import _cuda

        return _cuda.matmul_reduce_scatter(
            x, weight, group=group, scatter_dim=scatter_dim, reduce_op=reduce_op
        )
    name = "matmul_reduce_scatter"
    check_group(name, group)
    world = dist.get_world_size(group if group is not None else dist.group.WORLD)
    error = _tensors(name, x=x, weight=weight)
    if error is not None:  # joins the call with stand-ins, so that every rank raises
        x, weight = torch.empty(0, 0), torch.empty(0, 0)
    out_shape = list(x.shape[:-1]) + [weight.shape[1] if weight.dim() == 2 else 0]
    dim = 0
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        dim = check_dim(name, scatter_dim, "scatter_dim", len(out_shape), "the product")
        if not isinstance(reduce_op, str):
            raise KernelsTypeError(
                f"matmul_reduce_scatter: reduce_op={reduce_op!r} is a "
                f"{type(reduce_op).__name__}; choose 'sum' or 'avg'"
            )
        _require_contiguous(x, "x")
        _check_weights("matmul_reduce_scatter", x, [weight])
        if reduce_op not in ("sum", "avg"):
            raise KernelsValueError(
                f"matmul_reduce_scatter: reduce_op={reduce_op!r}; choose 'sum' or 'avg'"
            )
        if out_shape[dim] % world:
            raise KernelsValueError(
                f"matmul_reduce_scatter: the product's dim {scatter_dim} has size "
                f"{out_shape[dim]}, which does not divide by the group size {world}"
            )
    except (TypeError, ValueError) as exc:
        error = exc
        dim = 0
    chunk = out_shape[dim] // world
    chunk_shape = list(out_shape)
    chunk_shape[dim] = chunk
    chunk_numel = math.prod(chunk_shape)
    es = x.element_size()
    code = _dtypes.CODES.get(x.dtype, -1)
    call = _Call(
        "mc2_rs",
        group,
        dtype=x.dtype,
        n_in=x.numel(),
        n_out=chunk_numel,
        need=world * chunk_numel * es,
        row=out_shape[dim],
        rop=_dtypes.REDUCE_OPS.get(reduce_op, 0) if error is None else 0,
        error=error,
    )
    me = call.rank
    descs = call.start(lambda mem: None)
    if any(d[_D_ROW] != out_shape[dim] or d[3] != chunk_numel for d in descs):
        call.finish()
        raise KernelsValueError(
            "matmul_reduce_scatter: ranks disagree on the product's shape ("
            + ", ".join(
                f"rank {r}: dim size {d[_D_ROW]}, chunk {d[3]}" for r, d in enumerate(descs)
            )
            + ")"
        )
    mem = call.mem
    last = dim == len(out_shape) - 1
    for i in range(1, world + 1):
        j = (me + i) % world  # own chunk last: the peers' partials are in flight meanwhile
        region = mem.peer(me, shape=chunk_shape, dtype=x.dtype, offset=j * chunk_numel * es)
        if last:
            torch.matmul(x, weight.narrow(1, j * chunk, chunk), out=region)
        else:
            torch.matmul(x.narrow(dim, j * chunk, chunk), weight, out=region)
        if j != me:
            mem.signal(j)
    for i in range(1, world):
        mem.wait((me + i) % world)
    out = torch.empty(chunk_shape, dtype=x.dtype)
    srcs = [mem.buffer_addr((me + i) % world) + me * chunk_numel * es for i in range(world)]
    call.c.reduce(
        out.data_ptr(),
        code,
        srcs,
        code,
        chunk_numel,
        _dtypes.REDUCE_OPS[reduce_op],
        1.0 / world,
        _threads(),
    )
    call.finish()
    return out
