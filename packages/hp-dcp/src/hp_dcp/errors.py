"""Typed errors of hp_dcp. Each message names the checkpoint, key or argument and says what to
do."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "DCPTypeError",
    "IncompleteCheckpointError",
    "StateDictError",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (missing, unreadable, wrong format)."""


class IncompleteCheckpointError(CheckpointError):
    """The folder is the remains of a save that did not finish: it has no committed metadata."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum (names the file, the key and the chunk)."""


class StateDictError(ValueError):
    """The state dict given to ``save``/``load`` does not fit: a key the checkpoint lacks, a shape
    that differs, a value that cannot be stored."""


class DCPTypeError(StateDictError, TypeError):
    """An argument of the wrong type (``checkpoint_id=None``, a str for a flag, a class where a
    planner instance is expected, a list where a module is expected); also a ``StateDictError``
    and a ``TypeError``. The message names the argument and the type to pass."""
