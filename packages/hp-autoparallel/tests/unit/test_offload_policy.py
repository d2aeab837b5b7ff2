"""hp_autoparallel.offload_policy / simulate: the timelines against hand-computed cases, the
search against exhaustive search, its plan against hp-trainer's parser, and its errors."""

from __future__ import annotations

import itertools
import random

import pytest

from hp_autoparallel import ACTIONS, LayerCost, OffloadPolicy, PlanError, offload_policy, simulate

MIB = 1 << 20


def _layer(**kw):
    base = dict(
        saved_bytes=100 * MIB,
        input_bytes=4 * MIB,
        forward_s=1e-3,
        backward_s=2e-3,
        grad_bytes=10 * MIB,
        backward_extra_bytes=2 * MIB,
    )
    base.update(kw)
    return LayerCost(**base)


def test_keep_all_peak_and_time_by_hand():
    layers = [_layer()] * 3
    peak, extra = simulate(layers, ["keep"] * 3, d2h_bytes_per_s=1e9, other_bytes=MIB)
    # backward of the last layer: everything saved, its gradient and its temporaries
    assert peak == MIB + 300 * MIB + 10 * MIB + 2 * MIB
    assert extra == 0.0


def test_head_bytes_count_beside_every_held_layer():
    layers = [_layer()] * 3
    peak, _ = simulate(layers, ["keep"] * 3, d2h_bytes_per_s=1e9, head_bytes=50 * MIB)
    assert peak == 300 * MIB + 50 * MIB


def test_recompute_all_by_hand():
    layers = [_layer()] * 3
    peak, extra = simulate(layers, ["recompute"] * 3, d2h_bytes_per_s=1e9)
    assert extra == pytest.approx(3e-3)  # each forward once more
    # layer 0's backward: the other inputs are freed, the gradients of all three are made,
    # layer 0 holds its input and its recomputed set
    at_first = 3 * 10 * MIB + 4 * MIB + 100 * MIB + 2 * MIB
    at_last = 2 * 4 * MIB + 4 * MIB + 10 * MIB + 100 * MIB + 2 * MIB
    assert peak == max(at_first, at_last)


def test_swap_hides_on_a_fast_link_and_shows_on_a_slow_one():
    layers = [_layer(grad_bytes=0, backward_extra_bytes=0)] * 4
    acts = ["swap", "keep", "keep", "keep"]
    fast_peak, fast_extra = simulate(layers, acts, d2h_bytes_per_s=1e15)
    assert fast_extra == pytest.approx(0.0, abs=1e-6)
    # layer 3's backward: layers 1-3 held, and layer 0's device copy too: its transfer is
    # done, but SwapManager frees it only when it next looks (no swapped layer until layer
    # 0's own backward)
    assert fast_peak == 300 * MIB + 100 * MIB
    # 100 MiB at 10 MB/s: ~10.5 s out, after layer 0's 1 ms forward; backward waits for the
    # copy out (due at ~10.49 s) and then the copy back (another ~10.49 s)
    slow = 100 * MIB / 1e7
    _, extra = simulate(layers, acts, d2h_bytes_per_s=1e7)
    t_needed = 1e-3 + slow + slow  # when layer 0's tensors are back
    t_reached = 4e-3 + 3 * 2e-3  # when backward would reach layer 0 without swap
    assert extra == pytest.approx(t_needed - t_reached)


def test_a_done_copy_is_freed_at_the_next_swapped_layer():
    layers = [_layer(grad_bytes=0, backward_extra_bytes=0)] * 4
    peak, _ = simulate(layers, ["swap", "keep", "swap", "keep"], d2h_bytes_per_s=1e15)
    # layer 2's forward frees layer 0's device copy; layer 2's own stays until backward
    # reaches layer 2 (layers 1 and 3 held, layer 2's copy not yet freed)
    assert peak == 300 * MIB


def test_inflight_cap_stalls_the_forward():
    layers = [_layer(saved_bytes=100 * MIB)] * 3
    acts = ["swap"] * 3
    _, free = simulate(layers, acts, d2h_bytes_per_s=1e9, max_inflight_bytes=None)
    _, capped = simulate(layers, acts, d2h_bytes_per_s=1e9, max_inflight_bytes=50 * MIB)
    assert capped > free


def test_swap_overhead_counts_per_swapped_layer():
    layers = [_layer()] * 4
    acts = ["swap", "keep", "swap", "keep"]
    _, a = simulate(layers, acts, d2h_bytes_per_s=1e15)
    _, b = simulate(layers, acts, d2h_bytes_per_s=1e15, swap_overhead_s=1e-3)
    assert b - a == pytest.approx(2e-3)


def _random_case(rng, n):
    layers = [
        LayerCost(
            saved_bytes=rng.randint(50, 400) * MIB,
            input_bytes=rng.randint(1, 20) * MIB,
            forward_s=rng.uniform(0.5e-3, 3e-3),
            backward_s=rng.uniform(1e-3, 6e-3),
            grad_bytes=rng.randint(0, 100) * MIB,
            backward_extra_bytes=rng.randint(0, 40) * MIB,
        )
        for _ in range(n)
    ]
    kw = dict(
        d2h_bytes_per_s=rng.uniform(20e9, 80e9),
        other_bytes=rng.randint(0, 300) * MIB,
        head_bytes=rng.randint(0, 900) * MIB,
        head_s=rng.uniform(0, 5e-3),
        swap_overhead_s=rng.uniform(0, 1e-3),
    )
    return layers, kw


@pytest.mark.parametrize("seed", range(12))
def test_search_against_exhaustive(seed):
    """On 5 layers (243 action lists), for budgets across the range: the policy fits, and is
    within 1% of a step of the fastest list that fits (a local search; it equals it in all 48
    today); below the least peak of all it refuses."""
    rng = random.Random(seed)
    layers, kw = _random_case(rng, 5)
    every = {acts: simulate(layers, acts, **kw) for acts in itertools.product(ACTIONS, repeat=5)}
    lo = min(p for p, _ in every.values())
    hi = max(p for p, _ in every.values())
    for frac in (0.0, 0.3, 0.6, 1.0):
        budget = int(lo + frac * (hi - lo))
        pol = offload_policy(layers, budget, **kw)
        assert isinstance(pol, OffloadPolicy)
        assert (pol.peak_bytes, pol.extra_s) == pytest.approx(simulate(layers, pol.actions, **kw))
        assert pol.peak_bytes <= budget
        best = min(e for p, e in every.values() if p <= budget)
        total = sum(c.forward_s + c.backward_s for c in layers)
        assert pol.extra_s <= best + 0.01 * total, (pol, best)
    with pytest.raises(PlanError, match="the least it found"):
        offload_policy(layers, lo - 1, **kw)


def test_beats_every_uniform_mode_that_fits():
    rng = random.Random(7)
    layers, kw = _random_case(rng, 16)
    uniform = {a: simulate(layers, [a] * 16, **kw) for a in ACTIONS}
    keep_peak = uniform["keep"][0]
    for frac in (0.4, 0.6, 0.8):
        budget = int(frac * keep_peak)
        pol = offload_policy(layers, budget, **kw)
        assert pol.peak_bytes <= budget
        for peak, extra in uniform.values():
            if peak <= budget:
                assert pol.extra_s <= extra + 1e-12


def test_enough_memory_keeps_everything():
    layers = [_layer()] * 6
    pol = offload_policy(layers, 10 << 30, d2h_bytes_per_s=50e9)
    assert pol.actions == ("keep",) * 6 and pol.extra_s == 0.0


def test_allow_restricts_the_actions():
    layers = [_layer()] * 6
    need, _ = simulate(layers, ["keep"] * 6, d2h_bytes_per_s=50e9)
    pol = offload_policy(layers, need // 2, d2h_bytes_per_s=50e9, allow=("keep", "recompute"))
    assert "swap" not in pol.actions and "recompute" in pol.actions


def test_trainer_plan_is_what_hp_trainer_parses():
    from hp_trainer.config import parse_activation_plan

    pol = OffloadPolicy(("swap", "swap", "keep", "recompute", "recompute", "keep"), 0, 0.0)
    text = pol.trainer_plan()
    assert text == "layers.0-1=swap,layers.2=none,layers.3-4=full,layers.5=none"
    assert parse_activation_plan(text) == {
        "layers.0-1": "swap",
        "layers.2": "none",
        "layers.3-4": "full",
        "layers.5": "none",
    }
    assert pol.counts() == {"keep": 2, "recompute": 2, "swap": 2}


def test_budget_too_small_names_the_least():
    layers = [_layer()] * 4
    with pytest.raises(PlanError, match=r"budget_bytes=1 .*the least it found is \d+ bytes"):
        offload_policy(layers, 1, d2h_bytes_per_s=50e9)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: offload_policy([], 10, d2h_bytes_per_s=1e9), "layers is empty"),
        (lambda: offload_policy([_layer()], 1.5, d2h_bytes_per_s=1e9), "budget_bytes=1.5"),
        (lambda: offload_policy([1], 10, d2h_bytes_per_s=1e9), "LayerCost objects"),
        (lambda: offload_policy([_layer()], 10, d2h_bytes_per_s=0), "d2h_bytes_per_s=0"),
        (lambda: offload_policy([_layer()], 10**12, d2h_bytes_per_s=1e9, allow=("x",)), "allow"),
        (lambda: simulate([_layer()], ["keep", "keep"], d2h_bytes_per_s=1e9), "2 actions"),
        (lambda: simulate([_layer()], ["drop"], d2h_bytes_per_s=1e9), "action 'drop'"),
        (lambda: _layer(saved_bytes=-1), "saved_bytes=-1"),
        (lambda: _layer(forward_s="1"), "forward_s='1'"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(PlanError, match=match):
        call()
