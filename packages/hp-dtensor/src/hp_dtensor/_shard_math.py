"""Pure functions for uneven sharding (``torch.chunk`` semantics).

A dimension of size ``n`` split over ``k`` ranks gives every rank ``ceil(n / k)`` elements in
order until the elements run out; trailing ranks may get fewer or none. This is what
``torch.chunk`` does, padded with empty chunks so that every rank has one. When several mesh
dimensions shard the same tensor dimension they split it in mesh-dimension order: the first
splits the whole dimension, the next splits each piece of the first, and so on.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._placement import Placement, Shard
from .errors import PlacementError

__all__ = [
    "chunk_size_and_offset",
    "local_shape_and_offset",
    "is_evenly_sharded",
]


def chunk_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Size and start offset of chunk ``index`` when ``size`` elements are split into
    ``num_chunks`` pieces with ``torch.chunk`` semantics.

    >>> [chunk_size_and_offset(5, 4, i) for i in range(4)]
    [(2, 0), (2, 2), (1, 4), (0, 5)]
    """
    if num_chunks < 1 or not 0 <= index < num_chunks or size < 0:
        raise PlacementError(
            f"chunk_size_and_offset(size={size}, num_chunks={num_chunks}, index={index}): give "
            "size >= 0, num_chunks >= 1 and an index in [0, num_chunks)"
        )
    step = -(-size // num_chunks) if size else 0
    start = min(step * index, size)
    end = min(start + step, size)
    return end - start, start


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the shard held at mesh ``coordinate``.

    >>> local_shape_and_offset((7, 4), (2,), (1,), (Shard(0),))
    ((3, 4), (4, 0))
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise PlacementError(
            f"local_shape_and_offset: mesh_shape={tuple(mesh_shape)}, coordinate="
            f"{tuple(coordinate)} and placements={tuple(placements)} must have one entry per "
            "mesh dimension each"
        )
    for size, coord, p in zip(mesh_shape, coordinate, placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"local_shape_and_offset: placements holds {p!r}, not a placement: use "
                "Shard(dim), Replicate() or Partial()"
            )
        if isinstance(p, Shard):
            d = p.dim
            if not 0 <= d < len(shape):
                raise PlacementError(
                    f"local_shape_and_offset: {p!r} is out of range for global_shape "
                    f"{tuple(global_shape)}: give a shard dim in [0, {len(shape)})"
                )
            length, start = chunk_size_and_offset(shape[d], size, coord)
            shape[d] = length
            offset[d] += start
    return tuple(shape), tuple(offset)


def is_evenly_sharded(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> bool:
    """True when every shard along every mesh dimension has the same size."""
    shape = list(global_shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            if shape[p.dim] % size:
                return False
            shape[p.dim] //= size
    return True
