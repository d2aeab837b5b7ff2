"""Checkpoint and swap inside fully_shard and inside pipeline stages (2 gloo ranks): gradients and
losses bitwise equal to the same parallel run without offload."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hp_dtensor as hp
from hp_fsdp import fully_shard
from hp_offload import CheckpointPolicy, OffloadPlan, SwapManager, apply_offload_plan
from hp_testing.models import LlamaStage, TinyLlama
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2)

PLANS = {
    "plain": None,
    "checkpoint": {"layers.*": "checkpoint"},
    "selective": {"layers.*": CheckpointPolicy(mode="selective")},
    "swap": {"layers.*": "swap"},
    "mixed": {"layers.0": "swap", "layers.1-3": "checkpoint"},
}


def _model(layers):
    torch.manual_seed(0)
    return TinyLlama(vocab=37, dim=16, layers=layers, heads=4, kv_heads=2, hidden=24, seq=8)


def _data(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 37, (4, 8), generator=g), torch.randint(0, 37, (4, 8), generator=g)


def _name(n):
    return n.replace("_checkpoint_wrapped_module.", "").replace("_swap_wrapped_module.", "")


def _fsdp(plan):
    torch.use_deterministic_algorithms(True)
    mesh = hp.init_device_mesh("cpu", (2,))
    model = _model(4)
    mgr = SwapManager()
    if PLANS[plan]:
        apply_offload_plan(model, OffloadPlan(PLANS[plan]), manager=mgr)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(2):
        x, y = _data(step)
        x, y = x.chunk(2)[dist.get_rank()], y.chunk(2)[dist.get_rank()]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads = {_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        stats = mgr.step()
        out.append((loss.detach(), grads, stats.bytes_out))
    return out


@pytest.mark.parametrize("plan", ["checkpoint", "selective", "swap", "mixed"])
def test_inside_fully_shard(pool, plan):
    plain = pool.run(_fsdp, "plain")
    got = pool.run(_fsdp, plan)
    for rank_plain, rank_got in zip(plain, got):
        for (l0, g0, _), (l1, g1, swapped) in zip(rank_plain, rank_got):
            assert torch.equal(l0, l1)
            assert g0.keys() == g1.keys()
            for n in g0:
                assert torch.equal(g0[n], g1[n]), n
            assert (swapped > 0) == (plan in ("swap", "mixed"))


def _pipeline(schedule, plan):
    from hp_pipeline import PipelineStage, Schedule1F1B, ScheduleZBV, build_schedule

    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    v = 2 if schedule == "zbv" else 1
    n = 2 * v
    placement = build_schedule(schedule, 2, 4)[1]
    mine = [s for s in range(n) if placement[s] == rank]
    full = _model(2 * n)
    mgr = SwapManager()
    mods = {}
    for s in mine:
        mods[s] = LlamaStage(full, 2 * s, 2 * s + 2, s == 0, s == n - 1)
        if PLANS[plan]:
            rules = {k.replace("layers.1-3", "layers.1"): a for k, a in PLANS[plan].items()}
            apply_offload_plan(mods[s], OffloadPlan(rules), manager=mgr)
    stages = [PipelineStage(mods[s], s, n) for s in mine]
    cls = ScheduleZBV if schedule == "zbv" else Schedule1F1B

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    sched = cls(stages if v > 1 else stages[0], 4, loss_fn=loss_fn)
    out = []
    for step in range(2):
        x, y = _data(step)
        losses = []
        sched.step(
            *((x,) if 0 in mine else ()),
            **({"target": y, "losses": losses} if n - 1 in mine else {}),
        )
        grads = {
            f"{s}.{_name(k)}": p.grad.clone() for s in mine for k, p in mods[s].named_parameters()
        }
        for mod in mods.values():
            mod.zero_grad()
        out.append(([float(v) for v in losses], grads, mgr.step().bytes_out))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("plan", ["checkpoint", "swap", "mixed"])
def test_inside_pipeline_stages(pool, schedule, plan):
    plain = pool.run(_pipeline, schedule, "plain")
    got = pool.run(_pipeline, schedule, plan)
    for rank_plain, rank_got in zip(plain, got):
        for (l0, g0, _), (l1, g1, swapped) in zip(rank_plain, rank_got):
            assert l0 == l1
            assert g0.keys() == g1.keys()
            for k in g0:
                assert torch.equal(g0[k], g1[k]), k
            assert (swapped > 0) == (plan in ("swap", "mixed"))
