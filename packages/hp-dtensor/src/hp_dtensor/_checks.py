"""Argument checks shared by the public entry points.

Each check is local (no communication) and depends only on the arguments, so a bad call raises
the same error on every rank before any collective starts.
"""

from __future__ import annotations

import operator

import torch.nn as nn

from ._backend import framework_of
from ._mesh import DeviceMesh
from .errors import HPDTensorTypeError, PlacementError

__all__ = ["check_bool", "check_callable", "check_mesh", "check_module", "check_shape_stride"]


def _type_name(value) -> str:
    return type(value).__name__


def check_mesh(mesh, arg: str = "device_mesh", fn: str = "") -> None:
    """``mesh`` must be an hp_dtensor ``DeviceMesh``."""
    if not isinstance(mesh, DeviceMesh):
        where = f"{fn}: " if fn else ""
        kind = _type_name(mesh)
        if kind == "DeviceMesh":  # another library's (torch.distributed's): say whose
            kind = f"{type(mesh).__module__}.{kind}"
        raise HPDTensorTypeError(
            f"{where}{arg}={mesh!r} is a {kind}, not an hp_dtensor DeviceMesh: build one with "
            "hp_dtensor.init_device_mesh(...) (a sub-mesh is mesh['name'])"
        )


def check_module(module, arg: str = "module", fn: str = "", *, cells: bool = False) -> None:
    """``module`` must be a ``torch.nn.Module`` (or, with ``cells``, a MindSpore cell)."""
    if isinstance(module, nn.Module):
        return
    if cells and framework_of(module) == "mindspore":
        return
    where = f"{fn}: " if fn else ""
    what = (
        f"the class {module.__name__}, not an instance"
        if isinstance(module, type)
        else f"a {_type_name(module)}"
    )
    raise HPDTensorTypeError(
        f"{where}{arg} is {what}: pass a torch.nn.Module instance"
        + (" (or a MindSpore nn.Cell)" if cells else "")
    )


def check_callable(fn_value, arg: str, fn: str = "") -> None:
    """``fn_value`` must be None or callable."""
    if fn_value is not None and not callable(fn_value):
        where = f"{fn}: " if fn else ""
        raise HPDTensorTypeError(
            f"{where}{arg}={fn_value!r} is a {_type_name(fn_value)}, not callable: pass a "
            "function (or None)"
        )


def check_bool(value, arg: str, fn: str = "") -> None:
    """``value`` must be a bool (a str such as ``"no"`` would silently count as True)."""
    if not isinstance(value, bool):
        where = f"{fn}: " if fn else ""
        raise HPDTensorTypeError(f"{where}{arg}={value!r} must be True or False")


def _ints(values, arg: str, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise HPDTensorTypeError(
            f"{arg}={values!r} is a {_type_name(values)}: give a sequence of ints ({what})"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            raise HPDTensorTypeError(f"{arg}[{i}]={v!r} is a bool: give an int ({what})")
        try:
            n = operator.index(v)
        except TypeError:
            raise HPDTensorTypeError(
                f"{arg}[{i}]={v!r} is a {_type_name(v)}: give an int ({what})"
            ) from None
        if n < 0:
            raise PlacementError(f"{arg}[{i}]={n} is negative: give sizes >= 0 ({what})")
        out.append(n)
    return tuple(out)


def check_shape_stride(shape, stride, ndim: int):
    """``(shape, stride)`` of ``DTensor.from_local`` as tuples of ints, checked against the
    local tensor's number of dims (None stays None)."""
    if shape is not None:
        shape = _ints(shape, "shape", "the global shape, one size per tensor dim")
        if len(shape) != ndim:
            raise PlacementError(
                f"shape={shape} has {len(shape)} dims but local_tensor has {ndim}: give the "
                "global shape, one size per dim of the local tensor"
            )
    if stride is not None:
        stride = _ints(stride, "stride", "the global stride, one per tensor dim")
        if len(stride) != ndim:
            raise PlacementError(
                f"stride={stride} has {len(stride)} entries but local_tensor has {ndim} dims: "
                "give one stride per dim of the global tensor (or leave stride=None)"
            )
    return shape, stride
