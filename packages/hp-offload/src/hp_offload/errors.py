"""hp_offload's exceptions, in a module of their own so that the framework bindings
(``hp_offload._backend``) raise them without importing the front ends that call them."""

from __future__ import annotations

__all__ = ["OffloadError", "OffloadTypeError", "OffloadUnsupportedError"]


class OffloadError(ValueError):
    """Bad checkpoint/swap arguments: an unknown op, overlapping plan patterns, a budget too
    small for one layer."""


class OffloadTypeError(OffloadError, TypeError):
    """An hp_offload argument of the wrong type (a str for a tuple of op names, a policy that is
    not a ``CheckpointPolicy``/``SwapPolicy``, a non-module to wrap); also a ``TypeError``."""


class OffloadUnsupportedError(OffloadError):
    """A policy or call that the framework of the module cannot honour (MindSpore: selective
    checkpointing, a swap region in graph mode); the message names it and what works instead.
    Never ignored silently."""
