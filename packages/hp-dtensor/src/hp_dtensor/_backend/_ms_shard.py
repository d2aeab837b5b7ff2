"""``shard_module`` on MindSpore cells: Layout plans for parameters, inputs and outputs.

A sharded parameter stays a plain ``mindspore.Parameter`` holding this rank's shard (so
optimizers, checkpoints and ``value_and_grad(..., weights=cell.trainable_params())`` see
local tensors), and the cell's instance attribute of the same name becomes an ``MSDTensor``
whose local tensor *is* that Parameter: ``construct`` reads ``self.weight`` as a DTensor, and
the gradient ``value_and_grad`` returns for the Parameter is its local gradient (a shard's
chunk, or the whole gradient of a replicated one: NOTE [Gradient representation]). The cell
must compute with ``hp_dtensor.ms_ops`` (the ``mint`` names, which on plain tensors are the
``mint`` ops), since MindSpore's own ops do not know DTensors.

Forward inputs and outputs are converted as on the torch side: plain tensors are this rank's
piece of the input Layout, DTensors are redistributed to it; outputs are redistributed to the
output Layouts and returned as DTensors, or as local tensors with ``use_local_output``.
"""

from __future__ import annotations

import mindspore as ms

from .._hooks import forward_hooks
from .._layout import Layout
from .._mesh import mesh_from_layout
from ..errors import LayoutError, MeshError
from . import _ms_ops  # noqa: F401  (the DTensor ops this module's tensors use)
from ._ms_dtensor import MSDTensor, distribute_tensor

__all__ = ["shard_cell"]

_DEVICE = {"CPU": "cpu", "Ascend": "npu", "GPU": "cuda"}


def _device_type() -> str:
    return _DEVICE.get(ms.get_context("device_target"), "cpu")


def _mesh_and_placements(layout: Layout):
    return mesh_from_layout(layout, _device_type()), layout.to_placements()


def _to_layout(x, layout, arg: str):
    if layout is None or not isinstance(x, (ms.Tensor, MSDTensor)):
        return x
    if not isinstance(layout, Layout) or layout.tensor_map is None:
        raise LayoutError(f"{arg}={layout!r}: give a bound Layout (or None) on MindSpore")
    mesh, placements = _mesh_and_placements(layout)
    if isinstance(x, MSDTensor):
        if x.device_mesh != mesh:
            raise MeshError(
                f"{arg}: the Layout's mesh {mesh} differs from the tensor's mesh "
                f"{x.device_mesh}: build the Layout with the same shape, axis names and ranks"
            )
        return x.redistribute(mesh, placements) if x.placements != tuple(placements) else x
    return MSDTensor.from_local(x, mesh, placements)


def _owner(cell, dotted: str):
    *path, pname = dotted.split(".")
    sub = cell
    for part in path:
        sub = getattr(sub, part)
    return sub, pname


def shard_cell(cell, params: dict, fwd: dict):
    """``shard_module`` for a MindSpore cell, with the plan already checked
    (``check_sharding_plan``); returns ``cell``."""
    for name, lay in params.items():
        sub, pname = _owner(cell, name)
        p = sub._params[pname]
        mesh, placements = _mesh_and_placements(lay)
        dt = distribute_tensor(p, mesh, placements)
        local = ms.Parameter(dt.to_local(), name=p.name, requires_grad=p.requires_grad)
        setattr(sub, pname, local)  # the cell's registered parameter: the local shard
        sub.__dict__[pname] = MSDTensor(local, dt._spec)  # what construct reads: a DTensor
    pre, post = forward_hooks(
        fwd, _to_layout, lambda o: o.to_local() if isinstance(o, MSDTensor) else o
    )
    if pre is not None:
        cell.register_forward_pre_hook(pre)
    if post is not None:
        cell.register_forward_hook(post)
    return cell
