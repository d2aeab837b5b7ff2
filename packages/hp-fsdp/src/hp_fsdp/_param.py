"""Per-parameter state of a ``fully_shard`` group: the sharded DTensor, its flat-buffer
geometry, and the unsharded tensor refilled by every all-gather."""

from __future__ import annotations

import torch
import torch.nn as nn

import hp_dtensor as hp
from hp_dtensor import DeviceMesh, DTensor, Shard

__all__ = ["FSDPParam", "local", "shard_param", "tp_dp_grid"]


def local(t):
    """A DTensor's local piece; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def unmoved(shape, dim):
    """The parameter's own shape from the flat-buffer shape (sharded dim first)."""
    if not dim:
        return shape
    rest = list(shape[1:])
    return tuple(rest[:dim] + [shape[0]] + rest[dim:])


class FSDPParam:
    """One parameter of a group.

    The flat buffers see the sharded dim moved to the front: ``shape`` is the (moved)
    unsharded shape, ``rest`` the elements per row, ``chunk`` the rows per rank (padded),
    ``padded`` this parameter's elements per rank in the flat buffer, ``rows`` this rank's real
    rows. ``places`` lists every (module, attribute) holding the parameter (tied weights share
    one ``FSDPParam``).
    """

    __slots__ = (
        "module",
        "name",
        "fqn",
        "sharded",
        "unsharded",
        "shape",
        "rest",
        "chunk",
        "padded",
        "rows",
        "inner",
        "dim",
        "places",
    )

    def __init__(
        self, module, name, fqn, sharded: nn.Parameter, shape, n, inner=None, dim=0, aliases=()
    ):
        self.module, self.name, self.fqn, self.sharded = module, name, fqn, sharded
        self.places = [(module, name)] + list(aliases)
        self.dim = dim
        if dim:
            shape = (shape[dim],) + tuple(s for i, s in enumerate(shape) if i != dim)
        self.unsharded: nn.Parameter | None = None
        #: for a parameter already sharded by tensor (or expert) parallelism: (tp mesh, tp
        #: placements, global shape); ``shape`` is then this rank's tensor-parallel piece
        self.inner = inner
        self.shape = tuple(shape)
        self.rest = 1
        for s in self.shape[1:]:
            self.rest *= s
        self.chunk = -(-self.shape[0] // n) if self.shape[0] else 0
        self.padded = self.chunk * self.rest
        self.rows = sharded.to_local().shape[dim]

    def even(self, n: int) -> bool:
        """Sharded on dim 0 into ``n`` equal, non-empty chunks (the fused copy paths' case)."""
        return not self.dim and self.padded > 0 and self.shape[0] == n * self.chunk

    def fresh_unsharded(self, dtype: torch.dtype, dev) -> torch.Tensor:
        """The local tensor of the unsharded parameter, with storage (created once; its
        storage is resized back after each reshard)."""
        if self.unsharded is None:
            t = torch.empty(unmoved(self.shape, self.dim), dtype=dtype, device=dev)
            if self.inner is not None:
                tp_mesh, tp_pl, gshape = self.inner
                t = DTensor.from_local(t, tp_mesh, tp_pl, shape=gshape)
            self.unsharded = nn.Parameter(t, requires_grad=self.sharded.requires_grad)
        elif self.unsharded.requires_grad != self.sharded.requires_grad:  # (un)frozen since
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        t = local(self.unsharded)
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)
        return t

    def free(self) -> None:
        """Release the unsharded storage (the tensor stays, for autograd to refill later)."""
        if self.unsharded is not None:
            local(self.unsharded).untyped_storage().resize_(0)

    def has_grad(self) -> bool:
        return self.unsharded is not None and local(self.unsharded).grad is not None


def shard_param(p, fqn: str, mesh: DeviceMesh, placements, dim: int, offload):
    """``(sharded parameter, inner, shape)`` for ``p`` in a group over ``mesh``.

    A plain tensor is split on ``dim``; a DTensor (tensor or expert parallel, on a 1-D mesh)
    keeps its split and each piece is split further on dim 0 over ``mesh``. With ``offload`` the
    sharded tensor lives on the CPU."""
    if isinstance(p, DTensor):
        sp, inner = _shard_tp_param(p, mesh)
        shape = p.to_local().shape
    else:
        pl = [Shard(dim) if isinstance(q, Shard) else q for q in placements]
        dt = hp.distribute_tensor(p.detach(), mesh, pl, src_data_rank=None)
        sp, inner, shape = nn.Parameter(dt, requires_grad=p.requires_grad), None, p.shape
    if offload is not None:
        sp = _to_cpu(sp, offload.pin_memory)
    return sp, inner, shape


def _to_cpu(sp: nn.Parameter, pin: bool) -> nn.Parameter:
    cpu = sp.to_local().detach().to("cpu")
    if pin and torch.cuda.is_available():
        cpu = cpu.pin_memory()
    dt = DTensor.from_local(cpu, sp.device_mesh, sp.placements, shape=sp.shape, stride=sp.stride())
    return nn.Parameter(dt, requires_grad=sp.requires_grad)


# (tp mesh, dp mesh) -> the 2-D mesh spanning both: keyed by immutable meshes
_TP_DP_MESHES: dict = {}
hp.register_cleanup(_TP_DP_MESHES.clear)  # they hold groups: gone with the process group


def _shard_tp_param(p: DTensor, dp_mesh: DeviceMesh):
    """A (tp-sharded) DTensor parameter, sharded further on dim 0 over the data-parallel
    mesh: a DTensor on the (tp, dp) mesh with placements (tp placement, Shard(0)) -- the
    tensor-parallel split first, then each tp piece split over dp."""
    tp_mesh = p.device_mesh
    key = (tp_mesh, dp_mesh)
    mesh2 = _TP_DP_MESHES.get(key)
    if mesh2 is None:
        grid = tp_dp_grid(tp_mesh, dp_mesh)
        names = ((tp_mesh.mesh_dim_names or ("tp",))[0], (dp_mesh.mesh_dim_names or ("dp",))[0])
        mesh2 = DeviceMesh(tp_mesh.device_type, grid, mesh_dim_names=names)
        _TP_DP_MESHES[key] = mesh2
    piece_full = p.to_local().detach()
    length, start = hp.chunk_size_and_offset(
        piece_full.shape[0], dp_mesh.size(), dp_mesh.get_local_rank()
    )
    piece = piece_full.narrow(0, start, length).clone()
    dt = DTensor.from_local(
        piece, mesh2, (p.placements[0], hp.Shard(0)), shape=p.shape, stride=p.stride()
    )
    return nn.Parameter(dt, requires_grad=p.requires_grad), (tp_mesh, p.placements, p.shape)


def tp_dp_grid(tp_mesh, dp_mesh) -> list[list[int]]:
    """The (tp, dp) rank grid that ``tp_mesh`` and ``dp_mesh`` (1-D sub-meshes of one mesh,
    e.g. ``mesh['tp']`` and ``mesh['dp_shard']``) span around this rank: the other dimensions
    of that mesh (a pipeline dimension, say) stay at this rank's coordinates. A flattened
    ``dp`` (``dp_shard_cp``) counts its dimensions in row-major order."""
    root = tp_mesh._root
    if root is not dp_mesh._root or tp_mesh.ndim != 1 or dp_mesh.ndim != 1:
        raise ValueError(
            "composing fully_shard with tensor parallelism needs 1-D sub-meshes mesh['dp'] "
            "and mesh['tp'] of one DeviceMesh"
        )
    tp_dims, dp_dims = tp_mesh._root_dims[0], dp_mesh._root_dims[0]
    if set(tp_dims) & set(dp_dims):
        raise ValueError("the tp and dp meshes of fully_shard overlap: give disjoint dimensions")
    shape, ranks, me = root.shape, root.rank_list, root.get_coordinate()

    def coords(dims, index):  # row-major over the (possibly flattened) dims
        out = {}
        for d in reversed(dims):
            out[d] = index % shape[d]
            index //= shape[d]
        return out

    def rank_at(coord):
        flat = 0
        for d, c in enumerate(coord):
            flat = flat * shape[d] + c
        return ranks[flat]

    grid = []
    for t in range(tp_mesh.size()):
        row = []
        for i in range(dp_mesh.size()):
            c = list(me)
            for d, v in {**coords(tp_dims, t), **coords(dp_dims, i)}.items():
                c[d] = v
            row.append(rank_at(c))
        grid.append(row)
    return grid
