"""``blocking_program``: the per-rank programs of a transport whose messages hold both ranks
until both are there (MindSpore's CPU point-to-point). Checked by running the programs with
that rule: every schedule finishes, each message after its producer and before its consumer;
and a program order that ignores the rule deadlocks under the same runner."""

import pytest

from hp_pipeline import Message, MetaStepType, blocking_program, build_schedule

T = MetaStepType


def _run(programs):
    """Run programs where a message completes only when both its ranks are at it; returns the
    order of completed items, or raises on a deadlock."""
    pos = dict.fromkeys(programs, 0)
    order = []
    while any(pos[r] < len(p) for r, p in programs.items()):
        moved = False
        for r, p in programs.items():
            while pos[r] < len(p):
                item = p[pos[r]]
                if isinstance(item, Message):
                    peer = item.dst if item.src == r else item.src
                    q = programs[peer]
                    if pos[peer] < len(q) and q[pos[peer]] == item:
                        pos[r] += 1
                        pos[peer] += 1
                        order.append(item)
                        moved = True
                        continue
                    break
                order.append((r, item))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError({r: p[pos[r]] for r, p in programs.items() if pos[r] < len(p)})
    return order


@pytest.mark.parametrize(
    "name,pp,m,v",
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 3, 2, 1),
        ("interleaved_1f1b", 2, 4, 2),
        ("interleaved_1f1b", 4, 8, 2),
        ("zbv", 2, 4, 2),
    ],
)
def test_programs_finish_and_respect_data(name, pp, m, v):
    steps, placement = build_schedule(name, pp, m, stages_per_rank=v)
    programs = blocking_program(steps, placement)
    order = _run(programs)
    seen = set()
    n = len(placement)
    for item in order:
        if isinstance(item, Message):
            assert ("made", item.kind, item.stage, item.microbatch) in seen, item
            seen.add(("got", item.kind, item.stage, item.microbatch))
            continue
        r, step = item
        for part in step.parts():
            s, i = part.stage, part.microbatch
            need = ("F", s - 1, i) if part.type is T.F and s > 0 else None
            if part.type in (T.FULL_B, T.B) and s < n - 1:
                need = ("B", s + 1, i)
            if need and placement[need[1]] != r:
                assert ("got", *need) in seen, (r, step)
            kind = "F" if part.type is T.F else ("B" if part.type in (T.FULL_B, T.B) else None)
            if kind:
                seen.add(("made", kind, s, i))
    # every compute step of the schedule is there, once
    for r, st in steps.items():
        assert [x for x in programs[r] if not isinstance(x, Message)] == [
            x for x in st if x.is_compute
        ]


def test_the_naive_order_deadlocks_under_the_same_runner():
    """Sends right after their producer, receives right before their consumer (what a
    non-blocking transport would do) hang 1F1B on 2 ranks: the runner above catches it."""
    steps, placement = build_schedule("1f1b", 2, 4)
    naive = {}
    for r, st in steps.items():
        prog = []
        for x in st:
            if x.type is T.RECV_F:
                prog.append(Message("F", x.stage - 1, x.microbatch, placement[x.stage - 1], r))
            elif x.type is T.RECV_B:
                prog.append(Message("B", x.stage + 1, x.microbatch, placement[x.stage + 1], r))
            elif x.type is T.SEND_F:
                prog.append(Message("F", x.stage, x.microbatch, r, placement[x.stage + 1]))
            elif x.type is T.SEND_B:
                prog.append(Message("B", x.stage, x.microbatch, r, placement[x.stage - 1]))
            elif x.is_compute:
                prog.append(x)
        naive[r] = prog
    with pytest.raises(RuntimeError):
        _run(naive)
