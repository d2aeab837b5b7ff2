"""Exceptions raised for user mistakes.

Every message names the argument, the value that was given and what to do instead. They are
raised before any collective starts wherever the mistake can be seen locally, so that a bad call
fails on every rank at once instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "ContextParallelError",
    "HPDTensorError",
    "HPDTensorTypeError",
    "LayoutError",
    "MeshError",
    "PlacementError",
    "ShardingError",
]


class HPDTensorError(Exception):
    """Base class of every error hp_dtensor raises on purpose."""


class HPDTensorTypeError(HPDTensorError, TypeError):
    """An argument of the wrong type (a str where a ``DeviceMesh`` is expected, a list where a
    tensor is expected...); the message names the argument and the type to pass instead."""


class PlacementError(HPDTensorError, ValueError):
    """Placements that do not fit the mesh or the tensor (too many, shard dim out of range...)."""


class MeshError(HPDTensorError, ValueError):
    """A device mesh that does not fit the world, or a mesh dimension that does not exist."""


class LayoutError(HPDTensorError, ValueError):
    """A Layout alias that does not exist, is used twice, or a tensor rank that does not fit."""


class ShardingError(HPDTensorError, RuntimeError):
    """Operands that cannot be combined: different meshes, mixed DTensor and torch.Tensor."""


class ContextParallelError(HPDTensorError, ValueError):
    """Context-parallel inputs that do not fit: a sequence not divisible into the chunks, heads
    that do not divide over the ranks, an unknown method, an unsupported attention option."""


class BackendError(HPDTensorError, RuntimeError):
    """A backend that is unknown, not installed, or does not support what was asked."""
