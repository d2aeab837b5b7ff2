"""Tensor- and sequence-parallel styles: immutable values that shard a module when applied.

Applying a style never changes the style: it distributes the module's parameters and registers
forward hooks that carry the style's (frozen) settings, so one style object can serve any number
of modules. Styles work on a 1-D mesh (the tensor-parallel mesh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .._backend import framework_of
from .._checks import check_bool
from .._dtensor import DTensor, distribute_tensor
from .._hooks import as_tuple, input_hook, output_hook
from .._mesh import DeviceMesh
from .._placement import Partial, Placement, Replicate, Shard
from ..errors import HPDTensorTypeError, MeshError, PlacementError

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
]


class ParallelStyle:
    """Base class of the styles. ``apply(module, device_mesh)`` shards ``module`` in place."""

    #: whether the style splits attention heads over the mesh (then ``parallelize_module``
    #: checks that the head counts on the module's path divide by the mesh size)
    splits_heads = True

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def validate(self, module: nn.Module, device_mesh: DeviceMesh, path: str) -> None:
        """Check, without communicating, that the style fits ``module``; raise otherwise."""


def _mesh_matches(module, mesh: DeviceMesh, style: str, path: str) -> None:
    framework = framework_of(module) or "torch"
    if getattr(mesh, "framework", "torch") != framework:
        raise MeshError(
            f"{style}: {path or type(module).__name__} is a {framework} "
            f"{'cell' if framework == 'mindspore' else 'module'} but the mesh was built for "
            f"{mesh.framework!r}: a mesh serves one framework"
        )


def _ms_binding(module):
    """The MindSpore binding of the styles (``hp_dtensor._backend._ms_parallel``, imported
    only then) when ``module`` is a MindSpore cell; None for torch modules."""
    if framework_of(module) != "mindspore":
        return None
    from .._backend import _ms_parallel

    return _ms_parallel


def _one_d(mesh: DeviceMesh, style: str) -> None:
    if mesh.ndim != 1:
        raise MeshError(
            f"{style} needs a 1-D mesh (the tensor-parallel one), got {mesh}: pass mesh['tp']"
        )


def _placement(p, arg: str) -> Placement:
    if isinstance(p, (tuple, list)) and len(p) == 1:
        p = p[0]
    if not isinstance(p, Placement):
        raise PlacementError(f"{arg}={p!r} must be a placement such as Shard(1) or Replicate()")
    return p


def _check_layouts(value, arg: str) -> None:
    """``value``: None, a placement, or a tuple/list of placements (or None entries)."""
    if value is None or isinstance(value, Placement):
        return
    if not isinstance(value, (tuple, list)):
        raise PlacementError(
            f"{arg}={value!r} must be a placement such as Shard(1) or Replicate(), a tuple of "
            "them (None for an entry to leave alone), or None"
        )
    for i, p in enumerate(value):
        if p is not None and not isinstance(p, Placement):
            raise PlacementError(
                f"{arg}[{i}]={p!r} must be a placement such as Shard(1) or Replicate(), or None"
            )


def _check_kwarg_layouts(value, arg: str) -> None:
    """``value``: None or a dict from keyword-argument names to a placement (or None)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise HPDTensorTypeError(
            f"{arg}={value!r} is a {type(value).__name__}: give a dict from keyword-argument "
            "names to placements, e.g. {'mask': Replicate()}"
        )
    for k, p in value.items():
        if not isinstance(k, str):
            raise HPDTensorTypeError(f"{arg} key {k!r} must be a keyword-argument name (a str)")
        if p is not None and not isinstance(p, Placement):
            raise PlacementError(
                f"{arg}[{k!r}]={p!r} must be a placement such as Shard(1) or Replicate(), or None"
            )


def _as_dtensor(x, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None):
    """A forward input as a DTensor with ``desired`` placement (plain tensors are local pieces
    laid out as ``layout``)."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [layout], run_check=False)
    if desired is not None and x.placements != (desired,):
        x = x.redistribute(mesh, [desired])
    return x


def _output(out, mesh: DeviceMesh, layout: Placement | None, use_local: bool):
    if isinstance(out, DTensor):
        if layout is not None and out.placements != (layout,):
            out = out.redistribute(mesh, [layout])
        return out.to_local() if use_local else out
    if isinstance(out, (tuple, list)):
        return type(out)(_output(o, mesh, layout, use_local) for o in out)
    return out


def _distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement):
    p = getattr(module, name, None)
    if p is None or isinstance(p, DTensor):
        return
    dt = distribute_tensor(p.data, mesh, [placement])
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            _distribute_param(module, name, mesh, Replicate())


@dataclass(frozen=True)
class _Linearish(ParallelStyle):
    input_layouts: Any = None
    output_layouts: Any = None
    use_local_output: bool = True
    #: a :class:`CollectiveMatmul`: fuse the sequence-parallel collective into the matmul
    #: (async TP / MC2); see :class:`ColwiseParallel` and :class:`RowwiseParallel`
    collective_matmul: Any = None

    _kind = ""  # "colwise" or "rowwise" (for the MindSpore binding)

    def __post_init__(self) -> None:
        name = type(self).__name__
        for arg in ("input_layouts", "output_layouts"):
            value = getattr(self, arg)
            if value is not None:
                _placement(value, f"{name}: {arg}")
        check_bool(self.use_local_output, "use_local_output", name)
        if self.collective_matmul is not None:
            from ._collective_matmul import CollectiveMatmul

            if not isinstance(self.collective_matmul, CollectiveMatmul):
                raise HPDTensorTypeError(
                    f"{name}: collective_matmul={self.collective_matmul!r} is a "
                    f"{type(self.collective_matmul).__name__}: give a "
                    "hp_dtensor.parallel.CollectiveMatmul (or None)"
                )
            layout = self.input_layouts if self._kind == "colwise" else self.output_layouts
            arg = "input_layouts" if self._kind == "colwise" else "output_layouts"
            p = _placement(layout, f"{name}: {arg}") if layout is not None else None
            if not isinstance(p, Shard) or p.dim == -1:
                raise PlacementError(
                    f"{name}: collective_matmul fuses the sequence-parallel collective, so "
                    f"{arg} must be Shard(d) on a dim other than the last (the sequence, "
                    f"e.g. Shard(1)); got {layout!r}"
                )

    def _fused_forward(self, mesh, in_pl, desired_in, out_pl):
        """The forward of a linear as one fused collective matmul (``collective_matmul``), to
        be bound to the module (a method, so a deep copy computes with its own weights)."""
        from ._collective_matmul import all_gather_linear, linear_reduce_scatter

        kernels, group, use_local = self.collective_matmul, mesh.get_group(), self.use_local_output
        colwise = self._kind == "colwise"
        name = type(self).__name__
        world = mesh.size()

        def forward(module, x):
            x = _as_dtensor(x, mesh, in_pl, in_pl if colwise else desired_in)
            dim = (in_pl if colwise else out_pl).dim % x.dim()
            if dim == x.dim() - 1:
                raise PlacementError(
                    f"{name}: collective_matmul: the sequence dim {dim} of a {x.dim()}-D input "
                    "is its feature dim: shard a dim other than the last"
                )
            # the sequence as a whole (a DTensor's global length; a row-parallel input holds
            # all of it): the same on every rank, so all raise together
            seq = x.shape[dim] if (colwise and isinstance(x, DTensor)) else None
            x = x.to_local() if isinstance(x, DTensor) else x
            seq = x.shape[dim] if not colwise else seq
            if seq is not None and seq % world:
                raise PlacementError(
                    f"{name}: collective_matmul needs the sequence ({seq} along dim {dim}) to "
                    f"divide by the mesh size {world}: pad it, or leave collective_matmul None"
                )
            w = module.weight.to_local()
            b = module.bias
            if b is not None:  # a row-parallel bias is whole, added once: its gradient partial
                b = b.to_local() if colwise else b.to_local(grad_placements=[Partial()])
            dev = x.device.type
            if torch.is_autocast_enabled(dev):  # the kernels take one dtype: autocast's
                dtype = torch.get_autocast_dtype(dev)
                x, w = x.to(dtype), w.to(dtype)
                b = b.to(dtype) if b is not None else None
            with torch.autocast(dev, enabled=False):
                if colwise:
                    y = all_gather_linear(x, w, b, kernels, group, dim)
                    out = DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
                else:
                    y = linear_reduce_scatter(x, w, b, kernels, group, dim)
                    out = DTensor.from_local(y, mesh, [Shard(dim)], run_check=False)
            return _output(out, mesh, out_pl, use_local)

        return forward

    # (weight placement, bias placement, desired input, default input, default output)
    def _plan(self, module) -> tuple:  # pragma: no cover - overridden
        raise NotImplementedError

    def validate(self, module, device_mesh, path):
        _one_d(device_mesh, type(self).__name__)
        _mesh_matches(module, device_mesh, type(self).__name__, path)
        if self.collective_matmul is not None and not isinstance(module, nn.Linear):
            raise HPDTensorTypeError(
                f"{type(self).__name__}: collective_matmul applies to torch nn.Linear, not "
                f"{path!r} ({type(module).__name__}): leave it None for this module"
            )
        ms = _ms_binding(module)
        if ms is not None:
            ms.validate_linear_style(self, module, device_mesh, path, self._kind)
            return
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise HPDTensorTypeError(
                f"{type(self).__name__} applies to nn.Linear and nn.Embedding; {path!r} is a "
                f"{type(module).__name__}: use PrepareModuleInput/Output or shard_module for it"
            )

    def apply(self, module, device_mesh):
        ms = _ms_binding(module)
        if ms is not None:
            return ms.apply_linear_style(self, module, device_mesh, self._kind)
        self.validate(module, device_mesh, type(module).__name__)
        w_pl, b_pl, desired_in, default_in, default_out = self._plan(module)
        _distribute_param(module, "weight", device_mesh, w_pl)
        if getattr(module, "bias", None) is not None:
            _distribute_param(module, "bias", device_mesh, b_pl)
        in_pl = _placement(self.input_layouts or default_in, "input_layouts")
        out_pl = _placement(self.output_layouts or default_out, "output_layouts")
        use_local = self.use_local_output
        if self.collective_matmul is not None:
            import types

            fn = self._fused_forward(device_mesh, in_pl, desired_in, out_pl)
            module.forward = types.MethodType(fn, module)
            return module

        def pre(mod, inputs):
            return (_as_dtensor(inputs[0], device_mesh, in_pl, desired_in), *inputs[1:])

        def post(mod, inputs, out):
            return _output(out, device_mesh, out_pl, use_local)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


@dataclass(frozen=True)
class ColwiseParallel(_Linearish):
    """Split a Linear's output features (an Embedding's embedding dim) over the mesh.

    Input: ``input_layouts`` (default ``Replicate()``), gathered to replicated. Output: sharded
    on the last dim, redistributed to ``output_layouts`` (default ``Shard(-1)``); returned as the
    local tensor when ``use_local_output``.

    ``collective_matmul`` (a :class:`CollectiveMatmul`, with ``input_layouts=Shard(d)`` on the
    sequence): the all-gather of the input is fused into the matmul, each rank's chunk
    multiplied as it arrives (async TP); backward reduce-scatters the input's gradient the same
    way. Same math as without it.
    """

    _kind = "colwise"

    def _plan(self, module):
        if isinstance(module, nn.Embedding):
            return Shard(1), None, Replicate(), Replicate(), Shard(-1)
        return Shard(0), Shard(0), Replicate(), Replicate(), Shard(-1)


@dataclass(frozen=True)
class RowwiseParallel(_Linearish):
    """Split a Linear's input features (an Embedding's vocabulary) over the mesh.

    Input: ``input_layouts`` (default ``Shard(-1)``; replicated ids for an Embedding). The local
    products are partial sums, reduced to ``output_layouts`` (default ``Replicate()``: an
    all-reduce; ``Shard(1)``: a reduce-scatter for sequence parallelism).

    ``collective_matmul`` (a :class:`CollectiveMatmul`, with ``output_layouts=Shard(d)`` on
    the sequence): each chunk of the product is reduce-scattered as soon as it is computed
    (async TP); backward all-gathers the output's gradient into the input-gradient matmul.
    """

    _kind = "rowwise"

    def _plan(self, module):
        if isinstance(module, nn.Embedding):
            return Shard(0), None, Replicate(), Replicate(), Replicate()
        return Shard(1), Replicate(), Shard(-1), Shard(-1), Replicate()


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on activations sharded along ``sequence_dim``.

    Parameters are replicated (their gradients are all-reduced in backward, since each rank sees
    part of the sequence). Plain inputs are taken as local sequence shards; the output stays a
    DTensor unless ``use_local_output``.
    """

    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise HPDTensorTypeError(
                f"SequenceParallel: sequence_dim={self.sequence_dim!r} must be an int (the "
                "tensor dimension of the sequence, e.g. 1 for [batch, seq, hidden])"
            )
        check_bool(self.use_local_output, "use_local_output", "SequenceParallel")

    def validate(self, module, device_mesh, path):
        _mesh_matches(module, device_mesh, "SequenceParallel", path)
        _one_d(device_mesh, "SequenceParallel")

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, type(module).__name__)
        ms = _ms_binding(module)
        if ms is not None:
            return ms.apply_sequence_parallel(self, module, device_mesh)
        for sub in module.modules():  # sub-modules' parameters too (a norm inside a wrapper)
            _replicate_rest(sub, device_mesh)
        seq = Shard(self.sequence_dim)
        use_local = self.use_local_output

        def pre(mod, inputs):
            return (_as_dtensor(inputs[0], device_mesh, seq, seq), *inputs[1:])

        def post(mod, inputs, out):
            return _output(out, device_mesh, None, use_local)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """Annotate a module's inputs with ``input_layouts`` and redistribute them to
    ``desired_input_layouts`` (entries ``None`` are left alone); the same for keyword inputs."""

    input_layouts: Any = None
    desired_input_layouts: Any = None
    input_kwarg_layouts: dict | None = None
    desired_input_kwarg_layouts: dict | None = None
    use_local_output: bool = False

    def __post_init__(self) -> None:
        for arg in ("input_layouts", "desired_input_layouts"):
            _check_layouts(getattr(self, arg), f"PrepareModuleInput: {arg}")
        for arg in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
            _check_kwarg_layouts(getattr(self, arg), f"PrepareModuleInput: {arg}")
        check_bool(self.use_local_output, "use_local_output", "PrepareModuleInput")

    def validate(self, module, device_mesh, path):
        _mesh_matches(module, device_mesh, "PrepareModuleInput", path)
        _one_d(device_mesh, "PrepareModuleInput")
        ins, des = as_tuple(self.input_layouts), as_tuple(self.desired_input_layouts)
        if ins is not None and des is not None and len(ins) != len(des):
            raise PlacementError(
                f"input_layouts has {len(ins)} entries but desired_input_layouts {len(des)} "
                f"(module {path!r}): give one entry (or None) per input"
            )

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, type(module).__name__)
        ms = _ms_binding(module)
        if ms is not None:
            return ms.apply_prepare_input(self, module, device_mesh)
        use_local = self.use_local_output

        def convert(x, layout, desired):
            out = _as_dtensor(x, device_mesh, layout, desired)
            return out.to_local() if use_local and isinstance(out, DTensor) else out

        pre = input_hook(self, convert)
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """Annotate a module's outputs with ``output_layouts`` and redistribute them to
    ``desired_output_layouts``; returned as local tensors when ``use_local_output``."""

    output_layouts: Any = None
    desired_output_layouts: Any = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        for arg in ("output_layouts", "desired_output_layouts"):
            _check_layouts(getattr(self, arg), f"PrepareModuleOutput: {arg}")
        check_bool(self.use_local_output, "use_local_output", "PrepareModuleOutput")

    def validate(self, module, device_mesh, path):
        _mesh_matches(module, device_mesh, "PrepareModuleOutput", path)
        _one_d(device_mesh, "PrepareModuleOutput")
        outs, des = as_tuple(self.output_layouts), as_tuple(self.desired_output_layouts)
        if outs is not None and des is not None and len(outs) != len(des):
            raise PlacementError(
                f"output_layouts has {len(outs)} entries but desired_output_layouts {len(des)} "
                f"(module {path!r}): give one entry (or None) per output"
            )

    def apply(self, module, device_mesh):
        self.validate(module, device_mesh, type(module).__name__)
        ms = _ms_binding(module)
        if ms is not None:
            return ms.apply_prepare_output(self, module, device_mesh)
        use_local = self.use_local_output

        def convert(o, layout, desired):
            if not isinstance(o, torch.Tensor):
                return o
            o = _as_dtensor(o, device_mesh, layout, desired)
            return o.to_local() if use_local and isinstance(o, DTensor) else o

        post = output_hook(self, convert)
        module.register_forward_hook(post)
        return module


@dataclass(frozen=True)
class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` in one style."""

    input_layouts: Any = None
    desired_input_layouts: Any = None
    input_kwarg_layouts: dict | None = None
    desired_input_kwarg_layouts: dict | None = None
    use_local_input: bool = False
    output_layouts: Any = None
    desired_output_layouts: Any = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        check_bool(self.use_local_input, "use_local_input", "PrepareModuleInputOutput")
        self._parts()  # each part checks its arguments

    def _parts(self):
        return (
            PrepareModuleInput(
                self.input_layouts,
                self.desired_input_layouts,
                self.input_kwarg_layouts,
                self.desired_input_kwarg_layouts,
                self.use_local_input,
            ),
            PrepareModuleOutput(
                self.output_layouts, self.desired_output_layouts, self.use_local_output
            ),
        )

    def validate(self, module, device_mesh, path):
        for part in self._parts():
            part.validate(module, device_mesh, path)

    def apply(self, module, device_mesh):
        for part in self._parts():
            part.apply(module, device_mesh)
        return module
