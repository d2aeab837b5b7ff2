"""``parallelize_module``: apply styles to submodules chosen by path patterns."""

from __future__ import annotations

import difflib
import fnmatch

import torch.nn as nn

from .._backend import framework_of
from .._checks import check_mesh, check_module
from .._mesh import DeviceMesh
from ..errors import HPDTensorTypeError, MeshError, PlacementError
from ._style import ParallelStyle

__all__ = ["parallelize_module"]

_HEAD_ATTRS = ("n_heads", "num_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads")


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle],
) -> nn.Module:
    """Shard ``module`` in place with tensor/sequence-parallel styles; returns it.

    ``parallelize_plan`` is a style (applied to ``module`` itself) or a dict from module paths to
    styles. Paths may use fnmatch globs (``"layers.*.attention.wq"``). Everything is checked
    before any parameter moves: a key matching no submodule raises ``PlacementError`` listing the
    closest names; a style that does not fit its module raises; an attention module whose head
    counts (``n_heads``, ``n_kv_heads``, ...) do not divide by the mesh size raises.

    Example::

        parallelize_module(block, mesh["tp"], {
            "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w*": ColwiseParallel(),
        })
    """
    check_module(module, "module", "parallelize_module", cells=True)
    check_mesh(device_mesh, "device_mesh", "parallelize_module")
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.validate(module, device_mesh, "")
        if parallelize_plan.splits_heads:
            _check_heads(module, "", device_mesh)
        return parallelize_plan.apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        hint = (
            ": instantiate it, e.g. ColwiseParallel()"
            if isinstance(parallelize_plan, type) and issubclass(parallelize_plan, ParallelStyle)
            else ""
        )
        raise HPDTensorTypeError(
            f"parallelize_plan must be a ParallelStyle or a dict of path -> style, got "
            f"{parallelize_plan!r}{hint}"
        )
    if framework_of(module) == "mindspore":
        named = module.cells_and_names()
    else:
        named = module.named_modules()
    names = {name: mod for name, mod in named if name}
    todo: list[tuple[str, nn.Module, ParallelStyle]] = []
    for key, style in parallelize_plan.items():
        if not isinstance(key, str):
            raise HPDTensorTypeError(
                f"parallelize_plan key {key!r} is a {type(key).__name__}: keys are module paths "
                "(strs such as 'layers.0.attention.wq', globs allowed)"
            )
        if not isinstance(style, ParallelStyle):
            raise HPDTensorTypeError(
                f"parallelize_plan[{key!r}] is a {type(style).__name__}, not a style: give a "
                "ParallelStyle instance such as ColwiseParallel()"
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, key)]
        if not hits:
            close = difflib.get_close_matches(key, list(names), n=5, cutoff=0.4)
            raise PlacementError(
                f"parallelize_plan key {key!r} matches no submodule of "
                f"{type(module).__name__}; closest names: {close or sorted(names)[:5]}"
            )
        todo.extend((n, names[n], style) for n in hits)
    for path, mod, style in todo:  # validate everything first: nothing is sharded on error
        style.validate(mod, device_mesh, path)
        if style.splits_heads:
            _check_heads(module, path, device_mesh)
    for _path, mod, style in todo:
        style.apply(mod, device_mesh)
    return module


def _check_heads(root: nn.Module, path: str, mesh: DeviceMesh) -> None:
    """Attention modules on the path must have head counts divisible by the mesh size."""
    n = mesh.size()
    parts = path.split(".") if path else []
    mod = root
    chain = [("", root)]
    for i, p in enumerate(parts):
        mod = getattr(mod, p)
        chain.append((".".join(parts[: i + 1]), mod))
    for name, m in chain:
        for attr in _HEAD_ATTRS:
            v = getattr(m, attr, None)
            if isinstance(v, int) and v % n:
                raise MeshError(
                    f"{name or type(root).__name__}.{attr}={v} is not divisible by the "
                    f"tensor-parallel degree {n}: choose a degree that divides the head counts"
                )
