"""HyperParallel's shard API: ``shard_module``, ``custom_shard``, ``DFunction`` and
``SkipDTensorDispatch``. Layouts are bound ``Layout`` values (or placement tuples, which then
take their mesh from the DTensor arguments)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from . import _dtensor
from ._backend import framework_of
from ._checks import check_bool, check_module
from ._dtensor import DTensor, distribute_tensor
from ._hooks import check_len, forward_hooks
from ._layout import Layout
from ._mesh import DeviceMesh, mesh_from_layout
from ._placement import Placement
from .errors import HPDTensorTypeError, LayoutError, MeshError

__all__ = ["shard_module", "custom_shard", "DFunction", "SkipDTensorDispatch"]


def _mesh_of(layout: Layout, device_type: str) -> DeviceMesh:
    return mesh_from_layout(layout, device_type)


def _to_layout(x, layout, *, mesh: DeviceMesh | None, arg: str):
    """``x`` as a DTensor laid out as ``layout``; plain tensors are this rank's local piece."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(layout, Layout):
        placements = layout.to_placements()
        lmesh = _mesh_of(layout, x.device.type if x.device.type != "meta" else "cpu")
        if isinstance(x, DTensor) and x.device_mesh != lmesh:
            raise MeshError(
                f"{arg}: the Layout's mesh {lmesh} differs from the tensor's mesh "
                f"{x.device_mesh}: build the Layout with the same shape, axis names and ranks"
            )
        mesh = lmesh
    else:
        placements = tuple(layout) if isinstance(layout, (tuple, list)) else (layout,)
        if not all(isinstance(p, Placement) for p in placements):
            raise LayoutError(f"{arg}={layout!r} must be a bound Layout or a tuple of placements")
        mesh = x.device_mesh if isinstance(x, DTensor) else mesh
        if mesh is None:
            raise LayoutError(
                f"{arg}: placements need a mesh; pass a Layout, or a DTensor argument first"
            )
    if isinstance(x, DTensor):
        return x.redistribute(mesh, placements) if x.placements != tuple(placements) else x
    return DTensor.from_local(x, mesh, placements)


def _first_mesh(args) -> DeviceMesh | None:
    for a in args:
        if isinstance(a, DTensor):
            return a.device_mesh
    return None


def _check_layouts(layouts, arg: str) -> None:
    """``layouts``: a tuple/list whose entries are None, a bound Layout, a placement or a
    tuple of placements (what ``_to_layout`` takes)."""
    if not isinstance(layouts, (tuple, list)):
        raise HPDTensorTypeError(
            f"{arg}={layouts!r} is a {type(layouts).__name__}: give a tuple with one entry per "
            "value (a bound Layout, a tuple of placements, or None)"
        )
    for i, lay in enumerate(layouts):
        if lay is None or isinstance(lay, Placement):
            continue
        if isinstance(lay, Layout):
            if lay.tensor_map is None:
                raise LayoutError(
                    f"{arg}[{i}] is an unbound Layout: bind it to the tensor's dims first, "
                    "e.g. layout('dp', 'None')"
                )
            continue
        if not isinstance(lay, (tuple, list)) or not all(isinstance(p, Placement) for p in lay):
            raise LayoutError(f"{arg}[{i}]={lay!r} must be a bound Layout or a tuple of placements")


def _check_dict(value, arg: str) -> dict:
    if not isinstance(value, dict):
        raise HPDTensorTypeError(f"{arg}={value!r} is a {type(value).__name__}: give a dict")
    return value


def check_sharding_plan(sharding_plan: dict, param_ndims: dict, owner: str):
    """``(parameter layouts, forward spec)`` of a ``shard_module`` plan, checked against the
    module's parameters (dotted name -> ndim) before anything moves. Framework-neutral."""
    _check_dict(sharding_plan, "sharding_plan")
    unknown = set(sharding_plan) - {"parameter", "forward"}
    if unknown:
        raise LayoutError(
            f"sharding_plan keys {sorted(unknown)} unknown: use 'parameter' and 'forward'"
        )
    params = dict(_check_dict(sharding_plan.get("parameter", {}), "sharding_plan['parameter']"))
    for name, lay in params.items():
        if name not in param_ndims:
            raise LayoutError(
                f"sharding_plan['parameter'] names {name!r}, which is not a parameter of "
                f"{owner}: it has {sorted(param_ndims)}"
            )
        if not isinstance(lay, Layout) or lay.tensor_map is None:
            raise LayoutError(f"sharding_plan['parameter'][{name!r}] must be a bound Layout")
        if len(lay.tensor_map) != param_ndims[name]:
            raise LayoutError(
                f"Layout for {name!r} has {len(lay.tensor_map)} dims, the parameter has "
                f"{param_ndims[name]}"
            )
    fwd = dict(_check_dict(sharding_plan.get("forward", {}), "sharding_plan['forward']"))
    unknown = set(fwd) - {"input", "output", "use_local_output"}
    if unknown:
        raise LayoutError(
            f"sharding_plan['forward'] keys {sorted(unknown)} unknown: use 'input', 'output' "
            "and 'use_local_output'"
        )
    for key in ("input", "output"):
        if fwd.get(key) is not None:
            _check_layouts(fwd[key], f"sharding_plan['forward'][{key!r}]")
    if "use_local_output" in fwd:
        check_bool(fwd["use_local_output"], "sharding_plan['forward']['use_local_output']")
    return params, fwd


def shard_module(module: nn.Module, sharding_plan: dict) -> nn.Module:
    """Shard ``module`` in place from Layouts; returns it.

    ``sharding_plan``::

        {"parameter": {"weight": lay("tp", "None"), "fc2.bias": lay("None")},
         "forward": {"input": (lay("dp", "None"),), "output": (lay("dp", "None"),),
                     "use_local_output": False}}

    Parameters (dotted names relative to ``module``) become DTensors with their Layout.
    Forward inputs that are plain tensors are taken as this rank's local piece of the given
    Layout (DTensors are redistributed to it); outputs are redistributed to the output Layouts
    and returned as DTensors (or local tensors with ``"use_local_output": True``). ``None``
    leaves an entry alone. Every name and length is checked before any parameter moves.

    On a MindSpore ``nn.Cell`` the parameters keep their local shard as plain ``Parameter``s
    (optimizers and ``value_and_grad`` see them) and the cell's ``construct`` reads each as a
    DTensor over it, so it must compute with ``hp_dtensor.ms_ops`` (``mint`` on plain tensors).
    """
    check_module(module, "module", "shard_module", cells=True)
    if framework_of(module) == "mindspore":
        from ._backend._ms_shard import shard_cell

        names = {n: p.ndim for n, p in module.parameters_and_names()}
        params, fwd = check_sharding_plan(sharding_plan, names, type(module).__name__)
        return shard_cell(module, params, fwd)
    names = {n: p.ndim for n, p in module.named_parameters()}
    params, fwd = check_sharding_plan(sharding_plan, names, type(module).__name__)
    for name, lay in params.items():
        mod_name, _, pname = name.rpartition(".")
        sub = module.get_submodule(mod_name)
        p = getattr(sub, pname)
        dt = distribute_tensor(p.data, lay)
        sub.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
    pre, post = forward_hooks(
        fwd,
        lambda x, lay, arg: _to_layout(x, lay, mesh=None, arg=arg),
        lambda o: o.to_local() if isinstance(o, DTensor) else o,
    )
    if pre is not None:
        module.register_forward_pre_hook(pre)
    if post is not None:
        module.register_forward_hook(post)
    return module


def custom_shard(
    fn: Callable,
    *,
    in_layouts: Sequence[Any],
    out_layouts: Sequence[Any],
) -> Callable:
    """Wrap ``fn`` (code on local tensors) for use inside a DTensor program.

    The wrapper redistributes each DTensor argument to ``in_layouts[i]`` (a bound Layout, a tuple
    of placements, or None to pass it as it is), calls ``fn`` on the local tensors, and wraps its
    outputs as DTensors laid out as ``out_layouts`` (shapes assume even shards, as in
    ``from_local``). Differentiable.

    Example::

        lay = Layout((2, 2), ("dp", "tp"))("dp", "tp")
        fused_gelu = custom_shard(my_kernel, in_layouts=(lay,), out_layouts=(lay,))
    """
    if not callable(fn):
        raise HPDTensorTypeError(
            f"custom_shard: fn={fn!r} is a {type(fn).__name__}, not callable: pass the function "
            "on local tensors"
        )
    _check_layouts(in_layouts, "custom_shard: in_layouts")
    _check_layouts(out_layouts, "custom_shard: out_layouts")
    in_layouts = tuple(in_layouts)
    out_layouts = tuple(out_layouts)

    def wrapper(*args):
        check_len(args, in_layouts, "in_layouts")
        mesh = _first_mesh(args)
        locals_ = []
        for i, (a, lay) in enumerate(zip(args, in_layouts)):
            d = _to_layout(a, lay, mesh=mesh, arg=f"in_layouts[{i}]") if lay is not None else a
            locals_.append(d.to_local() if isinstance(d, DTensor) else d)
        out = fn(*locals_)
        single = not isinstance(out, (tuple, list))
        items = (out,) if single else tuple(out)
        check_len(items, out_layouts, "out_layouts")
        res = [
            _to_layout(o, lay, mesh=mesh, arg=f"out_layouts[{i}]") if lay is not None else o
            for i, (o, lay) in enumerate(zip(items, out_layouts))
        ]
        return res[0] if single else tuple(res)

    wrapper.__name__ = getattr(fn, "__name__", "custom_shard")
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


class DFunction(torch.autograd.Function):
    """A distributed autograd function: ``forward``/``backward`` on local tensors, with declared
    layouts.

    Subclasses set ``in_layouts`` and ``out_layouts`` (bound Layouts, placement tuples, or None
    per argument) and write ``forward(ctx, *locals)`` / ``backward(ctx, *grads)`` as for
    ``torch.autograd.Function``. ``MyFn.apply(*args)`` redistributes DTensor arguments to
    ``in_layouts``, runs the function on their local tensors and wraps outputs with
    ``out_layouts``; gradients reach the DTensor arguments in their own placements.

    Example::

        class ScaledMatmul(DFunction):
            in_layouts = ((Shard(0),), (Replicate(),))
            out_layouts = ((Shard(0),),)

            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return 2 * x @ w

            @staticmethod
            def backward(ctx, g):
                x, w = ctx.saved_tensors
                return 2 * g @ w.T, 2 * x.T @ g   # the w gradient is partial: see below

    A replicated input whose gradient is computed from sharded data is partial on each rank; list
    its index in ``reduce_grads`` (``{index: "sum"}``) and the gradient is all-reduced over the
    mesh dims where that input is replicated.
    """

    in_layouts: tuple = ()
    out_layouts: tuple = ()
    reduce_grads: dict = {}

    @classmethod
    def apply(cls, *args):  # type: ignore[override]
        check_len(args, cls.in_layouts, f"{cls.__name__}.in_layouts")
        mesh = _first_mesh(args)
        locals_ = []
        specs = []
        for i, (a, lay) in enumerate(zip(args, cls.in_layouts)):
            d = (
                _to_layout(a, lay, mesh=mesh, arg=f"{cls.__name__}.in_layouts[{i}]")
                if lay is not None
                else a
            )
            if isinstance(d, DTensor):
                local = d.to_local()
                op = cls.reduce_grads.get(i)
                if op and torch.is_grad_enabled() and local.requires_grad:
                    dims = tuple(
                        (m, op)
                        for m, p in enumerate(d.placements)
                        if p.is_replicate() and d.device_mesh.shape[m] > 1
                    )
                    if dims:
                        from ._redistribute import AllReduceGrad

                        local = AllReduceGrad.apply(local, d.device_mesh, dims)
                locals_.append(local)
                specs.append(d)
            else:
                locals_.append(d)
        out = super().apply(*locals_)
        single = not isinstance(out, (tuple, list))
        items = (out,) if single else tuple(out)
        check_len(items, cls.out_layouts, f"{cls.__name__}.out_layouts")
        res = [
            _to_layout(o, lay, mesh=mesh, arg=f"{cls.__name__}.out_layouts[{i}]")
            if lay is not None
            else o
            for i, (o, lay) in enumerate(zip(items, cls.out_layouts))
        ]
        return res[0] if single else tuple(res)


@contextlib.contextmanager
def SkipDTensorDispatch():  # noqa: N802 - the public name is a class-like context manager
    """Run torch ops on DTensors' local tensors directly, with no sharding rules or
    communication, e.g. in gradient hooks. Out-of-place ops return plain (local) tensors;
    in-place ops modify the local tensor and return the DTensor itself, keeping its identity.
    """
    with _dtensor.dispatch_mode("skip"):
        yield
