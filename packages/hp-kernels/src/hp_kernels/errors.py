"""hp_kernels' error classes.

Every error a public function raises for a bad argument is a :class:`KernelsError`; each also
keeps the builtin base it had before (``ValueError``, ``TypeError``, ``RuntimeError``), so
existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = ["KernelsError", "KernelsTypeError", "KernelsValueError"]


class KernelsError(Exception):
    """Base class of hp_kernels' errors."""


class KernelsValueError(KernelsError, ValueError):
    """An argument has the right type but a bad value (a size, a dim, an op name), or the ranks
    of a collective disagree on one."""


class KernelsTypeError(KernelsError, TypeError):
    """An argument has the wrong type (not a tensor, not a dtype, an unsupported dtype)."""
