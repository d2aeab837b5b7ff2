"""Save and load plans: pure Python over item descriptions.

Save: every rank describes what it holds (:class:`WriteItem`); the descriptions of all ranks are
exchanged once, and every rank runs the same deterministic :meth:`SavePlanner.plan` on them, so
no second exchange is needed. The default planner writes every distinct box once (replicated
pieces are held by several ranks) and balances bytes across ranks: largest pieces first, each to
the least-loaded rank that holds it (greedy LPT scheduling).

Load: :func:`plan_reads` intersects the box a rank needs with the stored chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._meta import Chunk, TensorEntry, intersect, numel
from .errors import StateDictError

__all__ = ["ReadItem", "SavePlanner", "WriteItem", "plan_reads"]


@dataclass(frozen=True)
class WriteItem:
    """One thing a rank could write: a tensor box or an object's encoded bytes."""

    key: str
    kind: str  # "tensor" or "object"
    nbytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    digest: int = 0  # objects: CRC-32 of the encoded bytes
    placements: str = ""

    @property
    def box(self) -> tuple:
        return (self.key, self.offsets, self.sizes)


class SavePlanner:
    """Chooses the writer of every item. Subclass and override :meth:`plan` to change the policy;
    it must be deterministic (every rank runs it on the same input)."""

    def plan(self, items_by_rank: list[list[WriteItem]]) -> list[list[WriteItem]]:
        """``items_by_rank[r]``: what rank ``r`` holds. Returns what each rank writes."""
        check_consistent(items_by_rank)
        holders: dict[tuple, list[int]] = {}
        first: dict[tuple, WriteItem] = {}
        per_rank_objects: list[tuple[int, WriteItem]] = []
        objects: dict[str, list[tuple[int, WriteItem]]] = {}
        for r, items in enumerate(items_by_rank):
            for it in items:
                if it.kind == "tensor":
                    holders.setdefault(it.box, []).append(r)
                    first.setdefault(it.box, it)
                else:
                    objects.setdefault(it.key, []).append((r, it))
        units: list[tuple[WriteItem, list[int]]] = [(first[b], hs) for b, hs in holders.items()]
        for held in objects.values():
            if len({(it.digest, it.nbytes) for _, it in held}) == 1:
                units.append((held[0][1], [r for r, _ in held]))
            else:  # values differ: every holder writes its own
                per_rank_objects.extend(held)
        load = [0] * len(items_by_rank)
        out: list[list[WriteItem]] = [[] for _ in items_by_rank]
        for r, it in per_rank_objects:
            out[r].append(it)
            load[r] += it.nbytes
        units.sort(key=lambda u: (-u[0].nbytes, u[0].key, u[0].offsets))
        for it, hs in units:
            r = min(hs, key=lambda h: (load[h], h))
            out[r].append(it)
            load[r] += it.nbytes
        for items in out:  # file order: by key, then offsets (sequential reads on load)
            items.sort(key=lambda it: (it.key, it.offsets))
        return out


def check_consistent(items_by_rank: list[list[WriteItem]]) -> None:
    """Every rank must agree on what a key is (tensor or object, dtype, global shape), and the
    boxes of a tensor must cover it exactly once counting each distinct box once."""
    seen: dict[str, tuple[int, WriteItem]] = {}
    boxes: dict[str, set] = {}
    for r, items in enumerate(items_by_rank):
        for it in items:
            if it.key not in seen:
                seen[it.key] = (r, it)
            else:
                r0, it0 = seen[it.key]
                if (it0.kind, it0.dtype, it0.shape) != (it.kind, it.dtype, it.shape):
                    raise StateDictError(
                        f"state_dict key {it.key!r} differs between ranks: rank {r0} has "
                        f"{_what(it0)}, rank {r} has {_what(it)}; every rank must describe the "
                        "same global value"
                    )
            if it.kind == "tensor":
                boxes.setdefault(it.key, set()).add((it.offsets, it.sizes))
    for key, bs in boxes.items():
        shape = seen[key][1].shape
        covered = sum(numel(s) for _, s in bs)
        if covered != numel(shape):
            raise StateDictError(
                f"state_dict key {key!r}: the ranks' shards cover {covered} of {numel(shape)} "
                f"elements of shape {tuple(shape)}; shards must tile the tensor (overlapping or "
                "missing pieces)"
            )


def _what(it: WriteItem) -> str:
    if it.kind == "object":
        return "a non-tensor value"
    return f"a {it.dtype} tensor of shape {tuple(it.shape)}"


@dataclass(frozen=True)
class ReadItem:
    """Read ``sizes`` elements at global ``offsets`` from ``chunk``."""

    chunk: Chunk
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def plan_reads(key: str, entry: TensorEntry, offsets, sizes) -> list[ReadItem]:
    """The stored pieces that make up the box ``offsets``/``sizes`` of tensor ``key``. Raises
    :class:`StateDictError` when the checkpoint lacks part of it."""
    if numel(sizes) == 0:
        return []
    out, got, seen = [], 0, set()
    for c in entry.chunks:
        if (c.offsets, c.sizes) in seen:
            continue  # the same box stored twice (e.g. merged checkpoints): read it once
        hit = intersect(c.offsets, c.sizes, offsets, sizes)  # a scalar's empty boxes meet
        if hit is None:
            continue
        seen.add((c.offsets, c.sizes))
        out.append(ReadItem(c, hit[0], hit[1]))
        got += numel(hit[1])
    if got != numel(sizes):
        raise StateDictError(
            f"checkpoint holds {got} of the {numel(sizes)} elements of {key!r} that this rank "
            f"needs (offsets {tuple(offsets)}, sizes {tuple(sizes)}): the checkpoint is incomplete"
        )
    return out
