"""Unit tests for hp_pipeline._balance: the planner against brute force, errors, profiling."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from hp_pipeline._balance import (
    BalanceError,
    LayerProfile,
    StagePlan,
    balance_stages,
    plan_from_profile,
    profile_layers,
)


def _all_splits(n: int, s: int):
    """Every split of n layers into s non-empty contiguous stages, as boundaries."""
    for cuts in itertools.combinations(range(1, n), s - 1):
        edges = (0, *cuts, n)
        yield tuple(zip(edges[:-1], edges[1:]))


def _brute(costs, memory, s, limit=None, act=None, inflight=None):
    """Best plan by enumeration, with the documented tie rule (latest later-stage starts)."""
    held = inflight if inflight is not None else [s - k for k in range(s)]
    best = None
    for bounds in _all_splits(len(costs), s):
        sc = [sum(costs[i:j]) for i, j in bounds]
        sm = [
            sum(memory[i:j]) + (held[k] * sum(act[i:j]) if act is not None else 0)
            for k, (i, j) in enumerate(bounds)
        ]
        if limit is not None and max(sm) > limit:
            continue
        key = (max(sc), tuple(-i for i, _ in reversed(bounds)))
        if best is None or key < best[0]:
            best = (key, bounds, sc, sm)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force_integer_ties(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    s = rng.randint(1, min(4, n))
    costs = [rng.randint(0, 5) for _ in range(n)]
    memory = [rng.randint(0, 6) for _ in range(n)]
    act = [rng.randint(0, 3) for _ in range(n)] if seed % 2 else None
    inflight = [rng.randint(0, 4) for _ in range(s)] if (act and seed % 4 == 1) else None
    limit = None
    if seed % 3:
        # a limit between the smallest achievable peak memory and the unconstrained peak
        free = _brute(costs, memory, s, None, act, inflight)
        lo = min(
            max(
                sum(memory[i:j])
                + ((inflight or [s - k for k in range(s)])[k] * sum(act[i:j]) if act else 0)
                for k, (i, j) in enumerate(b)
            )
            for b in _all_splits(n, s)
        )
        limit = rng.randint(lo, max(lo, max(free[3])))
    want = _brute(costs, memory, s, limit, act, inflight)
    plan = balance_stages(
        costs, memory, s, memory_limit=limit, activation_memory=act, inflight=inflight
    )
    assert plan.boundaries == want[1]
    assert list(plan.stage_costs) == want[2]
    assert list(plan.stage_memory) == want[3]
    assert plan.bottleneck == max(want[2])
    if limit is not None:
        assert max(plan.stage_memory) <= limit


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force_float_costs(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 9)
    s = rng.randint(1, min(4, n))
    costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
    memory = [rng.uniform(0.0, 2.0) for _ in range(n)]
    act = [rng.uniform(0.0, 1.0) for _ in range(n)]
    limit = rng.uniform(2.0, 8.0)
    want = _brute(costs, memory, s, limit, act)
    if want is None:
        with pytest.raises(BalanceError, match="memory_limit"):
            balance_stages(costs, memory, s, memory_limit=limit, activation_memory=act)
        return
    plan = balance_stages(costs, memory, s, memory_limit=limit, activation_memory=act)
    assert plan.bottleneck == pytest.approx(want[0][0], rel=1e-12)
    assert max(plan.stage_memory) <= limit


def test_memory_limit_binds():
    costs = [2, 2, 2, 2, 2, 2]
    memory = [3, 3, 1, 1, 1, 1]
    free = balance_stages(costs, memory, 2)
    assert free.boundaries == ((0, 3), (3, 6))
    assert free.bottleneck == 6 and max(free.stage_memory) == 7  # violates the limit below
    tight = balance_stages(costs, memory, 2, memory_limit=6)
    assert tight.boundaries == ((0, 2), (2, 6))
    assert tight.stage_memory == (6, 4)
    assert tight.bottleneck == 8


def test_activation_memory_uses_inflight_default():
    # Stage 0 holds 2 microbatches under 1F1B with 2 stages, stage 1 holds 1.
    plan = balance_stages([1, 1], [0, 0], 2, activation_memory=[3, 5])
    assert plan.stage_memory == (6, 5)
    plan = balance_stages([1, 1], [0, 0], 2, activation_memory=[3, 5], inflight=[1, 4])
    assert plan.stage_memory == (3, 20)


def test_tie_rule_prefers_later_stages_short():
    plan = balance_stages([1, 0, 0, 1], [0] * 4, 2)
    assert plan.boundaries == ((0, 3), (3, 4))
    assert plan.stage_costs == (1.0, 1.0)


def test_plan_accessors():
    plan = balance_stages([1, 2, 3, 4], [1, 1, 1, 1], 2)
    assert plan.boundaries == ((0, 3), (3, 4))
    assert list(plan.layers(0)) == [0, 1, 2] and list(plan.layers(1)) == [3]
    assert plan.num_stages == 2 and plan.num_layers == 4
    with pytest.raises(BalanceError, match="stage"):
        plan.layers(2)
    with pytest.raises(BalanceError, match="boundaries"):
        StagePlan(((0, 2), (3, 4)), (1.0, 1.0), (0, 0))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"layer_memory": [1, 1]}, "layer_memory"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": 4}, "num_stages"),
        ({"num_stages": 1.5}, "num_stages"),
        ({"layer_costs": [1, -1, 1]}, "layer_costs"),
        ({"layer_costs": [1, float("nan"), 1]}, "layer_costs"),
        ({"layer_memory": [1, -2, 1]}, "layer_memory"),
        ({"activation_memory": [1, 1]}, "activation_memory"),
        ({"activation_memory": [1, -1, 1]}, "activation_memory"),
        ({"activation_memory": [1, 1, 1], "inflight": [1]}, "inflight"),
        ({"activation_memory": [1, 1, 1], "inflight": [1, -1]}, "inflight"),
        ({"inflight": [1, 1]}, "inflight"),
        ({"memory_limit": "big"}, "memory_limit"),
    ],
)
def test_errors_name_the_argument(kwargs, needle):
    args = {"layer_costs": [1, 2, 3], "layer_memory": [1, 1, 1], "num_stages": 2}
    args.update(kwargs)
    with pytest.raises(BalanceError, match=needle):
        balance_stages(
            args.pop("layer_costs"), args.pop("layer_memory"), args.pop("num_stages"), **args
        )


def test_infeasible_reports_smallest_limit():
    with pytest.raises(BalanceError, match=r"memory_limit=5.*smallest memory_limit that fits is 6"):
        balance_stages([1, 1, 1], [4, 3, 3], 2, memory_limit=5)
    # and that limit indeed works
    assert max(balance_stages([1, 1, 1], [4, 3, 3], 2, memory_limit=6).stage_memory) == 6
    assert issubclass(BalanceError, ValueError)


# -- profiling -----------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, width)
        self.down = nn.Linear(width, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.layers = nn.ModuleList([_Block(64, 32), _Block(64, 1024), _Block(64, 128)])
        self.head = nn.Linear(64, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def tiny_profiles():
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 50, (8, 64))
    model.head.weight.grad = torch.ones_like(model.head.weight)
    profiles = profile_layers(model, ids, repeats=5, warmup=1)
    return model, profiles


def test_profile_layers_names_and_sizes(tiny_profiles):
    model, profiles = tiny_profiles
    assert [p.name for p in profiles] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    modules = [model.embed, *model.layers, model.head]
    for p, m in zip(profiles, modules):
        assert isinstance(p, LayerProfile)
        assert p.param_bytes == sum(q.numel() * q.element_size() for q in m.parameters())
        assert p.time_s > 0
    # grads present before profiling are put back, absent ones stay absent
    assert torch.equal(model.head.weight.grad, torch.ones_like(model.head.weight))
    assert model.embed.weight.grad is None


def test_profile_layers_widest_block_dominates(tiny_profiles):
    _, profiles = tiny_profiles
    widest = profiles[2]
    assert widest.param_bytes == max(p.param_bytes for p in profiles)
    assert widest.time_s == max(p.time_s for p in profiles)
    for p in profiles[1:4]:
        assert p.activation_bytes > 0
    # the wide block keeps its 1024-wide hidden activations: at least 8*64*1024 floats
    assert widest.activation_bytes >= 8 * 64 * 1024 * 4


def test_plan_from_profile(tiny_profiles):
    _, profiles = tiny_profiles
    plan = plan_from_profile(profiles, 2)
    assert plan.num_layers == len(profiles)
    assert plan.bottleneck == pytest.approx(max(plan.stage_costs))
    with pytest.raises(BalanceError, match="memory_limit"):
        plan_from_profile(profiles, 2, memory_limit=1)
    with pytest.raises(BalanceError, match="profiles"):
        plan_from_profile([], 2)


def test_profile_layers_explicit_layers_and_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    profiles = profile_layers(model, x, layers=[("a", model[0]), ("b", model[2])], repeats=1)
    assert [p.name for p in profiles] == ["a", "b"]
    assert profiles[0].param_bytes == (16 + 4) * 4
    with pytest.raises(BalanceError, match="repeats"):
        profile_layers(model, x, repeats=0)
    with pytest.raises(BalanceError, match="warmup"):
        profile_layers(model, x, warmup=-1)
    with pytest.raises(BalanceError, match="layers"):
        profile_layers(model, x, layers=[("a", nn.Linear(4, 4))], repeats=1)
    with pytest.raises(BalanceError, match="layers"):
        profile_layers(model, x, layers=[("a", model[0]), ("a", model[2])], repeats=1)
    with pytest.raises(BalanceError, match="layers"):
        profile_layers(model, x, layers=[("a", "not a module")], repeats=1)
    with pytest.raises(BalanceError, match="layers="):
        profile_layers(nn.Linear(4, 4), x, repeats=1)
    with pytest.raises(BalanceError, match="loss_fn"):
        profile_layers(nn.Sequential(nn.Flatten()), x, repeats=1)  # no output needs grad


def test_profile_layers_input_forms_and_loss_fn():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 3)

        def forward(self, x, scale=1.0):
            return {"out": self.b(self.a(x)) * scale}

    model = Two()
    x = torch.randn(2, 4, requires_grad=True)
    seen = []

    def loss_fn(out):
        seen.append(out["out"].shape)
        return out["out"].pow(2).mean()

    by_tuple = profile_layers(model, (x, 2.0), repeats=2, warmup=0, loss_fn=loss_fn)
    by_dict = profile_layers(model, {"x": x}, repeats=1, warmup=0)
    assert [p.name for p in by_tuple] == [p.name for p in by_dict] == ["a", "b"]
    assert seen == [torch.Size([2, 3])] * 2
    # the hooks put on the (leaf) input are gone again, and its grad is left untouched
    assert not x._backward_hooks
    assert x.grad is None
