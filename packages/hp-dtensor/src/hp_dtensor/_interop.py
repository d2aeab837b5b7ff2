"""Zero-copy conversion to and from ``torch.distributed.tensor.DTensor``."""

from __future__ import annotations

import torch
from torch.distributed import tensor as tdt
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

from ._dtensor import DTensor, _make
from ._groups import register_cleanup
from ._mesh import DeviceMesh
from ._placement import Partial, Replicate, Shard
from ._spec import DTensorSpec
from .errors import HPDTensorTypeError

__all__ = ["to_torch", "from_torch", "to_torch_mesh", "from_torch_mesh"]

_TORCH_MESHES: dict = {}
_OUR_MESHES: dict = {}
register_cleanup(_TORCH_MESHES.clear)
register_cleanup(_OUR_MESHES.clear)


def to_torch_mesh(mesh: DeviceMesh) -> TorchMesh:
    """torch's ``DeviceMesh`` over the same ranks and the same process groups (cached)."""
    tm = _TORCH_MESHES.get(mesh)
    if tm is None:
        groups = mesh.get_all_groups()
        tm = TorchMesh.from_group(
            groups if mesh.ndim > 1 else groups[0],
            mesh.device_type,
            mesh=mesh.mesh,
            mesh_dim_names=mesh.mesh_dim_names,
        )
        _TORCH_MESHES[mesh] = tm
        _OUR_MESHES[id(tm)] = mesh
    return tm


def from_torch_mesh(tm: TorchMesh) -> DeviceMesh:
    """Our ``DeviceMesh`` over the same ranks (its groups are looked up in our cache)."""
    m = _OUR_MESHES.get(id(tm))
    if m is None:
        m = DeviceMesh(tm.device_type, tm.mesh.tolist(), mesh_dim_names=tm.mesh_dim_names)
        _OUR_MESHES[id(tm)] = m
        _TORCH_MESHES[m] = tm
    return m


def _to_torch_placement(p):
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    if isinstance(p, Replicate):
        return tdt.Replicate()
    return tdt.Partial(p.reduce_op)


def _from_torch_placement(p):
    if isinstance(p, tdt.Shard):
        return Shard(p.dim)
    if isinstance(p, tdt.Replicate):
        return Replicate()
    if isinstance(p, tdt.Partial):
        return Partial(p.reduce_op)
    raise HPDTensorTypeError(f"torch placement {p!r} has no hp_dtensor equivalent")


def to_torch(dt: DTensor) -> tdt.DTensor:
    """``dt`` as a torch DTensor; the local tensor is shared, not copied."""
    spec = dt._spec
    return tdt.DTensor.from_local(
        dt._local,
        to_torch_mesh(spec.mesh),
        [_to_torch_placement(p) for p in spec.placements],
        run_check=False,
        shape=torch.Size(spec.shape),
        stride=spec.stride,
    )


def from_torch(t: tdt.DTensor) -> DTensor:
    """A torch DTensor as ours; the local tensor is shared, not copied."""
    if not isinstance(t, tdt.DTensor):
        raise HPDTensorTypeError(
            f"DTensor.from_torch: t is a {type(t).__name__}, not a torch.distributed.tensor."
            "DTensor: for a plain tensor use DTensor.from_local or distribute_tensor"
        )
    mesh = from_torch_mesh(t.device_mesh)
    placements = tuple(_from_torch_placement(p) for p in t.placements)
    spec = DTensorSpec(mesh, placements, tuple(t.shape), tuple(t.stride()), t.dtype)
    return _make(t.to_local(), spec)
