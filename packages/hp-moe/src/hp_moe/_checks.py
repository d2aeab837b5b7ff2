"""Argument checks shared by hp_moe's public entry points.

Each check is local (no communication) and depends only on the arguments, so a bad call raises
the same error on every rank before any collective starts.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn

from .errors import MoEConfigError, MoETypeError

__all__ = ["check_bool", "check_model", "check_number", "check_positive_int", "check_tensor"]


def _where(fn: str) -> str:
    return f"{fn}: " if fn else ""


def check_bool(value, arg: str, fn: str = "") -> None:
    """``value`` must be a bool (a str such as ``"no"`` would silently count as True)."""
    if not isinstance(value, bool):
        raise MoETypeError(f"{_where(fn)}{arg}={value!r} must be True or False")


def check_positive_int(value, arg: str, fn: str = "") -> None:
    """``value`` must be an int (not a bool) > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MoETypeError(
            f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give a positive int"
        )
    if value <= 0:
        raise MoEConfigError(f"{_where(fn)}{arg}={value!r} must be a positive int")


def check_number(value, arg: str, fn: str = "", *, positive: bool = False, hint: str = "") -> None:
    """``value`` must be a finite real number (not a bool), ``> 0`` with ``positive`` else
    ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MoETypeError(
            f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give a number{hint}"
        )
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise MoEConfigError(
            f"{_where(fn)}{arg}={value!r} must be a "
            f"{'positive number' if positive else 'number >= 0'} (finite){hint}"
        )


def check_tensor(value, arg: str, fn: str = "", *, ndim: int | None = None) -> None:
    """``value`` must be a tensor (with ``ndim`` dimensions when given)."""
    if not isinstance(value, torch.Tensor):
        raise MoETypeError(f"{_where(fn)}{arg} is a {type(value).__name__}: give a torch.Tensor")
    if ndim is not None and value.dim() != ndim:
        raise MoEConfigError(
            f"{_where(fn)}{arg} has shape {tuple(value.shape)}: give a {ndim}-D tensor"
        )


def check_model(model, fn: str) -> None:
    """``model`` must be a ``torch.nn.Module`` (the MoE layers are found among its modules)."""
    if not isinstance(model, nn.Module):
        raise MoETypeError(
            f"{fn}: model is a {type(model).__name__}: give the torch.nn.Module that holds the "
            "MoE layers"
        )
