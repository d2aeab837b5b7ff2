"""Typed errors of hp_trainer."""

from __future__ import annotations

__all__ = ["ConfigError", "NonFiniteError", "PeerFailure", "TrainerTypeError", "TrainingError"]


class ConfigError(ValueError):
    """A configuration that cannot work (names the key and the fix); raised before any process
    group is created."""


class TrainerTypeError(ConfigError, TypeError):
    """An argument of the wrong type (names it and what to pass instead)."""


def check_instance(value, cls, arg: str, fn: str, hint: str = "") -> None:
    """Raise :class:`TrainerTypeError` unless ``value`` is a ``cls`` (bools are not ints)."""
    ok = isinstance(value, cls) and not (
        isinstance(value, bool) and bool not in (cls if isinstance(cls, tuple) else (cls,))
    )
    if not ok:
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        shown = repr(value) if isinstance(value, (str, int, float, type(None))) else "<object>"
        raise TrainerTypeError(
            f"{fn}: {arg}={shown} is a {type(value).__name__}, not a {names}"
            + (f": {hint}" if hint else "")
        )


class TrainingError(RuntimeError):
    """Training stopped on a condition found while it ran (not a configuration problem)."""


class NonFiniteError(TrainingError):
    """A step's loss or gradient norm was not finite and ``training.on_nonfinite = "stop"``:
    the message names the step and the checkpoint of the last good step, if one was written."""


class PeerFailure(TrainingError):
    """A collective failed or timed out: the message names the ranks that did not report (dead
    or hung) and the step each last started, then the backend's own error."""
