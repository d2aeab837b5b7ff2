"""Cross-mesh transfers, planned in pure Python: which rank sends which box of a global tensor
to whom when it moves from one mesh and placements to another mesh and placements. The meshes
may hold the same ranks in another shape or order, share some ranks, or share none.

Every rank's piece is a box of the global tensor (``local_shape_and_offset``). A destination
rank needs its box; each source piece that overlaps it sends exactly the overlap, and a rank
that already holds part of its destination box (it is in both meshes) copies that part
locally. Replicated source pieces are served by one holder each: the destination itself when
it is one, else the holder with the fewest bytes assigned so far, so no rank receives a byte
it already has or does not keep, and senders share the load. Partial sources (sums pending
over a mesh dimension) send every contribution, which the destination adds up: the reduction
happens on the way. Destinations cannot be Partial.

The plan is a value: the same on every rank, cached, printable. Running it (``TransferPlan.run``)
goes through the mesh's platform (``_transfer_run``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ._placement import Partial, Placement, Replicate, format_placements
from ._shard_math import local_shape_and_offset
from .errors import PlacementError, ShardingError

__all__ = ["Transfer", "TransferPlan", "plan_transfer"]


@dataclass(frozen=True)
class Transfer:
    """One box of the global tensor (``offset``, ``size``) moving from global rank ``src`` to
    ``dst``; ``src == dst`` is a local copy. ``nbytes``: its size in bytes."""

    src: int
    dst: int
    offset: tuple[int, ...]
    size: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _Side:
    """One side of a transfer: the mesh's rank grid (row-major), shape and placements."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        idx, coord = self.ranks.index(rank), []
        for size in reversed(self.shape):
            coord.append(idx % size)
            idx //= size
        return tuple(reversed(coord))

    def box(self, rank: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, size) of ``rank``'s piece."""
        size, offset = local_shape_and_offset(
            shape, self.shape, self.coordinate(rank), self.placements
        )
        return offset, size


def _overlap(a_off, a_size, b_off, b_size):
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


@lru_cache(maxsize=1024)
def _plan(src: _Side, dst: _Side, shape: tuple[int, ...], itemsize: int) -> tuple:
    """(transfers, reduce): the transfers in the order every rank posts them."""
    partial_dims = [i for i, p in enumerate(src.placements) if isinstance(p, Partial)]
    replica_dims = [i for i, p in enumerate(src.placements) if isinstance(p, Replicate)]
    del replica_dims  # ranks differing only there hold the same piece
    # distinct source pieces: (box, coordinates along the Partial dims) -> holders
    pieces: dict[tuple, list[int]] = {}
    for r in src.ranks:
        off, size = src.box(r, shape)
        if math.prod(size) == 0:
            continue
        coord = src.coordinate(r)
        key = (off, size, tuple(coord[i] for i in partial_dims))
        pieces.setdefault(key, []).append(r)
    load: dict[int, int] = dict.fromkeys(src.ranks, 0)
    transfers: list[Transfer] = []
    for d in dst.ranks:
        d_off, d_size = dst.box(d, shape)
        if math.prod(d_size) == 0:
            continue
        for (p_off, p_size, _), holders in pieces.items():
            hit = _overlap(p_off, p_size, d_off, d_size)
            if hit is None:
                continue
            off, size = hit
            nbytes = math.prod(size) * itemsize
            if d in holders:
                s = d
            else:
                s = min(holders, key=lambda r: (load[r], r))
                load[s] += nbytes
            transfers.append(Transfer(s, d, off, size, nbytes))
    return tuple(transfers), bool(partial_dims)


@dataclass(frozen=True)
class TransferPlan:
    """How one global tensor moves between two meshes. ``transfers`` lists every box in the
    order every rank posts them; ``reduce``: the source is Partial and destinations add what
    they receive. ``run(local)`` carries it out (every rank of either mesh calls it)."""

    shape: tuple[int, ...]
    dtype: Any
    src_mesh: Any
    src_placements: tuple[Placement, ...]
    dst_mesh: Any
    dst_placements: tuple[Placement, ...]
    transfers: tuple[Transfer, ...]
    reduce: bool
    _ranks: tuple[int, ...] = field(default=(), repr=False)

    @property
    def sent_bytes(self) -> int:
        """Bytes that cross between ranks (local copies excluded)."""
        return sum(t.nbytes for t in self.transfers if t.src != t.dst)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of either mesh (sorted): the ranks that call ``run``."""
        return self._ranks

    def sends(self, rank: int) -> list[Transfer]:
        """What ``rank`` sends to other ranks."""
        return [t for t in self.transfers if t.src == rank and t.dst != rank]

    def receives(self, rank: int) -> list[Transfer]:
        """What ``rank`` receives from other ranks."""
        return [t for t in self.transfers if t.dst == rank and t.src != rank]

    def __str__(self) -> str:
        head = (
            f"TransferPlan {tuple(self.shape)} {self.dtype}: {self.src_mesh.rank_list} "
            f"{format_placements(self.src_placements)} -> {self.dst_mesh.rank_list} "
            f"{format_placements(self.dst_placements)}, {self.sent_bytes} bytes sent"
            + (" (summed at the destination)" if self.reduce else "")
        )
        rows = [
            f"  {t.src} -> {t.dst}: offset {t.offset} size {t.size} ({t.nbytes} B)"
            + (" local" if t.src == t.dst else "")
            for t in self.transfers
        ]
        return "\n".join([head, *rows])

    def run(self, local):
        """Move the tensor: every rank of either mesh calls it; ranks of the source pass their
        local piece, the others None. Destination ranks get their DTensor, the others None."""
        from ._transfer_run import run_transfer

        return run_transfer(self, local)


def _side(mesh, placements, arg: str, ndim: int) -> _Side:
    from ._placement import normalize_placements

    pl = normalize_placements(placements, mesh.ndim, ndim, arg=f"{arg} placements")
    return _Side(tuple(mesh.rank_list), tuple(mesh.shape), pl)


def plan_transfer(
    src_mesh,
    src_placements: Sequence[Placement],
    dst_mesh,
    dst_placements: Sequence[Placement],
    shape: Sequence[int],
    dtype,
) -> TransferPlan:
    """The plan that moves a global tensor of ``shape`` and ``dtype`` laid out as
    ``src_placements`` on ``src_mesh`` to ``dst_placements`` on ``dst_mesh``. Pure and cached:
    every rank computes the same plan without communicating. The meshes may hold the same
    ranks (another shape or order), some of them, or none.

    Raises :class:`ShardingError` for meshes of different frameworks or device types, and
    :class:`PlacementError` for Partial destinations or placements that do not fit."""
    from ._checks import check_mesh

    check_mesh(src_mesh, "src_mesh", "plan_transfer")
    check_mesh(dst_mesh, "dst_mesh", "plan_transfer")
    shape = tuple(int(s) for s in shape)
    for i, s in enumerate(shape):
        if s < 0:
            raise PlacementError(f"plan_transfer: shape[{i}]={s} must be >= 0")
    if getattr(src_mesh, "framework", "torch") != getattr(dst_mesh, "framework", "torch"):
        raise ShardingError(
            f"plan_transfer: src_mesh holds {src_mesh.framework} tensors, dst_mesh "
            f"{dst_mesh.framework} ones: a transfer stays within one framework"
        )
    if getattr(src_mesh, "device_type", None) != getattr(dst_mesh, "device_type", None):
        raise ShardingError(
            f"plan_transfer: src_mesh is on {src_mesh.device_type!r}, dst_mesh on "
            f"{dst_mesh.device_type!r}: move the tensor to the other device type first"
        )
    src = _side(src_mesh, src_placements, "src_mesh", len(shape))
    dst = _side(dst_mesh, dst_placements, "dst_mesh", len(shape))
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in src.placements):
        raise PlacementError(
            f"plan_transfer: src_placements={format_placements(src.placements)}: only "
            "Partial('sum') sources are reduced on the way: redistribute the others first"
        )
    if any(isinstance(p, Partial) for p in dst.placements):
        raise PlacementError(
            f"plan_transfer: dst_placements={format_placements(dst.placements)}: a destination "
            "cannot be Partial (sums are completed on the way): use Replicate or Shard"
        )
    itemsize = _itemsize(dtype)
    transfers, reduce = _plan(src, dst, shape, itemsize)
    return TransferPlan(
        shape,
        dtype,
        src_mesh,
        src.placements,
        dst_mesh,
        dst.placements,
        transfers,
        reduce,
        tuple(sorted(set(src.ranks) | set(dst.ranks))),
    )


def _itemsize(dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    raise PlacementError(f"plan_transfer: dtype={dtype!r} is not a tensor dtype")
