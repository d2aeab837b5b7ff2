"""The schedule IR, the generators and the simulator, without processes."""

import pytest

from hp_pipeline import (
    MetaStep,
    MetaStepType,
    ScheduleError,
    add_communication,
    add_unshard_reshard,
    build_schedule,
    check_schedule,
    format_grid,
    gpipe_steps,
    interleaved_1f1b_steps,
    looped_placement,
    one_f_one_b_steps,
    order_transfers,
    parse_schedule,
    simulate,
    v_placement,
    zbv_steps,
)

T = MetaStepType
NAMES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]


# -- the IR -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text", ["1F0", "2SEND_F1", "0RECV_B12", "3FULL_B7", "0B2", "1W3", "0UNSHARD", "4RESHARD"]
)
def test_steps_print_and_parse_back(text):
    step = MetaStep.parse(text)
    assert str(step) == text
    assert MetaStep.parse(str(step)) == step


def test_overlap_step_round_trips_and_names_its_parts():
    step = MetaStep.parse("1B0+0F2")
    assert step.type is T.OVERLAP_B_F and step.backward is T.B
    assert step.parts() == (MetaStep(T.B, 1, 0), MetaStep(T.F, 0, 2))
    assert str(step) == "1B0+0F2"
    assert str(MetaStep.parse("3FULL_B1+3F4")) == "3FULL_B1+3F4"


@pytest.mark.parametrize("bad", ["F0", "1X0", "1F", "1UNSHARD0", "1F0+1B2", ""])
def test_bad_step_strings_are_clear_errors(bad):
    with pytest.raises(ScheduleError):
        MetaStep.parse(bad)


def test_schedule_grid_and_parse():
    steps, _ = build_schedule("1f1b", 2, 3)
    grid = format_grid(steps)
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1"]
    assert lines[1].split() == ["0", "0F0", "1RECV_F0"]
    text = "\n".join(f"{r}: " + " ".join(map(str, s)) for r, s in steps.items())
    assert parse_schedule(text) == steps


def test_placements():
    assert looped_placement(4, 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert v_placement(3) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    with pytest.raises(ScheduleError, match="num_stages"):
        looped_placement(3, 2)


# -- generators --------------------------------------------------------------------------------
def test_1f1b_warmup_and_order():
    s = one_f_one_b_steps(4, 6)
    assert [str(x) for x in s[0][:4]] == ["0F0", "0F1", "0F2", "0F3"]
    assert [str(x) for x in s[3][:4]] == ["3F0", "3FULL_B0", "3F1", "3FULL_B1"]
    assert [str(x) for x in s[1][:5]] == ["1F0", "1F1", "1F2", "1FULL_B0", "1F3"]


def test_gpipe_all_forwards_first():
    s = gpipe_steps(2, 3)
    assert [str(x) for x in s[1]] == ["1F0", "1F1", "1F2", "1FULL_B0", "1FULL_B1", "1FULL_B2"]


def test_interleaved_rounds_and_divisibility_error():
    s = interleaved_1f1b_steps(2, 4, 2)
    # rank 0 holds stages 0 and 2; rounds of 2 microbatches per local stage
    assert [str(x) for x in s[0][:4]] == ["0F0", "0F1", "2F0", "2F1"]
    with pytest.raises(ScheduleError, match="divisible"):
        interleaved_1f1b_steps(4, 6, 2)


def test_zbv_uses_both_stages_and_splits_backward():
    s = zbv_steps(2, 4)
    stages = {x.stage for x in s[0]}
    assert stages == {0, 3}
    kinds = {x.type for x in s[0]}
    assert kinds == {T.F, T.B, T.W}


def test_communication_and_shard_steps():
    compute = one_f_one_b_steps(2, 2)
    steps = add_communication(compute, looped_placement(2, 2))
    assert [str(x) for x in steps[1][:3]] == ["1RECV_F0", "1F0", "1FULL_B0"]
    assert str(steps[1][3]) == "1SEND_B0"
    early = add_communication(compute, looped_placement(2, 2), overlap_p2p=True)
    # the next RECV goes before the current compute: 1RECV_F1 before 1FULL_B0
    assert [str(x) for x in early[1][:4]] == ["1RECV_F0", "1F0", "1RECV_F1", "1FULL_B0"]
    assert [str(x) for x in early[0][:3]] == ["0F0", "0SEND_F0", "0RECV_B0"]
    sharded = add_unshard_reshard(steps)
    assert str(sharded[0][0]) == "0UNSHARD" and str(sharded[0][-1]) == "0RESHARD"
    assert sum(x.type is T.UNSHARD for x in sharded[0]) == 1


def test_build_schedule_errors():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="n_microbatches"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ScheduleError, match="stages_per_rank"):
        build_schedule("zbv", 2, 4, stages_per_rank=3)


# -- the simulator -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32), (3, 7)])
def test_bubble_matches_the_formula(name, p, m):
    steps, placement = build_schedule(name, p, m)
    res = simulate(steps, placement, m)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_holds_fewer_activations_than_gpipe():
    for p, m in [(4, 16), (8, 32)]:
        g = simulate(*build_schedule("gpipe", p, m), m)
        o = simulate(*build_schedule("1f1b", p, m), m)
        assert g.peak_inflight[0] == m
        assert o.peak_inflight == {r: p - r for r in range(p)}


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_bubble_is_below_1f1b(p, m):
    # same total work per microbatch and rank: 1F1B stage = 2 ZBV stages
    zbv = simulate(*build_schedule("zbv", p, m), m, costs={"F": 1, "B": 1, "W": 1})
    f1b = simulate(*build_schedule("1f1b", p, m), m, costs={"F": 2, "FULL_B": 4})
    assert zbv.bubble_fraction < f1b.bubble_fraction
    assert zbv.makespan < f1b.makespan


def test_interleaving_shrinks_the_bubble():
    p, m = 4, 8
    inter = simulate(*build_schedule("interleaved_1f1b", p, m), m, costs={"F": 1, "FULL_B": 2})
    f1b = simulate(*build_schedule("1f1b", p, m), m, costs={"F": 2, "FULL_B": 4})
    assert inter.bubble_fraction < f1b.bubble_fraction


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_every_schedule_is_deadlock_free(name, overlap_p2p):
    for p in range(1, 9):
        for m in range(1, 33):
            if name == "interleaved_1f1b" and m % p:
                continue
            steps, placement = build_schedule(
                name, p, m, overlap_p2p=overlap_p2p, shard_steps=p % 2 == 0
            )
            res = simulate(steps, placement, m, comm_cost=0.25)
            assert 0 <= res.bubble_fraction < 1
            # and when a host stops until its device is idle before any compute step
            simulate(steps, placement, m, comm_cost=0.25, host_sync=True)


@pytest.mark.parametrize("name", NAMES)
def test_ordering_transfers_costs_no_time(name):
    """order_transfers only posts steps earlier (no overlap_p2p): no makespan grows."""
    for p, m in [(2, 8), (3, 9), (4, 16), (8, 32)]:
        if name == "interleaved_1f1b" and m % p:
            continue
        if name == "interleaved_1f1b":
            compute = interleaved_1f1b_steps(p, m, 2)
        else:
            gen = {"gpipe": gpipe_steps, "1f1b": one_f_one_b_steps, "zbv": zbv_steps}[name]
            compute = gen(p, m)
        placement = (
            v_placement(p)
            if name == "zbv"
            else looped_placement(p * (2 if name == "interleaved_1f1b" else 1), p)
        )
        raw = add_communication(compute, placement)
        ordered = order_transfers(raw, placement)
        for c in (0.0, 0.3):
            a = simulate(raw, placement, m, comm_cost=c).makespan
            assert simulate(ordered, placement, m, comm_cost=c).makespan <= a + 1e-9


def test_zbv_as_first_written_deadlocks_when_a_host_blocks():
    """The 8B hang: rank 0 posts its third forward (0SEND_F2), which rank 1 receives only
    after the gradient of 3B0; if rank 0's host then stops in 3F0 until its device is idle
    (an allocator sync, a kernel loaded lazily), the device waits on that send forever.
    order_transfers posts 1RECV_F2 before 2B0 instead."""
    placement = v_placement(2)
    raw = add_communication(zbv_steps(2, 8), placement)
    simulate(raw, placement, 8)  # fine while hosts never block
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(raw, placement, 8, host_sync=True)
    ordered = order_transfers(raw, placement)
    simulate(ordered, placement, 8, host_sync=True)
    row = [str(s) for s in ordered[1]]
    assert row.index("1RECV_F2") < row.index("2B0") < row.index("1F2")
    assert build_schedule("zbv", 2, 8, split_bw=True)[0] == ordered


def test_the_shape_header_read_is_a_stop():
    """ZBV, m=1, overlap_p2p: each rank reads a stage's shape header (its host stops there)
    before it posts the send the other's header read waits for; the generated order posts
    0SEND_F0 first."""
    placement = v_placement(2)
    raw = add_communication(zbv_steps(2, 1), placement, overlap_p2p=True)
    simulate(raw, placement, 1)  # posting alone never blocks
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(raw, placement, 1, host_sync=True)
    steps, _ = build_schedule("zbv", 2, 1, overlap_p2p=True, split_bw=True)
    simulate(steps, placement, 1, host_sync=True)
    row = [str(s) for s in steps[0]]
    assert row.index("0SEND_F0") < row.index("3RECV_F0")


def test_order_transfers_defers_an_early_receive_it_cannot_keep():
    # overlap_p2p posts 0RECV_B0 before 0F0; its send needs 0SEND_F0, posted after 0F0
    steps = parse_schedule(
        """
        0: 0RECV_B0 0F0 0SEND_F0 0FULL_B0
        1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0
        """
    )
    placement = looped_placement(2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(steps, placement, 1, host_sync=True)
    fixed = order_transfers(steps, placement)
    assert [str(s) for s in fixed[0]] == ["0F0", "0RECV_B0", "0SEND_F0", "0FULL_B0"]
    simulate(fixed, placement, 1, host_sync=True)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv"])
def test_fused_b_f_schedules_are_valid(name):
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        steps, placement = build_schedule(name, p, m, overlap_b_f=True, overlap_p2p=True)
        assert any(s.type is T.OVERLAP_B_F for r in steps for s in steps[r])
        simulate(steps, placement, m)
        simulate(steps, placement, m, host_sync=True)


def test_overlap_p2p_hides_transfer_time():
    p, m = 4, 8
    plain = simulate(*build_schedule("1f1b", p, m), m, comm_cost=0.5)
    early = simulate(*build_schedule("1f1b", p, m, overlap_p2p=True), m, comm_cost=0.5)
    assert early.makespan < plain.makespan


def test_deadlock_is_detected_and_named():
    # both ranks receive before they send: a cycle
    steps = parse_schedule(
        """
        0: 0F0 0SEND_F0 0RECV_B0 0FULL_B0
        1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0
        """
    )
    simulate(steps, looped_placement(2, 2), 1)  # the right order runs
    crossed = parse_schedule(
        """
        0: 0F0 0RECV_B1 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0FULL_B0 0FULL_B1
        1: 1RECV_F0 1F0 1RECV_F1 1F1 1FULL_B1 1SEND_B1 1FULL_B0 1SEND_B0
        """
    )
    # 0RECV_B1 waits on the gradient channel only; activations keep flowing
    simulate(crossed, looped_placement(2, 2), 2)
    # a gradient RECV posted first does not hold up the activation channel
    early = parse_schedule(
        """
        0: 0RECV_B0 0F0 0SEND_F0 0FULL_B0
        1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0
        """
    )
    simulate(early, looped_placement(2, 2), 1)
    cyc = parse_schedule(  # rank 0 sends F0 only after its backward, which needs rank 1's
        """
        0: 0F0 0RECV_B0 0FULL_B0 0SEND_F0
        1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0
        """
    )
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at step 1 \(0RECV_B0\)"):
        simulate(cyc, looped_placement(2, 2), 1)
    wait_first = parse_schedule(
        """
        0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0FULL_B0 0RECV_B1 0FULL_B1
        1: 1RECV_F0 1F0 1RECV_F1 1F1 1FULL_B0 1SEND_B0 1FULL_B1 1SEND_B1
        """
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(wait_first, looped_placement(2, 2), 2)


@pytest.mark.parametrize(
    "text, match",
    [
        ("0: 0F0 0FULL_B0\n1: 1F0 1FULL_B0", "runs before 0RECV_B0"),
        ("1: 1F0 1FULL_B0\n0: 0F0 0FULL_B0", "before its input"),
        ("0: 0F0 0SEND_F0 0FULL_B0\n1: 1RECV_F0 1F0 1FULL_B0", "before 0RECV_B0"),
        ("0: 0F0 0SEND_F0 0RECV_B0 0FULL_B0\n1: 1RECV_F0 1F0 1FULL_B0", "no matching"),
        ("0: 0F0 0F0 0SEND_F0 0RECV_B0 0FULL_B0\n1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0", "twice"),
        ("0: 0F0 0SEND_F0 0RECV_B0\n1: 1RECV_F0 1F0 1FULL_B0 1SEND_B0", "exactly one backward"),
        ("0: 1F0\n1: 0F0", "runs on rank"),
    ],
)
def test_invalid_schedules_are_named(text, match):
    with pytest.raises(ScheduleError, match=match):
        check_schedule(parse_schedule(text), looped_placement(2, 2), 1)


def test_timeline_events_are_consistent():
    steps, placement = build_schedule("1f1b", 2, 4)
    res = simulate(steps, placement, 4)
    compute = [e for e in res.timeline if e.kind == "compute"]
    assert len(compute) == 2 * 2 * 4
    for r in range(2):
        mine = sorted((e for e in compute if e.rank == r), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    assert res.makespan == max(e.end for e in res.timeline)
