"""Exceptions hp_moe raises for user mistakes.

Each message names the argument, the value given and the fix. Configuration mistakes are
caught when a module or style is built or applied, before any collective runs, so every rank
raises the same error instead of some ranks waiting in an all-to-all.
"""

from __future__ import annotations

__all__ = ["DispatchError", "MoEConfigError", "MoEError"]


class MoEError(Exception):
    """Base class of every error hp_moe raises on purpose."""


class MoEConfigError(MoEError, ValueError):
    """An argument that cannot work: top_k above the expert count, groups that do not divide
    the experts, an unknown score function, a capacity factor that is not positive..."""


class DispatchError(MoEError, RuntimeError):
    """Token dispatch that cannot proceed: tokens of the wrong shape for the dispatcher, a
    style applied to the wrong module, statistics used without the hook that resets them."""
