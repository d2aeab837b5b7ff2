"""Placements: how a tensor sits on one mesh dimension.

Pure Python, no framework import. Placements are small frozen values: hashable, comparable, with a
constructor-like ``repr`` (``Shard(dim=0)``) and a short ``str`` (``S(0)``, ``R``, ``P(sum)``), so
they can be used as cache keys and printed in plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import HPDTensorTypeError, PlacementError

__all__ = ["Partial", "Placement", "Replicate", "Shard", "REDUCE_OPS"]

#: Reduce operations a ``Partial`` placement may carry.
REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the three placements. Use ``Shard``, ``Replicate`` or ``Partial``."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (of ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate``."""
        return False

    def is_partial(self) -> bool:
        """True for ``Partial`` of any reduce op."""
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The tensor is split along tensor dimension ``dim`` over this mesh dimension.

    Uneven sizes follow ``torch.chunk``: every rank but the last non-empty one holds
    ``ceil(size / n)`` elements, trailing ranks may hold fewer or none.
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise PlacementError(f"Shard(dim={self.dim!r}): dim must be an int tensor dimension")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along this mesh dimension holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank holds a partial value; the tensor is their reduction with ``reduce_op``.

    ``reduce_op`` is one of ``"sum"``, ``"avg"``, ``"max"``, ``"min"``.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise PlacementError(
                f"Partial(reduce_op={self.reduce_op!r}): reduce_op must be one of {REDUCE_OPS}"
            )

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def normalize_placements(
    placements, mesh_ndim: int, tensor_ndim: int | None, *, arg: str = "placements"
) -> tuple[Placement, ...]:
    """Check placements against a mesh and tensor rank; fill missing ones with ``Replicate``.

    Negative shard dims are made non-negative. Raises ``PlacementError`` naming ``arg`` when there
    are more placements than mesh dimensions, an entry is not a placement, or a shard dim is out of
    range for a tensor of ``tensor_ndim`` dimensions.
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    elif isinstance(placements, (str, bytes, type)):
        _not_a_sequence(placements, arg)
    try:
        placements = tuple(placements)
    except TypeError:
        _not_a_sequence(placements, arg)
    if len(placements) > mesh_ndim:
        raise PlacementError(
            f"{arg}={_fmt(placements)} has {len(placements)} entries but the mesh has "
            f"{mesh_ndim} dimension(s): give at most one placement per mesh dimension"
        )
    out = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"{arg}[{i}]={p!r} is not a placement: use Shard(dim), Replicate() or Partial()"
            )
        if isinstance(p, Shard) and tensor_ndim is not None:
            d = p.dim
            if not -tensor_ndim <= d < tensor_ndim or tensor_ndim == 0:
                raise PlacementError(
                    f"{arg}[{i}]=Shard({d}) is out of range for a tensor of {tensor_ndim} "
                    f"dimension(s): use a dim in [{-tensor_ndim}, {tensor_ndim - 1}]"
                )
            if d < 0:
                p = Shard(d + tensor_ndim)
        out.append(p)
    out.extend([Replicate()] * (mesh_ndim - len(out)))
    ops = {p.reduce_op for p in out if isinstance(p, Partial)}
    if len(ops) > 1 and ops & {"max", "min"}:
        raise PlacementError(
            f"{arg}={_fmt(out)} mixes Partial({sorted(ops)}) across mesh dimensions: the result "
            "would depend on the reduction order; reduce one of them first"
        )
    return tuple(out)


def _not_a_sequence(placements, arg: str):
    raise HPDTensorTypeError(
        f"{arg}={placements!r} is a {type(placements).__name__}, not a sequence of placements: "
        "give a list such as [Shard(0)] or [Replicate(), Shard(1)], one per mesh dimension"
    )


def _fmt(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def format_placements(placements) -> str:
    """Short form of a placement tuple, e.g. ``(S(0), R)``."""
    return _fmt(placements)
