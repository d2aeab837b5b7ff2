"""``fully_shard``: FSDP (1-D mesh) and HSDP (2-D mesh) over hp-dtensor.

Each call makes one parameter group. Its parameters become ``DTensor``s sharded on dim 0 over
the shard mesh dimension (replicated over the replicate dimension for HSDP). Around the module's
forward the group all-gathers its parameters as one flat buffer (copy-in, one collective,
copy-out), swaps the unsharded tensors into the module, and (with ``reshard_after_forward``)
frees their storage afterwards; backward gathers them again before the module's gradients are
computed. Gradients are reduce-scattered as one flat buffer in ``reduce_dtype`` (then
all-reduced across replicas for HSDP) into the sharded parameters' ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

import hp_dtensor as hp
from hp_dtensor import DeviceMesh, DTensor, Replicate, Shard

from ._group import ParamGroup
from ._param import tp_dp_grid
from ._state import reduce_now

__all__ = [
    "CPUOffloadPolicy",
    "FSDPError",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "fully_shard",
    "hsdp_sync_stream",
    "get_full_state_dict",
    "load_full_state_dict",
]


class FSDPError(ValueError):
    """A ``fully_shard`` call that cannot work; the message names the argument and the fix."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for one parameter group.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward/backward (None: keep).
        reduce_dtype: dtype gradients are reduced in (None: ``param_dtype``'s, else the
            parameters' own).
        output_dtype: cast floating forward outputs to it (None: leave).
        cast_forward_inputs: cast floating forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Keep sharded parameters, gradients (and so optimizer states) on the CPU; parameters are
    copied to the mesh's device for the all-gather, gradients back after the reduce-scatter.
    ``pin_memory`` pins the CPU shards so the copies can overlap (when an accelerator exists)."""

    pin_memory: bool = True


class _UnshardHandle:
    """What ``HSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        """Wait for the all-gather and copy the parameters out of the flat buffer."""
        self._group.wait_unshard()


class HSDPModule:
    """Mixin the module of a ``fully_shard`` call becomes an instance of."""

    _hp_fsdp: ParamGroup

    def unshard(self, async_op: bool = False):
        """All-gather this group's parameters now (e.g. to prefetch). With ``async_op`` the
        all-gather is only started and a handle is returned whose ``wait()`` finishes it (the
        next forward of the module also does)."""
        self._hp_fsdp.unshard(async_op=async_op)
        return _UnshardHandle(self._hp_fsdp) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and swap the sharded ones back in."""
        self._hp_fsdp.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """With False, gradients accumulate unsharded, without communication, until a backward
        with True reduces everything accumulated."""
        for g in _groups(self, recurse):
            g.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | None, *, recurse: bool = True
    ) -> None:
        """Free unsharded parameters after forward (gather again in backward) or keep them;
        None restores the default (free, except the root's)."""
        for g in _groups(self, recurse):
            g.reshard_after_forward = (
                True if reshard_after_forward is None else bool(reshard_after_forward)
            )
            g.auto_raf = reshard_after_forward is None  # else the user's choice, root included
            g.raf_k = None  # a later True means the whole group, not the smaller one

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """Free unsharded parameters after backward (default) or keep them for the next step."""
        for g in _groups(self, recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_scaling_factor(self, factor: float) -> None:
        """Multiply this group's gradients by ``factor`` once, before they are reduced."""
        self._hp_fsdp.grad_scale = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' parameters as soon as this module's forward starts."""
        self._hp_fsdp.forward_prefetch = [_group_of(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' parameters as soon as this module's backward starts."""
        self._hp_fsdp.backward_prefetch = [_group_of(m, "modules") for m in modules]

    def reduce_gradients(self) -> None:
        """Reduce, now, the gradients accumulated while ``set_requires_gradient_sync(False)``
        was in force (this module and the ``fully_shard`` modules inside it): reduce-scatter,
        and all-reduce across replicas for HSDP, into the sharded parameters' ``.grad``.

        For callers that run many backwards and reduce once outside any of them: pipeline
        schedules (whose weight-gradient passes need not end at the module's inputs, where the
        backward hook would fire). Every rank of the mesh must call it.
        """
        reduce_now(_groups(self, True))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility. Every backward here finishes its reductions before
        it returns, so there is nothing to defer; the flag changes no result."""
        for g in _groups(self, True):
            g.is_last_backward = bool(is_last_backward)


def _groups(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    if not recurse:
        return [module._hp_fsdp]
    return [m._hp_fsdp for m in module.modules() if isinstance(m, HSDPModule)]


def _group_of(module: nn.Module, arg: str) -> ParamGroup:
    if not isinstance(module, HSDPModule):
        raise FSDPError(
            f"{arg} holds a {type(module).__name__} that fully_shard was not applied to"
        )
    return module._hp_fsdp


_CLASSES: dict[type, type] = {}


def _hsdp_class(cls: type) -> type:
    new = _CLASSES.get(cls)
    if new is None:
        new = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {"__module__": cls.__module__})
        _CLASSES[cls] = new
    return new


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: CPUOffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already in a group of a submodule) over ``mesh``.

    Apply bottom-up: blocks first, then the root. A 1-D mesh means FSDP; a 2-D mesh
    ``(replicate, shard)`` means HSDP. ``shard_placement_fn(param)`` may return ``Shard(dim)``
    to shard a parameter on another dim (None: dim 0). Returns ``module``, now also an
    ``HSDPModule``.

    ``reshard_after_forward``: True frees the unsharded parameters after forward and gathers
    them again in backward; False keeps them; an int k keeps this rank's 1/k and gathers
    within groups of k ranks in backward; None (default) is True except for the root (the
    outermost ``fully_shard`` module), which backward needs first (FSDP2's default too).
    Everything is checked before any parameter moves.

    Example::

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    """
    if _is_ms_cell(module):
        from ._backend._mindspore import fully_shard_cell

        return fully_shard_cell(
            module,
            mesh=mesh,
            # parameters stay gathered from forward to the gradient reduction on MindSpore
            reshard_after_forward=(
                None if reshard_after_forward in (None, False) else reshard_after_forward
            ),
            shard_placement_fn=shard_placement_fn,
            mp_policy=None if mp_policy == MixedPrecisionPolicy() else mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
        )
    if isinstance(module, HSDPModule):
        raise FSDPError(
            f"fully_shard was already applied to this {type(module).__mro__[2].__name__}: apply "
            "it once per module (bottom-up: blocks, then the root)"
        )
    if mesh is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hp.init_process_group(device_type=dev)
        mesh = hp.init_device_mesh(dev, (torch.distributed.get_world_size(),))
    if mesh.ndim not in (1, 2):
        raise FSDPError(
            f"mesh has {mesh.ndim} dims: give a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh "
            "(HSDP), e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']"
        )
    shard_size = mesh.shape[-1]
    if (
        reshard_after_forward is not None
        and not isinstance(reshard_after_forward, bool)
        and (
            not isinstance(reshard_after_forward, int)
            or reshard_after_forward < 2
            or reshard_after_forward >= shard_size
            or shard_size % reshard_after_forward
        )
    ):
        raise FSDPError(
            f"reshard_after_forward={reshard_after_forward!r}: give None, True/False, or an int k "
            f"that divides the shard group size {shard_size} with 1 < k < {shard_size} (backward "
            "then gathers within groups of k consecutive ranks, e.g. one node)"
        )
    if offload_policy is not None and not isinstance(offload_policy, CPUOffloadPolicy):
        raise FSDPError(f"offload_policy={offload_policy!r}: give a CPUOffloadPolicy (or None)")
    ignored = {id(p) for p in (ignored_params or ())}
    owned: dict[int, nn.Module] = {}
    replaced: dict[int, nn.Module] = {}  # tensors a submodule's group sharded (and replaced)
    for sub in module.modules():
        if sub is not module and isinstance(sub, HSDPModule):
            owned.update((id(p), sub) for p in sub._hp_fsdp.sharded_params())
            replaced.update((i, sub) for i in sub._hp_fsdp.orig_ids)
    entries = []
    seen: dict[int, str] = {}
    aliases: dict[int, list] = {}
    devices = set()
    for mod_name, sub in module.named_modules():
        for pname, p in sub.named_parameters(recurse=False):
            if p is None or id(p) in ignored:
                continue
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in owned:
                owner = owned[id(p)]
                if not any(m is sub for m in owner.modules()):
                    raise FSDPError(
                        f"parameter {full_name!r} belongs to the group of a submodule "
                        f"({type(owner).__name__}) but is also used outside it (shared across "
                        "groups): fully_shard the common parent only, or untie the parameter"
                    )
                continue
            if id(p) in replaced:
                raise FSDPError(
                    f"parameter {full_name!r} was tied to a parameter that the group of a "
                    f"submodule ({type(replaced[id(p)]).__name__}) has already sharded: tied "
                    "parameters must live in one group; fully_shard their common parent only"
                )
            if id(p) in seen:  # tied inside this group: one entry, several places
                aliases.setdefault(id(p), []).append((sub, pname))
                continue
            if p.ndim == 0:
                raise FSDPError(
                    f"parameter {full_name!r} is 0-d and cannot be sharded: keep it out with "
                    "ignored_params or make it 1-d"
                )
            if isinstance(p, DTensor):
                if p.device_mesh.ndim != 1 or mesh.ndim != 1:
                    raise FSDPError(
                        f"parameter {full_name!r} is a DTensor on a {p.device_mesh.ndim}-D "
                        "mesh: fully_shard composes with tensor parallelism on a 1-D tp mesh "
                        "and a 1-D dp mesh (mesh['tp'], mesh['dp'])"
                    )
                try:
                    tp_dp_grid(p.device_mesh, mesh)
                except ValueError as e:
                    raise FSDPError(f"parameter {full_name!r}: {e}") from None
            seen[id(p)] = full_name
            devices.add(p.device.type)
            entries.append((sub, pname, full_name, p))
    if len(devices) > 1:
        raise FSDPError(
            f"module's parameters are on different devices {sorted(devices)}: move the module "
            "to one device first (module.to(device))"
        )
    for sub in module.modules():
        if sub is not module and isinstance(sub, HSDPModule):
            shared = {id(p) for p in sub._hp_fsdp.sharded_params()} & set(seen)
            if shared:
                raise FSDPError("a parameter is shared between groups: fully_shard their parent")
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    dims = {}
    for _sub, _pname, full_name, p in entries:
        chosen = shard_placement_fn(p) if shard_placement_fn is not None else None
        if chosen is None:
            continue
        if not isinstance(chosen, Shard) or not -p.ndim <= chosen.dim < p.ndim:
            raise FSDPError(
                f"shard_placement_fn returned {chosen!r} for {full_name!r} (shape "
                f"{tuple(p.shape)}): return Shard(dim) with a dim of the parameter, or None"
            )
        if isinstance(p, DTensor) and chosen.dim % p.ndim:
            raise FSDPError(
                f"shard_placement_fn: {full_name!r} is tensor-parallel; it shards on dim 0 only"
            )
        dims[id(p)] = chosen.dim % p.ndim
    group = ParamGroup(
        module,
        mesh,
        entries,
        placements,
        reshard_after_forward,
        mp_policy,
        offload_policy,
        dims,
        aliases,
    )
    for sub in module.modules():  # groups inside this one join its root context
        if sub is not module and isinstance(sub, HSDPModule):
            sub._hp_fsdp.adopt_into(group)
    module.__class__ = _hsdp_class(type(module))
    module._hp_fsdp = group
    group.register_hooks()
    return module


def _is_ms_cell(module) -> bool:
    """A MindSpore ``nn.Cell``, told without importing MindSpore."""
    if isinstance(module, nn.Module):
        return False
    return any(c.__module__.startswith("mindspore") for c in type(module).__mro__)


def parallelize_value_and_grad(fn, grad_position=None, weights=None, has_aux=False):
    """MindSpore: ``mindspore.value_and_grad`` for a network sharded with ``fully_shard``,
    returning the gradients of ``weights`` reduced to this rank's shards (averaged over the
    data-parallel ranks, gradient scaling factors applied), ready for a MindSpore optimizer.

    Example::

        for cell in net.layers:
            fully_shard(cell, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = mindspore.nn.SGD(net.trainable_params(), learning_rate=0.1)
        step = parallelize_value_and_grad(loss_fn, weights=net.trainable_params())
        loss, grads = step(x, y)
        opt(grads)
    """
    from ._backend._mindspore import parallelize_value_and_grad as run

    return run(fn, grad_position=grad_position, weights=weights, has_aux=has_aux)


def hsdp_sync_stream() -> None:
    """Wait for pending gradient communication (call before the optimizer step on GPUs).

    Reductions are issued in stream order; on CPU there is nothing to wait for."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def get_full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict:
    """The unsharded state dict (a collective: call on every rank); empty on other ranks when
    ``rank0_only``."""
    out = {}
    for k, v in module.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    if rank0_only and torch.distributed.get_rank() != 0:
        return {}
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict) -> None:
    """Load an unsharded state dict into a sharded module (every rank passes the full values),
    replacing parameters (``assign`` semantics) so optimizer device checks pass."""
    current = module.state_dict()
    new = {}
    for k, v in current.items():
        full = state_dict[k]
        if isinstance(v, DTensor):
            new[k] = nn.Parameter(
                hp.distribute_tensor(
                    full.to(v.dtype), v.device_mesh, v.placements, src_data_rank=None
                ),
                requires_grad=v.requires_grad,
            )
        else:
            new[k] = full
    module.load_state_dict(new, assign=True)
    for g in _groups(module, True):
        g.refresh_params()
