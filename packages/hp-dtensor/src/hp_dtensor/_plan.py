"""Redistribution planner: pure Python over mesh shape, placements and global shape.

``plan_redistribute`` turns (mesh shape, source placements, target placements, global shape)
into an ordered list of ``Step`` values, each changing the placement on one mesh dimension:

==================  ===================  ===========================================
source -> target    step kind            communication along that mesh dimension
==================  ===================  ===========================================
Shard(i) -> R       ``all_gather``       all-gather
Partial -> R        ``all_reduce``       all-reduce
Partial -> Shard    ``reduce_scatter``   reduce-scatter (sum/avg only)
Shard(i) -> Sh(j)   ``all_to_all``       all-to-all
R -> Shard(i)       ``chunk``            none: keep this rank's chunk
R -> Partial        ``partition``        none: sum keeps the value on coordinate 0
Shard(i) -> P(sum)  ``pad``              none: place the shard in a zero tensor
==================  ===================  ===========================================

Any pair of placements is reachable through these steps. The planner runs a shortest-path search
over the states reachable one mesh dimension at a time and returns the plan that moves the fewest
elements per rank (local steps cost a little, to prefer fewer of them).

NOTE [Nested shards]: when mesh dimensions ``a < b`` both shard tensor dim ``k``, ``b`` splits the
pieces of ``a``. A step on mesh dimension ``d`` that reads or writes ``Shard(k)`` is only valid
when no mesh dimension after ``d`` currently shards ``k``; otherwise the inner split has to be
undone first. The search enforces this, so ``(S(0), S(0)) -> (R, R)`` gathers mesh dim 1 first.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ._placement import Partial, Placement, Replicate, Shard, format_placements
from .errors import HPDTensorTypeError, PlacementError

__all__ = ["Step", "RedistributePlan", "plan_redistribute", "COMM_KINDS"]

#: Step kinds that communicate.
COMM_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
_LOCAL_COST = 1e-3  # per element, so local steps are cheap but not free
_STEP_COST = 1e-9  # per step, to prefer shorter plans among equal costs


@dataclass(frozen=True, slots=True)
class Step:
    """One change of placement on one mesh dimension."""

    kind: str
    mesh_dim: int
    src: Placement
    dst: Placement

    def __str__(self) -> str:
        return f"{self.kind}[{self.mesh_dim}]({self.src}->{self.dst})"


@dataclass(frozen=True, slots=True)
class RedistributePlan:
    """An ordered list of steps and its cost in elements moved per rank."""

    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[Step, ...]
    cost: float

    def __str__(self) -> str:
        body = " ; ".join(str(s) for s in self.steps) or "no-op"
        return f"{format_placements(self.src)} -> {format_placements(self.dst)}: {body}"

    @property
    def is_noop(self) -> bool:
        """True when no step is needed."""
        return not self.steps


def _step_kind(src: Placement, dst: Placement) -> str | None:
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard):
            return "all_to_all"
        if dst == Partial("sum"):
            return "pad"
        return None
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):
            return "chunk"
        if isinstance(dst, Partial):
            return "partition"
        return None
    # src is Partial
    if isinstance(dst, Replicate):
        return "all_reduce"
    if isinstance(dst, Shard) and src.reduce_op in ("sum", "avg"):
        return "reduce_scatter"
    return None


def _touches(src: Placement, dst: Placement) -> tuple[int, ...]:
    return tuple(p.dim for p in (src, dst) if isinstance(p, Shard))


def _local_numel(global_shape, mesh_shape, state) -> float:
    n = float(math.prod(global_shape))
    for size, p in zip(mesh_shape, state):
        if isinstance(p, Shard):
            n /= size
    return n


def _cost(kind: str, n: int, local_before: float, local_after: float) -> float:
    frac = (n - 1) / n
    if kind == "all_gather":
        return frac * local_after
    if kind == "reduce_scatter":
        return frac * local_before
    if kind == "all_reduce":
        return 2 * frac * local_before
    if kind == "all_to_all":
        return frac * local_before
    return _LOCAL_COST * max(local_before, local_after)


def _check_args(mesh_shape, src, dst, global_shape) -> None:
    """Raise a typed error naming the argument of ``plan_redistribute`` that does not fit."""
    for arg, sizes, low in (("mesh_shape", mesh_shape, 1), ("global_shape", global_shape, 0)):
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise HPDTensorTypeError(f"plan_redistribute: {arg}={sizes!r} must be a tuple of ints")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int):
                raise HPDTensorTypeError(
                    f"plan_redistribute: {arg}={tuple(sizes)!r} holds {s!r}: give ints"
                )
            if s < low:
                raise PlacementError(
                    f"plan_redistribute: {arg}={tuple(sizes)} holds {s}: sizes must be >= {low}"
                )
    ndim, tdim = len(tuple(mesh_shape)), len(tuple(global_shape))
    for arg, pl in (("src", src), ("dst", dst)):
        if isinstance(pl, (str, bytes)) or not hasattr(pl, "__iter__"):
            raise HPDTensorTypeError(
                f"plan_redistribute: {arg}={pl!r} must be a tuple of placements, one per mesh "
                "dimension"
            )
        pl = tuple(pl)
        if len(pl) != ndim:
            raise PlacementError(
                f"plan_redistribute: {arg}={pl} has {len(pl)} entries for a {ndim}-D mesh: give "
                "one placement per mesh dimension"
            )
        for i, p in enumerate(pl):
            if not isinstance(p, Placement):
                raise PlacementError(
                    f"plan_redistribute: {arg}[{i}]={p!r} is not a placement: use Shard(dim), "
                    "Replicate() or Partial()"
                )
            if isinstance(p, Shard) and not 0 <= p.dim < tdim:
                raise PlacementError(
                    f"plan_redistribute: {arg}[{i}]={p!r} is out of range for global_shape "
                    f"{tuple(global_shape)}: give a shard dim in [0, {tdim})"
                )


@lru_cache(maxsize=8192)
def _plan(mesh_shape, src, dst, global_shape) -> RedistributePlan:
    _check_args(mesh_shape, src, dst, global_shape)  # once per cache entry
    ndim = len(mesh_shape)
    # Size-1 mesh dimensions hold the whole tensor: relabel them without a step.
    start = tuple(dst[d] if mesh_shape[d] == 1 else src[d] for d in range(ndim))
    if start == dst:
        return RedistributePlan(src, dst, (), 0.0)
    # NOTE: options are listed in a fixed order (never a set): ties between equally cheap plans
    # are broken by this order, and every rank must pick the same plan.
    options = []
    for d in range(ndim):
        opts = [Replicate(), start[d], dst[d]] + [Shard(k) for k in range(len(global_shape))]
        options.append(tuple(dict.fromkeys(opts)))
    best = {start: 0.0}
    heap = [(0.0, 0, start, ())]
    counter = 1
    while heap:
        cost, _, state, steps = heapq.heappop(heap)
        if state == dst:
            return RedistributePlan(src, dst, steps, cost)
        if cost > best.get(state, math.inf):
            continue
        before = _local_numel(global_shape, mesh_shape, state)
        for d in range(ndim):
            cur = state[d]
            for nxt in options[d]:
                if nxt == cur:
                    continue
                kind = _step_kind(cur, nxt)
                if kind is None:
                    continue
                dims = _touches(cur, nxt)
                if any(
                    isinstance(state[e], Shard) and state[e].dim in dims for e in range(d + 1, ndim)
                ):
                    continue  # NOTE [Nested shards]
                new_state = state[:d] + (nxt,) + state[d + 1 :]
                after = _local_numel(global_shape, mesh_shape, new_state)
                c = cost + _cost(kind, mesh_shape[d], before, after) + _STEP_COST
                if c < best.get(new_state, math.inf) - 1e-12:
                    best[new_state] = c
                    heapq.heappush(
                        heap, (c, counter, new_state, steps + (Step(kind, d, cur, nxt),))
                    )
                    counter += 1
    raise ValueError(  # unreachable for valid placements: every state reaches all-Replicate
        f"no redistribution from {format_placements(src)} to {format_placements(dst)}"
    )


def plan_redistribute(
    mesh_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
) -> RedistributePlan:
    """The cheapest ordered list of steps taking ``src`` placements to ``dst``.

    Both placement tuples must have one entry per mesh dimension with non-negative shard dims.
    Results are cached.

    >>> str(plan_redistribute((2, 2), (Shard(0), Shard(0)), (Replicate(), Replicate()), (8, 4)))
    '(S(0), S(0)) -> (R, R): all_gather[1](S(0)->R) ; all_gather[0](S(0)->R)'
    """
    try:
        return _plan(tuple(mesh_shape), tuple(src), tuple(dst), tuple(global_shape))
    except TypeError:  # not a tuple or unhashable: say which argument
        _check_args(mesh_shape, src, dst, global_shape)
        raise
