"""hp_optim's error classes."""

from __future__ import annotations

__all__ = ["OptimError", "OptimTypeError"]


class OptimError(ValueError):
    """A bad optimizer, scheduler or clipping argument; the message names it and the fix."""


class OptimTypeError(OptimError, TypeError):
    """An argument of the wrong type (a module where parameters are expected, a str for a
    number); an ``OptimError`` and a ``TypeError``. The message names the argument and the type
    to pass."""
