"""Exceptions hp_moe raises for user mistakes.

Each message names the argument, the value given and the fix. Configuration mistakes are
caught when a module or style is built or applied, before any collective runs, so every rank
raises the same error instead of some ranks waiting in an all-to-all.
"""

from __future__ import annotations

from hp_dtensor import MeshError

__all__ = ["DispatchError", "MoEConfigError", "MoEError", "MoEMeshError", "MoETypeError"]


class MoEError(Exception):
    """Base class of every error hp_moe raises on purpose."""


class MoEConfigError(MoEError, ValueError):
    """An argument that cannot work: top_k above the expert count, groups that do not divide
    the experts, an unknown score function, a capacity factor that is not positive..."""


class DispatchError(MoEError, RuntimeError):
    """Token dispatch that cannot proceed: tokens of the wrong shape for the dispatcher, a
    style applied to the wrong module, statistics used without the hook that resets them."""


class MoETypeError(MoEConfigError, TypeError):
    """An argument of the wrong type (a str for a width, a list where a tensor is expected, a
    str for a flag that must be True or False); also a ``MoEConfigError`` and a ``TypeError``.
    The message names the argument and the type to pass."""


class MoEMeshError(MoEConfigError, MeshError):
    """A mesh that cannot serve a MoE style or dispatcher (not an hp_dtensor ``DeviceMesh``,
    the wrong number of dimensions, no dimension names); also hp_dtensor's ``MeshError``."""
