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

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

import hp_dtensor as hp
from hp_dtensor import DeviceMesh, DTensor, Replicate, Shard

from ._group import ParamGroup
from ._param import tp_dp_grid
from ._state import reduce_now
from .errors import FSDPError, FSDPTypeError

__all__ = [
    "CPUOffloadPolicy",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "fully_shard",
    "hsdp_sync_stream",
    "get_full_state_dict",
    "load_full_state_dict",
]


def _check_bool(value, arg: str) -> None:
    if not isinstance(value, bool):
        raise FSDPTypeError(f"{arg}={value!r} must be True or False")


def _check_dtype(value, arg: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise FSDPTypeError(
            f"MixedPrecisionPolicy: {arg}={value!r} is a {type(value).__name__}: give a "
            "torch.dtype such as torch.bfloat16 (or None)"
        )
    if not value.is_floating_point:
        raise FSDPError(
            f"MixedPrecisionPolicy: {arg}={value} is not a floating-point dtype: give e.g. "
            "torch.bfloat16, torch.float16 or torch.float32 (or None)"
        )


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

    def __post_init__(self) -> None:
        for arg in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(getattr(self, arg), arg)
        _check_bool(self.cast_forward_inputs, "MixedPrecisionPolicy: cast_forward_inputs")


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Keep sharded parameters, gradients (and so optimizer states) on the CPU; parameters are
    copied to the mesh's device for the all-gather, gradients back after the reduce-scatter.
    ``pin_memory`` pins the CPU shards so the copies can overlap (when an accelerator exists)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        _check_bool(self.pin_memory, "CPUOffloadPolicy: pin_memory")


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
        _check_bool(async_op, "unshard: async_op")
        self._hp_fsdp.unshard(async_op=async_op)
        return _UnshardHandle(self._hp_fsdp) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and swap the sharded ones back in."""
        self._hp_fsdp.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """With False, gradients accumulate unsharded, without communication, until a backward
        with True reduces everything accumulated."""
        _check_bool(requires_gradient_sync, "set_requires_gradient_sync: requires_gradient_sync")
        for g in _groups(self, recurse):
            g.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | None, *, recurse: bool = True
    ) -> None:
        """Free unsharded parameters after forward (gather again in backward) or keep them;
        None restores the default (free, except the root's)."""
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise FSDPTypeError(
                f"set_reshard_after_forward: reshard_after_forward={reshard_after_forward!r} "
                "must be True, False or None (an int k is taken by "
                "fully_shard(reshard_after_forward=k) only)"
            )
        for g in _groups(self, recurse):
            g.reshard_after_forward = (
                True if reshard_after_forward is None else bool(reshard_after_forward)
            )
            g.auto_raf = reshard_after_forward is None  # else the user's choice, root included
            g.raf_k = None  # a later True means the whole group, not the smaller one

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """Free unsharded parameters after backward (default) or keep them for the next step."""
        _check_bool(reshard_after_backward, "set_reshard_after_backward: reshard_after_backward")
        for g in _groups(self, recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_scaling_factor(self, factor: float) -> None:
        """Multiply this group's gradients by ``factor`` once, before they are reduced."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise FSDPTypeError(
                f"set_gradient_scaling_factor: factor={factor!r} is a {type(factor).__name__}: "
                "give a float, e.g. 1 / ep"
            )
        if not math.isfinite(factor):
            raise FSDPError(f"set_gradient_scaling_factor: factor={factor} must be finite")
        self._hp_fsdp.grad_scale = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' parameters as soon as this module's forward starts."""
        modules = _module_list(modules, "set_modules_to_forward_prefetch")
        self._hp_fsdp.forward_prefetch = [_group_of(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' parameters as soon as this module's backward starts."""
        modules = _module_list(modules, "set_modules_to_backward_prefetch")
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
        _check_bool(is_last_backward, "set_is_last_backward: is_last_backward")
        for g in _groups(self, True):
            g.is_last_backward = bool(is_last_backward)


def _groups(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    _check_bool(recurse, "recurse")
    if not recurse:
        return [module._hp_fsdp]
    return [m._hp_fsdp for m in module.modules() if isinstance(m, HSDPModule)]


def _module_list(modules, fn: str) -> list:
    if not isinstance(modules, (list, tuple)):
        raise FSDPTypeError(
            f"{fn}: modules={type(modules).__name__}: give a list of modules that fully_shard "
            "was applied to, e.g. [model.layers[1]]"
        )
    return list(modules)


def _group_of(module: nn.Module, arg: str) -> ParamGroup:
    if not isinstance(module, HSDPModule):
        raise FSDPError(
            f"{arg} holds a {type(module).__name__} that fully_shard was not applied to: apply "
            "fully_shard to it first, or leave it out"
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
    ``mp_policy=None`` is the default policy (no mixed precision). Everything is checked before
    any parameter moves: an argument of the wrong type raises ``FSDPTypeError``, one that does
    not fit ``FSDPError``.

    Example::

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    """
    ignored_params = _check_args(
        module, mesh, shard_placement_fn, mp_policy, offload_policy, ignored_params
    )
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if hp.framework_of(module) == "mindspore":
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


def _check_args(module, mesh, shard_placement_fn, mp_policy, offload_policy, ignored_params):
    """The types of ``fully_shard``'s arguments, checked before anything else happens;
    returns ``ignored_params`` as a list (None stays None), so an iterator is read once."""
    if not isinstance(module, nn.Module) and hp.framework_of(module) != "mindspore":
        what = (
            f"the class {module.__name__}, not an instance"
            if isinstance(module, type)
            else f"a {type(module).__name__}"
        )
        raise FSDPTypeError(
            f"fully_shard: module is {what}: pass an nn.Module instance (a block, then the root)"
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        kind = type(mesh).__name__
        if kind == "DeviceMesh":  # torch.distributed's: say whose
            kind = f"{type(mesh).__module__}.{kind}"
        raise FSDPTypeError(
            f"fully_shard: mesh={mesh!r} is a {kind}, not an hp_dtensor DeviceMesh: pass "
            "mesh=hp_dtensor.init_device_mesh(...) or a sub-mesh such as mesh['dp'] (or None "
            "for all ranks)"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise FSDPTypeError(
            f"fully_shard: shard_placement_fn={shard_placement_fn!r} is not callable: give a "
            "function param -> Shard(dim) | None (or None)"
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise FSDPTypeError(
            f"fully_shard: mp_policy={mp_policy!r} is a {type(mp_policy).__name__}: give a "
            "MixedPrecisionPolicy, e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    if offload_policy is not None and not isinstance(offload_policy, CPUOffloadPolicy):
        raise FSDPTypeError(f"offload_policy={offload_policy!r}: give a CPUOffloadPolicy (or None)")
    if ignored_params is not None:
        if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Iterable):
            raise FSDPTypeError(
                f"fully_shard: ignored_params is a {type(ignored_params).__name__}: give a set "
                "or list of parameters (or None)"
            )
        ignored_params = list(ignored_params)
        for p in ignored_params:
            if not isinstance(p, torch.Tensor):
                raise FSDPTypeError(
                    f"fully_shard: ignored_params holds {p!r}, a {type(p).__name__}: give the "
                    "parameters themselves (module.weight), not their names"
                )
    return ignored_params


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
    if not isinstance(module, nn.Module):
        raise FSDPTypeError(
            f"get_full_state_dict: module is a {type(module).__name__}: pass the nn.Module"
        )
    _check_bool(rank0_only, "get_full_state_dict: rank0_only")
    out = {}
    for k, v in module.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    if rank0_only and torch.distributed.get_rank() != 0:
        return {}
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict) -> None:
    """Load an unsharded state dict into a sharded module (every rank passes the full values),
    replacing parameters (``assign`` semantics) so optimizer device checks pass."""
    if not isinstance(module, nn.Module):
        raise FSDPTypeError(
            f"load_full_state_dict: module is a {type(module).__name__}: pass the nn.Module"
        )
    if not isinstance(state_dict, Mapping):
        raise FSDPTypeError(
            f"load_full_state_dict: state_dict is a {type(state_dict).__name__}: give a dict "
            "of full tensors (get_full_state_dict's result)"
        )
    current = module.state_dict()
    missing = [k for k in current if k not in state_dict]
    if missing:
        raise FSDPError(
            f"load_full_state_dict: state_dict lacks {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + ": give every key of module.state_dict()"
        )
    for k, v in current.items():
        full = state_dict[k]
        if not isinstance(v, torch.Tensor):  # extra state (get_extra_state): passed through
            continue
        if not isinstance(full, torch.Tensor) or isinstance(full, DTensor):
            raise FSDPTypeError(
                f"load_full_state_dict: state_dict[{k!r}] is a {type(full).__name__}: give the "
                "full (unsharded) torch.Tensor"
            )
        if tuple(full.shape) != tuple(v.shape):
            raise FSDPError(
                f"load_full_state_dict: state_dict[{k!r}] has shape {tuple(full.shape)} but the "
                f"module's is {tuple(v.shape)}: give the full (unsharded) tensor"
            )
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
