"""Argument checks for hp_optim's public entry points.

Each check is local (no communication) and depends only on the arguments, so a bad call raises
the same error on every rank before any collective starts.
"""

from __future__ import annotations

import math
import numbers

import torch

from .errors import OptimError, OptimTypeError

__all__ = ["check_bool", "check_int", "check_number", "check_params"]


def _where(fn: str) -> str:
    return f"{fn}: " if fn else ""


def check_bool(value, arg: str, fn: str = "", *, none_ok: bool = False) -> None:
    """``value`` must be a bool (a str such as ``"no"`` would silently count as True)."""
    if none_ok and value is None:
        return
    if not isinstance(value, bool):
        raise OptimTypeError(
            f"{_where(fn)}{arg}={value!r} must be True or False" + (" (or None)" if none_ok else "")
        )


def check_int(value, arg: str, fn: str = "", *, low: int = 0) -> int:
    """``value`` must be an int (not a bool) and ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptimTypeError(
            f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give an int >= {low}"
        )
    if value < low:
        raise OptimError(f"{_where(fn)}{arg}={value!r}: give an int >= {low}")
    return int(value)


def check_number(
    value,
    arg: str,
    fn: str = "",
    *,
    low: float = 0.0,
    high: float = math.inf,
    high_open: bool = False,
    tensor_ok: bool = False,
    inf_ok: bool = False,
) -> None:
    """``value`` must be a real number (not a bool) in ``[low, high]`` (``[low, high)`` with
    ``high_open``); NaN is rejected, and so is infinity unless ``inf_ok``. With ``tensor_ok``
    a one-element tensor (torch's tensor learning rates) is also accepted as it is."""
    if tensor_ok and isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptimTypeError(
            f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give a number"
        )
    v = float(value)
    rng = f"[{low}, {high}{')' if high_open else ']'}"
    if math.isnan(v) or (math.isinf(v) and not inf_ok):
        raise OptimError(f"{_where(fn)}{arg}={value!r} must be finite: give a number in {rng}")
    if v < low or v > high or (high_open and v >= high):
        raise OptimError(f"{_where(fn)}{arg}={value!r} is out of range: give a number in {rng}")


def check_params(params, fn: str) -> None:
    """``params`` of an optimizer: an iterable of tensors or param-group dicts, not a module
    (the usual slip: ``AdamW(model)`` for ``AdamW(model.parameters())``) or a lone tensor."""
    if isinstance(params, torch.nn.Module):
        raise OptimTypeError(
            f"{fn}: params is a {type(params).__name__} module: pass model.parameters() "
            "(or a list of parameters / param-group dicts)"
        )
    if isinstance(params, torch.Tensor):
        raise OptimTypeError(
            f"{fn}: params is a single Tensor: pass a list of parameters, e.g. [p]"
        )
    if isinstance(params, (str, bytes, dict)) or not hasattr(params, "__iter__"):
        raise OptimTypeError(
            f"{fn}: params is a {type(params).__name__}: pass model.parameters() (or a list of "
            "parameters / param-group dicts)"
        )
