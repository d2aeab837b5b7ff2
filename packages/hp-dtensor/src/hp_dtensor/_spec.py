"""``DTensorSpec``: the metadata of a DTensor (mesh, placements, global shape/stride, dtype)."""

from __future__ import annotations

from ._checks import check_mesh
from ._placement import Partial, Placement, Shard, normalize_placements
from ._shard_math import local_shape_and_offset
from .errors import PlacementError, ShardingError

__all__ = ["DTensorSpec", "contiguous_strides", "redistribute_target"]


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    out = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


class DTensorSpec:
    """Immutable metadata of a DTensor. Hashable; used as a dispatch cache key.

    Attributes:
        mesh: the ``DeviceMesh``.
        placements: one placement per mesh dimension (shard dims non-negative).
        shape: global shape.
        stride: global stride.
        dtype: element type (a framework dtype object).
    """

    __slots__ = (
        "mesh",
        "placements",
        "shape",
        "stride",
        "dtype",
        "gathered",
        "_hash",
        "_local",
        "_dual",
    )

    def __init__(
        self, mesh, placements: tuple[Placement, ...], shape, stride, dtype, gathered=()
    ) -> None:
        self.mesh = mesh
        self.placements = placements
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        self.dtype = dtype
        #: mesh dims all-gathered into this (replicated) tensor whose gradient representation
        #: is decided by its consumers (NOTE [Gathered activations] in ``_redistribute``)
        self.gathered = tuple(gathered)
        self._hash = hash((mesh, placements, self.shape, self.stride, dtype, self.gathered))
        self._local = None
        self._dual = None

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is DTensorSpec
            and self._hash == other._hash
            and self.placements == other.placements
            and self.shape == other.shape
            and self.stride == other.stride
            and self.dtype == other.dtype
            and self.gathered == other.gathered
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        pl = ", ".join(str(p) for p in self.placements)
        return f"DTensorSpec(({pl}), shape={self.shape}, dtype={self.dtype})"

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.shape)

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's local shape and global offset (cached)."""
        if self._local is None:
            coord = self.mesh.get_coordinate()
            if coord is None:
                self._local = ((0,) * len(self.shape), (0,) * len(self.shape))
            else:
                self._local = local_shape_and_offset(
                    self.shape, self.mesh.shape, coord, self.placements
                )
        return self._local

    def with_placements(self, placements) -> DTensorSpec:
        """Same tensor, other placements."""
        return DTensorSpec(self.mesh, tuple(placements), self.shape, self.stride, self.dtype)

    def has_partial(self) -> bool:
        """True when any mesh dimension holds partial values."""
        return any(isinstance(p, Partial) for p in self.placements)

    def sharded_dims(self) -> set[int]:
        """Tensor dimensions split over some mesh dimension."""
        return {p.dim for p in self.placements if isinstance(p, Shard)}


def redistribute_target(spec: DTensorSpec, device_mesh, placements) -> tuple[Placement, ...]:
    """The normalised placements a ``redistribute(device_mesh, placements)`` call asks for,
    checked (same mesh, placements given) for either framework's DTensor."""
    mesh = spec.mesh if device_mesh is None else device_mesh
    if mesh is not spec.mesh:
        check_mesh(mesh, "device_mesh", "redistribute")
    if mesh != spec.mesh:
        raise ShardingError(
            f"device_mesh={mesh} differs from this tensor's mesh {spec.mesh}: redistributing "
            "across meshes is not supported; use to_local/from_local"
        )
    if placements is None:
        raise PlacementError("placements is required: give one placement per mesh dimension")
    return normalize_placements(placements, mesh.ndim, len(spec.shape))
