"""Parallel styles for ``GroupedExperts``, applied with ``hp_dtensor.parallel.parallelize_module``.

- ``ExpertParallel()`` on a 1-D mesh: experts split over the ranks (parameters ``Shard(0)``);
  the experts' dispatcher becomes an all-to-all one over that mesh.
- ``TensorParallel()`` on a 1-D mesh: each expert's hidden dimension split (``w1``/``w3``
  ``Shard(1)``, ``w2`` ``Shard(2)``); every rank takes the same tokens and the outputs are summed.
- ``ExpertTensorParallel()`` on a 2-D ``[ep, tp]`` mesh: both at once.

Styles are frozen values: applying one changes the module, never the style.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from hp_dtensor import DeviceMesh, DTensor, Placement, Shard, distribute_tensor
from hp_dtensor.parallel import ParallelStyle

from ._dispatch import AllToAllDispatcher, OneSidedDispatcher, check_ep_mesh, check_padding
from ._experts import GroupedExperts
from .errors import DispatchError, MoEConfigError, MoEMeshError

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]

_DISPATCHERS = {"all_to_all": AllToAllDispatcher, "one_sided": OneSidedDispatcher}


def _check_module(module, style: str, path: str) -> None:
    if not isinstance(module, GroupedExperts):
        raise DispatchError(
            f"{style} applies to GroupedExperts; {path or type(module).__name__!r} is a "
            f"{type(module).__name__}: use the key of the MoE's experts, e.g. "
            f'{{"experts": {style}()}} on the MoE or "layers.*.moe.experts" on the model'
        )
    if isinstance(module.w1, DTensor):
        raise DispatchError(
            f"{style}: {path or 'the experts'} are already distributed "
            f"({module.w1.placements}): apply one expert style per module"
        )


def _check_mesh(mesh, style: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        kind = type(mesh).__name__
        if kind == "DeviceMesh":  # torch.distributed's: say whose
            kind = f"{type(mesh).__module__}.{kind}"
        raise MoEMeshError(
            f"{style}: device_mesh={mesh!r} is a {kind}, not an hp_dtensor DeviceMesh: build one "
            "with hp_dtensor.init_device_mesh(...)"
        )


def _distribute(module: nn.Module, mesh, placements: dict[str, tuple[Placement, ...]]) -> None:
    for name, pl in placements.items():
        p = getattr(module, name)
        dt = distribute_tensor(p.data, mesh, list(pl))
        module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _check_dispatcher(style) -> None:
    """The dispatcher settings, checked before any parameter is distributed."""
    name = type(style).__name__
    if style.dispatcher not in _DISPATCHERS:
        raise MoEConfigError(
            f"{name}: dispatcher={style.dispatcher!r} is not one of {tuple(_DISPATCHERS)} "
            f"('all_to_all': the collective library's; 'one_sided': hp-kernels' shared or "
            f"symmetric memory)"
        )
    check_padding(style.sync_free, style.rows_per_peer)


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """Split the experts over a 1-D expert-parallel mesh and dispatch tokens to them.

    Rank ``r`` keeps experts ``r * E / ep`` to ``(r + 1) * E / ep - 1`` (``w1``, ``w2``, ``w3``
    become ``Shard(0)`` DTensors). Tokens travel by all-to-all (see ``AllToAllDispatcher``).

    Args:
        dispatcher: ``"all_to_all"`` (hp-dtensor's platform: gloo, NCCL, HCCL) or
            ``"one_sided"`` (hp-kernels; the ranks of one host).
        sync_free: padded all-to-alls with device-side counts (no host sync).
        rows_per_peer: the padded bound for ``sync_free``.

    Gradients of expert weights are sums over the tokens of every rank in the mesh; with
    data-parallel averaging over ``D`` ranks elsewhere, scale them by ``1 / ep`` more (as
    ``fully_shard(..., mesh=<the experts' data-parallel mesh>)`` does with
    ``set_gradient_scaling_factor(1 / ep)``).
    """

    dispatcher: str = "all_to_all"
    sync_free: bool = False
    rows_per_peer: int | None = None

    def validate(self, module, device_mesh, path):
        _check_module(module, "ExpertParallel", path)
        _check_dispatcher(self)
        check_ep_mesh(device_mesh, module.num_experts, "ExpertParallel")

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, "")
        _distribute(module, device_mesh, {n: (Shard(0),) for n in ("w1", "w2", "w3")})
        module.dispatcher = _DISPATCHERS[self.dispatcher](
            module.num_experts,
            device_mesh,
            sync_free=self.sync_free,
            rows_per_peer=self.rows_per_peer,
        )
        return module


@dataclass(frozen=True)
class TensorParallel(ParallelStyle):
    """Split every expert's hidden dimension over a 1-D tensor-parallel mesh.

    ``w1``/``w3`` become ``Shard(1)``, ``w2`` ``Shard(2)``; the ranks take the same tokens, each
    computes its slice of the hidden units, and the outputs are summed (all-reduce; the input
    gradient is summed in backward). Tokens stay local: no dispatch between ranks.
    """

    def validate(self, module, device_mesh, path):
        _check_module(module, "TensorParallel", path)
        _check_mesh(device_mesh, "TensorParallel")
        if device_mesh.ndim != 1:
            raise MoEMeshError(
                f"TensorParallel (experts) needs a 1-D mesh, got {device_mesh}: pass mesh['tp'] "
                f"(ExpertTensorParallel takes a 2-D [ep, tp] mesh)"
            )

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, "")
        _distribute(module, device_mesh, {"w1": (Shard(1),), "w3": (Shard(1),), "w2": (Shard(2),)})
        return module


@dataclass(frozen=True)
class ExpertTensorParallel(ParallelStyle):
    """Experts over the first dimension of a 2-D ``[ep, tp]`` mesh, each expert's hidden units
    over the second: ``w1``/``w3`` ``(Shard(0), Shard(1))``, ``w2`` ``(Shard(0), Shard(2))``.
    Tokens are dispatched over ``ep`` (the ``tp`` ranks of one ``ep`` coordinate take the same
    tokens); the ``tp`` partial outputs are summed before they travel back.

    The mesh needs dimension names (``mesh["ep", "tp"]``). Arguments as ``ExpertParallel``.
    """

    dispatcher: str = "all_to_all"
    sync_free: bool = False
    rows_per_peer: int | None = None

    def validate(self, module, device_mesh, path):
        _check_module(module, "ExpertTensorParallel", path)
        _check_dispatcher(self)
        _check_mesh(device_mesh, "ExpertTensorParallel")
        if device_mesh.ndim != 2:
            raise MoEMeshError(
                f"ExpertTensorParallel needs a 2-D [ep, tp] mesh, got {device_mesh}: pass "
                f"mesh['ep', 'tp'] (ExpertParallel takes a 1-D mesh)"
            )
        if device_mesh.mesh_dim_names is None:
            raise MoEMeshError(
                "ExpertTensorParallel needs a mesh with dimension names, e.g. "
                "init_device_mesh('cpu', (2, 2), mesh_dim_names=('ep', 'tp'))"
            )
        ep = device_mesh[device_mesh.mesh_dim_names[0]]
        check_ep_mesh(ep, module.num_experts, "ExpertTensorParallel")

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, "")
        _distribute(
            module,
            device_mesh,
            {
                "w1": (Shard(0), Shard(1)),
                "w3": (Shard(0), Shard(1)),
                "w2": (Shard(0), Shard(2)),
            },
        )
        module.dispatcher = _DISPATCHERS[self.dispatcher](
            module.num_experts,
            device_mesh[device_mesh.mesh_dim_names[0]],
            sync_free=self.sync_free,
            rows_per_peer=self.rows_per_peer,
        )
        return module
