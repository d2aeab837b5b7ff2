"""Argument checks for hp_offload's public entry points.

Each check is local (no communication) and depends only on the arguments, so a bad call raises
the same error on every rank, before the wrapped forward runs.
"""

from __future__ import annotations

import numbers

import torch.nn as nn

from .errors import OffloadError, OffloadTypeError

__all__ = ["check_bool", "check_callable", "check_int", "check_module", "check_type"]


def _where(fn: str) -> str:
    return f"{fn}: " if fn else ""


def _show(value) -> str:
    """``repr(value)``, cut short (a module's repr spans many lines)."""
    r = repr(value)
    return r if len(r) <= 60 and "\n" not in r else f"<{type(value).__name__}>"


def check_bool(value, arg: str, fn: str = "", *, none_ok: bool = False) -> None:
    """``value`` must be a bool (a str such as ``"no"`` would silently count as True)."""
    if none_ok and value is None:
        return
    if not isinstance(value, bool):
        raise OffloadTypeError(
            f"{_where(fn)}{arg}={value!r} must be True or False" + (" (or None)" if none_ok else "")
        )


def check_int(value, arg: str, fn: str = "", *, low: int = 0, none_ok: bool = False) -> None:
    """``value`` must be an int (not a bool) ``>= low`` (or None with ``none_ok``)."""
    if none_ok and value is None:
        return
    tail = " (or None)" if none_ok else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OffloadTypeError(
            f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give an int >= {low}{tail}"
        )
    if value < low:
        raise OffloadError(
            f"{_where(fn)}{arg}={value!r} is out of range: give an int >= {low}{tail}"
        )


def check_module(module, arg: str = "module", fn: str = "") -> None:
    """``module`` must be an ``nn.Module`` instance."""
    if isinstance(module, nn.Module):
        return
    what = (
        f"the class {module.__name__}, not an instance"
        if isinstance(module, type)
        else f"a {type(module).__name__}"
    )
    raise OffloadTypeError(f"{_where(fn)}{arg} is {what}: pass an nn.Module instance")


def check_callable(value, arg: str, fn: str = "") -> None:
    """``value`` must be callable."""
    if not callable(value):
        raise OffloadTypeError(
            f"{_where(fn)}{arg}={_show(value)} is a {type(value).__name__}, not callable: pass a "
            "function or module"
        )


def check_type(value, cls: type, arg: str, fn: str = "", *, hint: str = "") -> None:
    """``value`` must be None or an instance of ``cls``."""
    if value is None or isinstance(value, cls):
        return
    what = (
        f"the class {value.__name__}, not an instance"
        if isinstance(value, type)
        else f"a {type(value).__name__}"
    )
    raise OffloadTypeError(
        f"{_where(fn)}{arg}={_show(value)} is {what}: pass a {cls.__name__}"
        + (f" ({hint})" if hint else "")
        + " or None"
    )
