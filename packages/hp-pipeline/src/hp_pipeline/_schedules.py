"""Schedule generators: pure functions from (pipeline size, microbatches) to per-rank step lists.

Each ``*_steps`` function returns the compute steps only (F, B, W, FULL_B); ``add_communication``
then inserts the SEND/RECV steps a placement needs, ``add_unshard_reshard`` the UNSHARD/RESHARD
steps for sharded stages, and ``fuse_overlap_b_f`` pairs a backward with a forward of another
microbatch into one OVERLAP_B_F step. ``build_schedule`` chains them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._errors import check_bool, check_int
from ._ir import (
    MetaStep,
    MetaStepType,
    Placement,
    Schedule,
    ScheduleError,
    ScheduleTypeError,
    looped_placement,
    v_placement,
)
from ._sim import channel, check_schedule

_SCHED_ERRS = {"err": ScheduleError, "terr": ScheduleTypeError}

__all__ = [
    "SCHEDULES",
    "add_communication",
    "add_unshard_reshard",
    "build_schedule",
    "order_transfers",
    "fuse_overlap_b_f",
    "gpipe_steps",
    "interleaved_1f1b_steps",
    "merge_adjacent_b_w",
    "one_f_one_b_steps",
    "zbv_steps",
]

F, B, W, FULL_B = MetaStepType.F, MetaStepType.B, MetaStepType.W, MetaStepType.FULL_B
T = MetaStepType


def _check(pp: int, m: int) -> None:
    for arg, v in (("pp (pipeline ranks)", pp), ("n_microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ScheduleTypeError(f"{arg}={v!r} is a {type(v).__name__}: give a positive int")
        if v < 1:
            raise ScheduleError(f"{arg} must be a positive int, got {v!r}")


def gpipe_steps(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards (microbatch order); one stage per rank."""
    _check(pp, m)
    return {
        r: [MetaStep(F, r, i) for i in range(m)] + [MetaStep(FULL_B, r, i) for i in range(m)]
        for r in range(pp)
    }


def one_f_one_b_steps(pp: int, m: int) -> Schedule:
    """1F1B: rank ``r`` runs ``pp - 1 - r`` warm-up forwards, then alternates one forward and
    one backward, then drains the backwards: at most ``pp - r`` microbatches in flight."""
    _check(pp, m)
    out: Schedule = {}
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        steps = [MetaStep(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            steps += [MetaStep(F, r, warm + i), MetaStep(FULL_B, r, i)]
        steps += [MetaStep(FULL_B, r, i) for i in range(m - warm, m)]
        out[r] = steps
    return out


def interleaved_1f1b_steps(pp: int, m: int, stages_per_rank: int) -> Schedule:
    """Interleaved 1F1B (looped placement: stage ``s`` on rank ``s % pp``).

    Microbatches go in rounds of ``pp``: within a round a rank runs its first local stage on
    the round's microbatches, then its second, and so on; backwards mirror this with the local
    stages reversed. Rank ``r`` warms up with ``(v - 1) * pp + 2 * (pp - 1 - r)`` forwards, then
    alternates one forward, one backward. Needs ``m % pp == 0``.
    """
    _check(pp, m)
    v = stages_per_rank
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"stages_per_rank must be a positive int, got {v!r}")
    if m % pp:
        raise ScheduleError(
            f"interleaved 1F1B needs n_microbatches ({m}) divisible by the pipeline size ({pp}); "
            f"use {m + (-m) % pp} microbatches or another schedule"
        )
    total = v * m

    def unit(k: int, backward: bool) -> tuple[int, int]:  # -> (local chunk, microbatch)
        rnd, pos = divmod(k, pp * v)
        chunk, i = divmod(pos, pp)
        return (v - 1 - chunk if backward else chunk), rnd * pp + i

    out: Schedule = {}
    for r in range(pp):
        warm = min((v - 1) * pp + 2 * (pp - 1 - r), total)

        def fwd(k: int, r: int = r) -> MetaStep:
            c, i = unit(k, False)
            return MetaStep(F, c * pp + r, i)

        def bwd(k: int, r: int = r) -> MetaStep:
            c, i = unit(k, True)
            return MetaStep(FULL_B, c * pp + r, i)

        steps = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            steps += [fwd(warm + k), bwd(k)]
        steps += [bwd(k) for k in range(total - warm, total)]
        out[r] = steps
    return out


def zbv_steps(pp: int, m: int) -> Schedule:
    """Zero-bubble V (two stages per rank: ``r`` and ``2*pp - 1 - r``; B and W split).

    Rank ``r`` first runs forwards of its down-going stage, then interleaves forwards of both
    stages, reaching the V's turn; in the steady phase it alternates (F, B, W) on each of its two
    stages; in the drain it runs the remaining input gradients first and defers weight gradients
    into what would otherwise be bubbles.
    """
    _check(pp, m)
    out: Schedule = {}
    n = max(m, 2 * pp - 1)  # plan with enough microbatches to fill the V; drop the extra ones
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        f0 = f1 = b0 = b1 = 0
        steps: list[MetaStep] = []

        def add(kind: MetaStepType, stage: int, i: int, steps: list = steps) -> None:
            steps.append(MetaStep(kind, stage, i))

        for _ in range(2 * (pp - r) - 1):  # down the V on the first stage
            add(F, s0, f0)
            f0 += 1
        for _ in range(r):  # both stages, alternating
            add(F, s1, f1)
            f1 += 1
            add(F, s0, f0)
            f0 += 1
        for _ in range(pp - r):  # the turn: second stage forward, then its B and W at once
            add(F, s1, f1)
            f1 += 1
            add(B, s1, b1)
            add(W, s1, b1)
            b1 += 1
        while f1 < f0 or f0 < n:  # steady state
            if f0 < n:
                add(F, s0, f0)
                f0 += 1
            add(B, s0, b0)
            add(W, s0, b0)
            b0 += 1
            add(F, s1, f1)
            f1 += 1
            add(B, s1, b1)
            add(W, s1, b1)
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):  # drain: input gradients first
            add(B, s0, b0)
            b0 += 1
            add(B, s1, b1)
            b1 += 1
        for _ in range(pp - r):
            add(B, s0, b0)
            b0 += 1
            add(W, s0, w0)
            w0 += 1
        while w1 < b1:
            add(W, s1, w1)
            w1 += 1
        while w0 < b0:
            add(W, s0, w0)
            w0 += 1
        if not (f0 == b0 == w0 == f1 == b1 == w1 == n):  # pragma: no cover - generator bug
            raise AssertionError(f"zbv_steps({pp}, {m}) rank {r} is unbalanced")
        out[r] = [s for s in steps if s.microbatch < m]
    return out


SCHEDULES = {
    "gpipe": ("GPipe", 1),
    "1f1b": ("1F1B", 1),
    "interleaved_1f1b": ("Interleaved1F1B", None),
    "zbv": ("ZBV", 2),
}
"""Schedule names accepted by :func:`build_schedule` -> (display name, stages per rank)."""


def _recv_for(step: MetaStep, placement: Placement, n_stages: int) -> list[MetaStep]:
    out, me = [], placement[step.stage]
    for part in step.parts():
        s, i = part.stage, part.microbatch
        if part.type is F and s > 0 and placement[s - 1] != me:
            out.append(MetaStep(T.RECV_F, s, i))
        elif part.type in (B, FULL_B) and s < n_stages - 1 and placement[s + 1] != me:
            out.append(MetaStep(T.RECV_B, s, i))
    return out


def _send_for(step: MetaStep, placement: Placement, n_stages: int) -> list[MetaStep]:
    out, me = [], placement[step.stage]
    for part in step.parts():
        s, i = part.stage, part.microbatch
        if part.type is F and s < n_stages - 1 and placement[s + 1] != me:
            out.append(MetaStep(T.SEND_F, s, i))
        elif part.type in (B, FULL_B) and s > 0 and placement[s - 1] != me:
            out.append(MetaStep(T.SEND_B, s, i))
    return out


def add_communication(
    compute: Mapping[int, Sequence[MetaStep]], placement: Placement, *, overlap_p2p: bool = False
) -> Schedule:
    """Insert the SEND/RECV steps: a RECV before the compute that needs it, a SEND right after
    the compute that produced it; adjacent comm steps form one batch at run time.

    With ``overlap_p2p`` each RECV is posted one compute step earlier (before the compute that
    precedes its consumer), so the transfer runs while that compute does.
    """
    n_stages = len(placement)
    out: Schedule = {}
    for r, steps in compute.items():
        comp = [s for s in steps if s.is_compute]
        other = [s for s in steps if not s.is_compute and not s.is_comm]
        if other:
            raise ScheduleError("add_communication takes compute steps only; shard steps go last")
        recvs = [_recv_for(s, placement, n_stages) for s in comp]
        new: list[MetaStep] = []
        if overlap_p2p and comp:
            new += recvs[0]
        for k, step in enumerate(comp):
            if overlap_p2p:
                if k + 1 < len(comp):
                    new += recvs[k + 1]
            else:
                new += recvs[k]
            new.append(step)
            new += _send_for(step, placement, n_stages)
        out[r] = new
    return out


_PARTNER = {
    T.SEND_F: (T.RECV_F, +1),
    T.SEND_B: (T.RECV_B, -1),
    T.RECV_F: (T.SEND_F, -1),
    T.RECV_B: (T.SEND_B, +1),
}


def _partner(step: MetaStep) -> tuple[MetaStepType, int, int]:
    kind, d = _PARTNER[step.type]
    return kind, step.stage + d, step.microbatch


def _consumes(step: MetaStep, recv: MetaStep) -> bool:
    """Whether compute ``step`` reads what RECV ``recv`` brings."""
    kinds = (F,) if recv.type is T.RECV_F else (B, FULL_B)
    return _has_part(step, kinds, recv)


def _produced(send: MetaStep, done: Sequence[MetaStep]) -> bool:
    """Whether the compute that produces SEND ``send`` is among ``done``."""
    kinds = (F,) if send.type is T.SEND_F else (B, FULL_B)
    return any(d.is_compute and _has_part(d, kinds, send) for d in done)


def _has_part(step: MetaStep, kinds: tuple, like: MetaStep) -> bool:
    return any(
        p.type in kinds and (p.stage, p.microbatch) == (like.stage, like.microbatch)
        for p in step.parts()
    )


def order_transfers(schedule: Mapping[int, Sequence[MetaStep]], placement: Placement) -> Schedule:
    """Post transfers early enough that the schedule survives a host that blocks.

    The runtime posts transfers without waiting, but a rank's host does stop at times until
    its device is idle: the caching allocator freeing blocks, a lazily loaded kernel, a shape
    header read back. If a transfer it posted then waits for a peer, and that peer posts its
    side only after hearing from this rank again, neither moves: the GPU deadlock ZBV met at
    8B scale, where rank 0 sent a third forward that rank 1 would receive only after a
    gradient rank 0 had yet to compute. Small transfers hid it (NCCL buffers them).

    The test is the strict model: every compute step waits until every transfer posted before
    it on its rank has met its peer (``simulate(..., host_sync=True)``), and so does the first
    RECV_F of each stage (it reads the shape header). Played out on that model, a stall means
    a rank holds a posted transfer whose partner is not posted yet; the partner (with the
    unposted steps ahead of it on its channel) is then posted where its rank stands now, which
    a RECV always can be and a SEND once its compute ran. Steps only move earlier, so no
    transfer starts later than before, except for one case: an early RECV (``overlap_p2p``)
    whose SEND waits on this rank's next compute moves behind that compute. Raises
    :class:`ScheduleError` if no move is possible.
    """
    m = 1 + max(
        (p.microbatch for st in schedule.values() for s in st if s.is_compute for p in s.parts()),
        default=0,
    )
    check_schedule(schedule, placement, m)  # every RECV has its SEND, in the right place
    lists = {r: list(steps) for r, steps in schedule.items()}
    pos = dict.fromkeys(lists, 0)
    pending: dict[int, list[MetaStep]] = {r: [] for r in lists}
    posted: set[tuple[MetaStepType, int, int]] = set()
    where = {
        (st.type, st.stage, st.microbatch): r
        for r, lst in lists.items()
        for st in lst
        if st.is_comm
    }
    header_seen: dict[int, set[int]] = {r: set() for r in lists}

    def post(r: int, st: MetaStep) -> None:
        pending[r].append(st)
        posted.add((st.type, st.stage, st.microbatch))

    blocked = dict.fromkeys(lists, False)
    while any(pos[r] < len(lists[r]) or pending[r] for r in lists):
        progress = False
        for r, lst in lists.items():
            if blocked[r]:
                if all(_partner(st) in posted for st in pending[r]):
                    pending[r].clear()
                    blocked[r] = False
                    progress = True
                else:
                    continue
            while pos[r] < len(lst) and lst[pos[r]].is_comm:
                st = lst[pos[r]]
                post(r, st)
                pos[r] += 1
                progress = True
                if st.type is T.RECV_F and st.stage not in header_seen[r]:
                    header_seen[r].add(st.stage)
                    blocked[r] = True
                    break  # the header is read back here: a blocking point
            if blocked[r]:
                continue
            if pending[r] and all(_partner(st) in posted for st in pending[r]):
                pending[r].clear()
                progress = True
            if not pending[r] and pos[r] < len(lst) and not lst[pos[r]].is_comm:
                pos[r] += 1
                progress = True
        if progress or _pull_one(
            lists, pos, pending, posted, where, placement, post, blocked, header_seen
        ):
            continue
        if not _defer_one(lists, pos, pending, posted, header_seen, placement, blocked):
            stuck = "; ".join(f"rank {r}: {' '.join(map(str, p))}" for r, p in pending.items() if p)
            raise ScheduleError(f"deadlock whatever the order of transfers: {stuck}")
    return lists


def _defer_one(lists, pos, pending, posted, header_seen, placement, blocked) -> bool:
    """Move a rank's early RECVs whose SENDs cannot be posted yet (``overlap_p2p`` posts each
    one compute step ahead) behind its next compute step, if that lets the rank go on."""
    for r, lst in lists.items():
        nxt = next((k for k in range(pos[r], len(lst)) if not lst[k].is_comm), None)
        if nxt is None:
            continue
        unmatched = [st for st in pending[r] if _partner(st) not in posted]
        early = [
            st
            for st in unmatched
            if st.type in (T.RECV_F, T.RECV_B) and not _consumes(lst[nxt], st)
        ]
        if not early or len(early) < len(unmatched):
            continue
        chans = {channel(st, placement) for st in early}
        later = [x for x in lst[pos[r] : nxt] if x.is_comm and channel(x, placement) in chans]
        for st in early:
            pending[r].remove(st)
            posted.discard((st.type, st.stage, st.microbatch))
            if st.type is T.RECV_F and blocked[r] and st is lst[pos[r] - 1]:
                blocked[r] = False
            if st.type is T.RECV_F:
                header_seen[r].discard(st.stage)
        for x in early + later:
            lst.remove(x)
        pos[r] -= len(early)
        nxt = next(k for k in range(pos[r], len(lst)) if not lst[k].is_comm)
        lst[nxt + 1 : nxt + 1] = early + later
        return True
    return False


def _pull_one(lists, pos, pending, posted, where, placement, post, blocked, header_seen) -> bool:
    """Post, at its rank's current position, the partner of one waiting transfer (before the
    header RECV_F a rank stopped at). A pulled first RECV_F of a stage stops its rank there."""
    for r in lists:
        for st in pending[r]:
            key = _partner(st)
            if key in posted:
                continue
            q = where[key]
            lst = lists[q]
            k = next(
                k
                for k in range(pos[q], len(lst))
                if lst[k].is_comm and (lst[k].type, lst[k].stage, lst[k].microbatch) == key
            )
            ch = channel(lst[k], placement)
            at = pos[q] - 1 if blocked[q] else pos[q]
            if blocked[q] and channel(lst[at], placement) == ch:
                continue
            move = [x for x in lst[pos[q] : k + 1] if x.is_comm and channel(x, placement) == ch]
            heads = [
                i
                for i, x in enumerate(move)
                if x.type is T.RECV_F and x.stage not in header_seen[q]
            ]
            if heads and blocked[q]:
                continue  # one stop at a time
            if heads:  # the host stops at the header: nothing after it is posted yet
                move = move[: heads[0] + 1]
            sends = [x for x in move if x.type in (T.SEND_F, T.SEND_B)]
            if any(not _produced(x, lst[: pos[q]]) for x in sends):
                continue
            for x in move:
                lst.remove(x)
            lst[at:at] = move
            for x in move:
                post(q, x)
            if heads:
                header_seen[q].add(move[-1].stage)
                blocked[q] = True
            pos[q] += len(move)
            return True
    return False


def add_unshard_reshard(schedule: Mapping[int, Sequence[MetaStep]]) -> Schedule:
    """UNSHARD each stage right before its first compute step on its rank and RESHARD it right
    after its last one: sharded stage parameters are gathered once per step, not per
    microbatch."""
    out: Schedule = {}
    for r, steps in schedule.items():
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, s in enumerate(steps):
            if s.is_compute:
                for part in s.parts():
                    first.setdefault(part.stage, k)
                    last[part.stage] = k
        new: list[MetaStep] = []
        for k, s in enumerate(steps):
            new += [MetaStep(T.UNSHARD, st) for st, at in sorted(first.items()) if at == k]
            new.append(s)
            new += [MetaStep(T.RESHARD, st) for st, at in sorted(last.items()) if at == k]
        out[r] = new
    return out


def merge_adjacent_b_w(
    compute: Mapping[int, Sequence[MetaStep]], placement: Placement | None = None
) -> Schedule:
    """Turn a B immediately followed by the W of the same stage and microbatch into one
    FULL_B where that delays nothing: the split pays where the W moves into a bubble or where
    the input gradient goes to another rank (sent between B and W); each split costs a second
    pass over the stage's autograd graph. With a ``placement``, pairs whose input gradient
    crosses ranks stay split."""
    out: Schedule = {}
    for r, steps in compute.items():
        new: list[MetaStep] = []
        for st in steps:
            prev = new[-1] if new else None
            local = (
                placement is None or st.stage == 0 or placement[st.stage - 1] == placement[st.stage]
            )
            if (
                st.type is W
                and local
                and prev is not None
                and prev.type is B
                and (prev.stage, prev.microbatch) == (st.stage, st.microbatch)
            ):
                new[-1] = MetaStep(FULL_B, st.stage, st.microbatch)
            else:
                new.append(st)
        out[r] = new
    return out


def fuse_overlap_b_f(compute: Mapping[int, Sequence[MetaStep]]) -> Schedule:
    """Fuse each backward (B or FULL_B) immediately followed by a forward of another microbatch
    on the same rank into one OVERLAP_B_F step: the steady state of 1F1B, interleaved and ZBV,
    where one microbatch's backward can hide the other's communication. In ZBV a weight
    gradient between them moves after the pair. GPipe has no such pair and stays as it is."""
    out: Schedule = {}
    for r, steps in compute.items():
        new: list[MetaStep] = []
        k = 0
        while k < len(steps):
            a = steps[k]
            nxt = steps[k + 1] if k + 1 < len(steps) else None
            w = None
            if (  # ZBV: B, W, F -> (B + F), W: the weight gradient waits one step
                a.type is B
                and nxt is not None
                and nxt.type is W
                and k + 2 < len(steps)
                and steps[k + 2].type is F
            ):
                w, nxt = nxt, steps[k + 2]
            if (
                nxt is not None
                and a.type in (B, FULL_B)
                and nxt.type is F
                and (a.stage, a.microbatch) != (nxt.stage, nxt.microbatch)
            ):
                new.append(
                    MetaStep(T.OVERLAP_B_F, a.stage, a.microbatch, fused=nxt, backward=a.type)
                )
                if w is not None:
                    new.append(w)
                k += 2 if w is None else 3
            else:
                new.append(a)
                k += 1
        out[r] = new
    return out


def build_schedule(
    name: str,
    pp: int,
    n_microbatches: int,
    *,
    stages_per_rank: int | None = None,
    overlap_p2p: bool = False,
    overlap_b_f: bool = False,
    shard_steps: bool = False,
    split_bw: bool = False,
) -> tuple[Schedule, Placement]:
    """The full per-rank step lists of a named schedule and its stage placement.

    ``name`` is one of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv``. ZBV runs a B and
    the W right after it as one FULL_B where its input gradient stays on the rank, unless
    ``split_bw`` (:func:`merge_adjacent_b_w`).
    """
    if not isinstance(name, str):
        raise ScheduleTypeError(
            f"build_schedule: name={name!r} is a {type(name).__name__}: give one of "
            f"{sorted(SCHEDULES)}"
        )
    key = name.lower()
    if stages_per_rank is not None:
        check_int(stages_per_rank, "stages_per_rank", "build_schedule", low=1, **_SCHED_ERRS)
    for arg, v in (
        ("overlap_p2p", overlap_p2p),
        ("overlap_b_f", overlap_b_f),
        ("shard_steps", shard_steps),
        ("split_bw", split_bw),
    ):
        check_bool(v, arg, "build_schedule", terr=ScheduleTypeError)
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    _check(pp, n_microbatches)
    fixed = SCHEDULES[key][1]
    v = stages_per_rank if stages_per_rank is not None else (fixed or 2)
    if fixed is not None and v != fixed:
        raise ScheduleError(f"{name} runs {fixed} stage(s) per rank, got stages_per_rank={v}")
    if key == "gpipe":
        compute = gpipe_steps(pp, n_microbatches)
    elif key == "1f1b":
        compute = one_f_one_b_steps(pp, n_microbatches)
    elif key == "interleaved_1f1b":
        compute = interleaved_1f1b_steps(pp, n_microbatches, v)
    else:
        compute = zbv_steps(pp, n_microbatches)
        if not split_bw:
            compute = merge_adjacent_b_w(compute, v_placement(pp))
    placement = v_placement(pp) if key == "zbv" else looped_placement(v * pp, pp)
    if overlap_b_f:
        compute = fuse_overlap_b_f(compute)
    steps = add_communication(compute, placement, overlap_p2p=overlap_p2p)
    if shard_steps:
        steps = add_unshard_reshard(steps)
    return order_transfers(steps, placement), placement
