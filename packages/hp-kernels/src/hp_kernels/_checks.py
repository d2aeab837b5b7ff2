"""Local argument checks for hp_kernels' public functions.

Each depends only on the arguments (no communication). In the collectives a failing check does
not raise at once: the error is published with the call's descriptor, so every rank of the group
raises instead of some waiting for a rank that gave up.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from .errors import KernelsTypeError, KernelsValueError

__all__ = ["check_bool", "check_dim", "check_group", "check_int", "is_tensor_on"]


def is_tensor_on(device_type: str, *values: object) -> bool:
    """Whether any of ``values`` is a tensor on ``device_type`` (non-tensors are not)."""
    return any(isinstance(v, torch.Tensor) and v.device.type == device_type for v in values)


def check_bool(fn: str, value: object, arg: str) -> None:
    """``value`` must be a bool (a str such as ``"no"`` would count as True)."""
    if not isinstance(value, bool):
        raise KernelsTypeError(f"{fn}: {arg}={value!r} must be True or False")


def check_int(fn: str, value: object, arg: str, *, low: int | None = None) -> int:
    """``value`` must be an int (not a bool, not a float: 2.5 would be truncated), ``>= low``."""
    if isinstance(value, bool):
        raise KernelsTypeError(f"{fn}: {arg}={value!r} is a bool: give an int")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise KernelsTypeError(
            f"{fn}: {arg}={value!r} is a {type(value).__name__}: give an int"
        ) from None
    if low is not None and n < low:
        raise KernelsValueError(f"{fn}: {arg}={value!r} must be >= {low}")
    return n


def check_dim(fn: str, value: object, arg: str, ndim: int, what: str) -> int:
    """``value`` must be an int dim of a ``ndim``-dim ``what``: returned in ``[0, ndim)``
    (``%`` alone would wrap an out-of-range dim onto another one)."""
    d = check_int(fn, value, arg)
    if not -ndim <= d < ndim:
        raise KernelsValueError(
            f"{fn}: {arg}={d} is out of range for {what} with {ndim} dims "
            f"(give one in [{-ndim}, {ndim}))"
        )
    return d % ndim


def check_group(fn: str, group: object) -> None:
    """``group`` must be a torch process group or None (the world)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise KernelsTypeError(
            f"{fn}: group={group!r} is a {type(group).__name__}: give a "
            "torch.distributed.ProcessGroup (e.g. mesh.get_group(dim)) or None for the world"
        )
