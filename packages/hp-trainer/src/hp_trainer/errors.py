"""Typed errors of hp_trainer."""

from __future__ import annotations

__all__ = ["ConfigError", "NonFiniteError", "PeerFailure", "TrainingError"]


class ConfigError(ValueError):
    """A configuration that cannot work (names the key and the fix); raised before any process
    group is created."""


class TrainingError(RuntimeError):
    """Training stopped on a condition found while it ran (not a configuration problem)."""


class NonFiniteError(TrainingError):
    """A step's loss or gradient norm was not finite and ``training.on_nonfinite = "stop"``:
    the message names the step and the checkpoint of the last good step, if one was written."""


class PeerFailure(TrainingError):
    """A collective failed or timed out: the message names the ranks that did not report (dead
    or hung) and the step each last started, then the backend's own error."""
