"""Check and simulate a schedule: data dependencies, SEND/RECV matching, deadlocks, timeline,
bubble fraction and peak in-flight activations. Pure Python.

The communication model is the strict one NCCL imposes. Every transfer travels on a channel
(source rank, destination rank, activation or gradient; see :func:`channel`), posted on its own
(adjacent comm steps are posted back to back, before any wait). Posting never blocks the
host, but the transfers of one channel run one after another on that channel's stream, and a
transfer finishes only once its peer has started (send and receive meet). A compute step waits
for the transfer that brought its input. A schedule that completes under this model completes
on gloo and NCCL alike.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ._ir import MetaStep, MetaStepType, Placement, ScheduleError
from ._timeline import TimelineEvent

__all__ = ["Message", "SimResult", "blocking_program", "channel", "check_schedule", "simulate"]

T = MetaStepType
_PEER_RECV = {T.SEND_F: (T.RECV_F, +1), T.SEND_B: (T.RECV_B, -1)}


def channel(step: MetaStep, placement: Placement) -> tuple[int, int, str]:
    """The (source rank, destination rank, "F" or "B") channel a comm step travels on.

    Each channel is its own process group (so its own NCCL communicator and stream): a RECV
    posted early on one channel never holds up a SEND on another, and on one channel both
    ends see the transfers in the same order, so a channel never deadlocks by itself.
    """
    s, t = step.stage, step.type
    if t is T.SEND_F:
        return placement[s], placement[s + 1], "F"
    if t is T.RECV_F:
        return placement[s - 1], placement[s], "F"
    if t is T.SEND_B:
        return placement[s], placement[s - 1], "B"
    return placement[s + 1], placement[s], "B"


_DEFAULT_COSTS = {T.F: 1.0, T.B: 1.0, T.W: 1.0, T.FULL_B: 2.0}


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` found.

    ``timeline`` holds compute events and comm-batch events (kind ``"comm"``, from the batch's
    start on its stream to its completion); ``bubble_fraction`` is the idle share of
    ``ranks x makespan`` (compute only counts as busy); ``peak_inflight[rank]`` the most
    microbatch-stages whose forward ran and whose backward had not yet.
    """

    timeline: tuple[TimelineEvent, ...]
    makespan: float
    bubble_fraction: float
    peak_inflight: dict[int, int]


def check_schedule(
    schedule: Mapping[int, Sequence[MetaStep]], placement: Placement, n_microbatches: int
) -> None:
    """Raise :class:`ScheduleError` unless every stage runs each microbatch's forward once and
    its backward once (FULL_B, or B then W), on the rank the placement gives, after what it
    depends on, and every SEND/RECV has its partner in the right place."""
    n_stages = len(placement)
    done: dict[tuple[T, int, int], int] = {}  # (kind, stage, mb) -> rank it ran on
    for r, steps in schedule.items():
        seen: set[tuple[T, int, int]] = set()
        for step in steps:
            if step.stage not in placement:
                raise ScheduleError(f"rank {r}: {step} names stage {step.stage} (have {n_stages})")
            if placement[step.stage] != r:
                raise ScheduleError(f"rank {r}: {step} runs on rank {placement[step.stage]}")
            if step.is_comm:
                _check_comm(r, step, seen, n_stages)
                keys = [(step.type, step.stage, step.microbatch)]
            elif step.is_compute:
                keys = []
                for part in step.parts():
                    if placement[part.stage] != r:
                        raise ScheduleError(f"rank {r}: {step} fuses a step of another rank")
                    _check_compute(r, part, seen, placement, n_stages, n_microbatches)
                    keys.append((part.type, part.stage, part.microbatch))
            else:
                continue
            for key in keys:
                if key in done:
                    raise ScheduleError(f"rank {r}: {_fmt(key)} appears twice")
                done[key] = r
                seen.add(key)
    for s in range(n_stages):
        for i in range(n_microbatches):
            if (T.F, s, i) not in done:
                raise ScheduleError(f"stage {s} never runs the forward of microbatch {i}")
            full = (T.FULL_B, s, i) in done
            split = (T.B, s, i) in done, (T.W, s, i) in done
            if full == any(split) or (not full and not all(split)):
                raise ScheduleError(
                    f"stage {s} microbatch {i} needs exactly one backward: FULL_B, or B and W"
                )
    for (kind, s, i), _r in done.items():
        if kind in _PEER_RECV:
            recv, d = _PEER_RECV[kind]
            if (recv, s + d, i) not in done:
                raise ScheduleError(f"{s}{kind}{i} has no matching {s + d}{recv}{i}")
        if kind in (T.RECV_F, T.RECV_B):
            send, d = (T.SEND_F, -1) if kind is T.RECV_F else (T.SEND_B, +1)
            if (send, s + d, i) not in done:
                raise ScheduleError(f"{s}{kind}{i} has no matching SEND {s + d}{send}{i}")


def _check_comm(r: int, step: MetaStep, seen: set, n_stages: int) -> None:
    s, i = step.stage, step.microbatch
    if step.type is T.SEND_F and (T.F, s, i) not in seen:
        raise ScheduleError(f"rank {r}: {step} before the forward {s}F{i} that produces it")
    if step.type is T.SEND_B and not ({(T.B, s, i), (T.FULL_B, s, i)} & seen):
        raise ScheduleError(f"rank {r}: {step} before the backward of {s}/{i} that produces it")
    if step.type in (T.SEND_F, T.RECV_B) and s == n_stages - 1:
        raise ScheduleError(f"rank {r}: {step}: the last stage has no next stage")
    if step.type in (T.SEND_B, T.RECV_F) and s == 0:
        raise ScheduleError(f"rank {r}: {step}: the first stage has no previous stage")


def _check_compute(r, part, seen, placement, n_stages, m) -> None:
    s, i = part.stage, part.microbatch
    if i >= m:
        raise ScheduleError(f"rank {r}: {part} names microbatch {i} of {m}")
    local_prev = s > 0 and placement[s - 1] == r
    local_next = s < n_stages - 1 and placement[s + 1] == r
    if part.type is T.F and s > 0:
        need = (T.F, s - 1, i) if local_prev else (T.RECV_F, s, i)
        if need not in seen:
            raise ScheduleError(f"rank {r}: {part} runs before its input ({_fmt(need)})")
    if part.type in (T.B, T.FULL_B):
        if (T.F, s, i) not in seen:
            raise ScheduleError(f"rank {r}: {part} runs before its forward")
        if s < n_stages - 1:
            if local_next:
                if not ({(T.B, s + 1, i), (T.FULL_B, s + 1, i)} & seen):
                    raise ScheduleError(f"rank {r}: {part} runs before stage {s + 1}'s backward")
            elif (T.RECV_B, s, i) not in seen:
                raise ScheduleError(f"rank {r}: {part} runs before {s}RECV_B{i}")
    if part.type is T.W and (T.B, s, i) not in seen:
        raise ScheduleError(f"rank {r}: {part} runs before {s}B{i}")


def _fmt(key) -> str:
    kind, s, i = key
    return f"{s}{kind}{i}"


def simulate(
    schedule: Mapping[int, Sequence[MetaStep]],
    placement: Placement,
    n_microbatches: int,
    *,
    costs: Mapping[T | str, float] | Callable[[MetaStep], float] | None = None,
    comm_cost: float = 0.0,
    host_sync: bool = False,
) -> SimResult:
    """Run the step lists on a model clock and report the timeline.

    With ``host_sync`` each rank's host also stops, before every compute step and after
    posting each stage's first RECV_F (the runtime reads the shape header back there), until
    every transfer it posted has met its peer: the model :func:`order_transfers` makes every
    generated schedule pass.

    ``costs`` maps a compute step type to its duration (default F=1, B=1, W=1, FULL_B=2;
    UNSHARD/RESHARD 0), or is a function of the step. ``OVERLAP_B_F`` costs its two parts'
    sum. ``comm_cost`` is the duration of a comm batch once both sides meet. Raises
    :class:`ScheduleError` for an invalid schedule or a deadlock (naming the stuck steps).
    """
    check_schedule(schedule, placement, n_microbatches)
    cost_of = _cost_fn(costs)
    # items per rank: ("c", step) compute / shard, or ("b", [comm steps]) one batch
    items: dict[int, list[tuple[str, object]]] = {}
    for r, steps in schedule.items():
        lst: list[tuple[str, object]] = []
        for step in steps:
            if step.is_comm:  # each transfer is posted on its own (see the module docstring)
                lst.append(("b", [step]))
            else:
                lst.append(("c", step))
        items[r] = lst

    # nodes: ("c", r, k) compute end; ("s", r, k) batch start on stream; ("d", r, k) batch done
    deps: dict[tuple, list[tuple]] = {}
    own: dict[tuple, float] = {}
    where: dict[tuple[T, int, int], tuple] = {}  # comm step key -> (rank, item, channel)
    for r, lst in items.items():
        for k, (kind, obj) in enumerate(lst):
            if kind == "b":
                for st in obj:
                    where[(st.type, st.stage, st.microbatch)] = (r, k, channel(st, placement))
    for r, lst in items.items():
        host: tuple | None = None  # the node whose value is the host clock here
        prev_batch: dict[str, tuple] = {}  # channel -> its last batch's done node
        posted: list[tuple] = []  # done nodes of the transfers posted since the last compute
        headers: set[int] = set()  # stages whose first RECV_F (with the header) was posted
        for k, (kind, obj) in enumerate(lst):
            if kind == "c":
                node = ("c", r, k)
                d = [host] if host else []
                if host_sync:
                    d += posted
                    posted = []
                for part in obj.parts() if obj.is_compute else ():
                    recv = (
                        (T.RECV_F, part.stage, part.microbatch)
                        if part.type is T.F
                        else (T.RECV_B, part.stage, part.microbatch)
                    )
                    if recv in where and part.type is not T.W:
                        d.append(("d",) + where[recv])
                deps[node], own[node] = d, cost_of(obj)
                host = node
                continue
            for ch in dict.fromkeys(channel(st, placement) for st in obj):
                start, done = ("s", r, k, ch), ("d", r, k, ch)
                deps[start] = [x for x in (host, prev_batch.get(ch)) if x]
                own[start] = 0.0
                peers = []
                for st in obj:
                    if channel(st, placement) != ch:
                        continue
                    if st.type in _PEER_RECV:
                        recv, dd = _PEER_RECV[st.type]
                        peers.append(("s",) + where[(recv, st.stage + dd, st.microbatch)])
                    else:
                        send = T.SEND_F if st.type is T.RECV_F else T.SEND_B
                        dd = -1 if st.type is T.RECV_F else +1
                        peers.append(("s",) + where[(send, st.stage + dd, st.microbatch)])
                deps[done] = [start, *dict.fromkeys(peers)]
                own[done] = comm_cost
                prev_batch[ch] = done
                posted.append(done)
            first_recv = obj[0].type is T.RECV_F and obj[0].stage not in headers
            if first_recv:
                headers.add(obj[0].stage)
            if host_sync and first_recv:  # the shape header is read back: the host stops
                node = ("h", r, k)
                deps[node], own[node] = ([host] if host else []) + posted, 0.0
                host, posted = node, []
    value = _longest_paths(deps, own, items, placement)
    events = []
    busy = defaultdict(float)
    for r, lst in items.items():
        for k, (kind, obj) in enumerate(lst):
            if kind == "c":
                end = value[("c", r, k)]
                c = own[("c", r, k)]
                if obj.is_compute:
                    busy[r] += c
                    events.append(TimelineEvent(r, str(obj), end - c, end, "compute"))
            else:
                for ch in dict.fromkeys(channel(st, placement) for st in obj):
                    label = " ".join(str(st) for st in obj if channel(st, placement) == ch)
                    start, done = value[("s", r, k, ch)], value[("d", r, k, ch)]
                    events.append(TimelineEvent(r, label, start, done, "comm"))
    makespan = max((value[n] for n in value), default=0.0)
    ranks = len(schedule)
    bubble = 1.0 - sum(busy.values()) / (ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        timeline=tuple(sorted(events, key=lambda e: (e.start, e.rank))),
        makespan=makespan,
        bubble_fraction=bubble,
        peak_inflight={r: _peak_inflight(schedule[r]) for r in schedule},
    )


def _cost_fn(costs) -> Callable[[MetaStep], float]:
    if callable(costs):
        return lambda step: float(costs(step)) if step.is_compute else 0.0
    table = dict(_DEFAULT_COSTS)
    for k, v in (costs or {}).items():
        table[T(k)] = float(v)

    def cost(step: MetaStep) -> float:
        if not step.is_compute:
            return table.get(step.type, 0.0)
        return sum(table[p.type] for p in step.parts())

    return cost


def _longest_paths(deps, own, items, placement) -> dict:
    """Kahn's algorithm over the dependency graph: each node's time is the latest of its
    dependencies plus its own cost. Nodes left over sit on a cycle: a deadlock."""
    users = defaultdict(list)
    missing = {}
    for node, d in deps.items():
        missing[node] = len(d)
        for x in d:
            users[x].append(node)
    ready = deque(n for n, c in missing.items() if c == 0)
    value: dict = {}
    while ready:
        n = ready.popleft()
        value[n] = max((value[x] for x in deps[n]), default=0.0) + own[n]
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    if len(value) < len(deps):
        stuck = []
        for r, lst in items.items():
            for k, (kind, obj) in enumerate(lst):
                if kind == "c":
                    nodes = [("c", r, k)]
                else:
                    nodes = [("d", r, k, channel(st, placement)) for st in obj]
                    nodes += [n for n in [("h", r, k)] if n in deps]
                if any(node not in value for node in nodes):
                    what = str(obj) if kind == "c" else " ".join(str(s) for s in obj)
                    stuck.append(f"rank {r} at step {k} ({what})")
                    break
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return value


def _peak_inflight(steps: Sequence[MetaStep]) -> int:
    live, peak = 0, 0
    for step in steps:
        if not step.is_compute:
            continue
        parts = step.parts()
        for p in sorted(parts, key=lambda p: p.type is not T.F):  # F first: the worst case
            if p.type is T.F:
                live += 1
                peak = max(peak, live)
            elif p.type in (T.B, T.FULL_B):
                live -= 1
    return peak


@dataclass(frozen=True)
class Message:
    """One transfer of a blocking transport: ``kind`` ``"F"`` (an activation going to stage
    ``stage + 1``) or ``"B"`` (a gradient going to ``stage - 1``), from stage ``stage``'s
    microbatch ``microbatch``, rank ``src`` to rank ``dst``."""

    kind: str
    stage: int
    microbatch: int
    src: int
    dst: int


def blocking_program(
    schedule: Mapping[int, Sequence[MetaStep]], placement: Placement
) -> dict[int, list[MetaStep | Message]]:
    """Each rank's compute steps with the messages it takes part in placed between them, for a
    transport where a message holds both of its ranks until both are there (point-to-point
    built from a two-rank broadcast, as on MindSpore's CPU backend).

    The messages are put in one order all ranks share, and every rank lists its own in that
    order, each after the compute that produces it (sender) and before the one that consumes
    it (receiver). Then no rank waits forever: the earliest unfinished message has both ranks
    at it, since everything either did before it is computation fed by earlier messages. The
    order comes from running the ranks in lockstep rounds (each rank runs its next step when
    its inputs were produced in an earlier round); a message is placed in the round its
    consumer runs. Ranks that run the same steps (data-parallel replicas of a stage) get the
    same list, so collectives inside their steps stay matched. Stages on one rank hand over
    directly: no message. Raises :class:`ScheduleError` when the steps cannot all run."""
    comp = {r: [s for s in steps if s.is_compute] for r, steps in schedule.items()}
    n = len(placement)
    pos = dict.fromkeys(comp, 0)
    produced: set[tuple[str, int, int]] = set()
    out: dict[int, list[MetaStep | Message]] = {r: [] for r in comp}

    def needs(step: MetaStep) -> list[tuple[str, int, int]]:
        got = []
        for part in step.parts():
            s, i = part.stage, part.microbatch
            if part.type is T.F and s > 0:
                got.append(("F", s - 1, i))
            elif part.type in (T.FULL_B, T.B) and s < n - 1:
                got.append(("B", s + 1, i))
        return got

    def makes(step: MetaStep) -> list[tuple[str, int, int]]:
        got = []
        for part in step.parts():
            if part.type is T.F:
                got.append(("F", part.stage, part.microbatch))
            elif part.type in (T.FULL_B, T.B):
                got.append(("B", part.stage, part.microbatch))
        return got

    while any(pos[r] < len(comp[r]) for r in comp):
        ready = [
            r
            for r in sorted(comp)
            if pos[r] < len(comp[r]) and all(k in produced for k in needs(comp[r][pos[r]]))
        ]
        if not ready:
            stuck = {r: str(comp[r][pos[r]]) for r in comp if pos[r] < len(comp[r])}
            raise ScheduleError(f"the schedule cannot go on: each rank waits on {stuck}")
        deliveries = []
        for r in ready:
            for kind, s, i in needs(comp[r][pos[r]]):
                src = placement[s]
                if src != r:
                    deliveries.append(Message(kind, s, i, src, r))
        for m in sorted(deliveries, key=lambda m: (m.src, m.dst, m.kind, m.stage, m.microbatch)):
            out[m.src].append(m)
            out[m.dst].append(m)
        made = []
        for r in ready:
            step = comp[r][pos[r]]
            out[r].append(step)
            made += makes(step)
            pos[r] += 1
        produced.update(made)
    return out
