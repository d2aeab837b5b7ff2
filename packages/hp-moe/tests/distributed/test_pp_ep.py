"""Pipeline x expert parallelism on 4 gloo ranks (PP 2 x EP 2) with 1F1B, interleaved 1F1B and
ZBV over 4 microbatches, against one process; with full activation checkpointing the routing is
replayed, tokens are counted once, and nothing of a microbatch outlives its step."""

import copy
import gc
import os
import sys

import pytest
import torch
import torch.nn as nn

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import moe_model as mm  # noqa: E402

import hp_dtensor as hp  # noqa: E402
import hp_moe  # noqa: E402
from hp_dtensor.parallel import parallelize_module  # noqa: E402
from hp_moe._balance import recomputing  # noqa: E402
from hp_pipeline import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBV,
    build_schedule,
)

pool = rank_pool_fixture(4, timeout=300)

SCHEDULES = {
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "zbv": (ScheduleZBV, 2),
}
LAYERS, MICRO, LR = 4, 4, 0.05
MOE = dict(aux_loss_coeff=0.0)  # the expert bias stays on: its counts must be counted once


class Stage(nn.Module):
    """Layers ``[lo, hi)`` of a TinyMoE (copies); the first stage embeds, the last projects."""

    def __init__(self, full: mm.TinyMoE, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.tok = copy.deepcopy(full.tok_embeddings) if first else None
        self.layers = nn.ModuleList(copy.deepcopy(full.layers[i]) for i in range(lo, hi))
        self.norm = copy.deepcopy(full.norm) if last else None
        self.out = copy.deepcopy(full.output) if last else None
        self.names = {}
        for n, _ in self.named_parameters():
            if n.startswith("layers."):
                i, rest = n.split(".", 2)[1:]
                self.names[n] = f"layers.{lo + int(i)}.{rest}"
            else:
                self.names[n] = {
                    "tok.weight": "tok_embeddings.weight",
                    "out.weight": "output.weight",
                }.get(n, n)

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x)) if self.out is not None else x


class _Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _live(kind):
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, kind))


def _sync(mods, group, ep):
    """Data parallelism over the pipelines by hand: dense gradients averaged over the ``ep``
    ranks of a stage (each pipeline saw other tokens), expert gradients (already summed over
    their tokens) divided by ``ep``."""
    platform = hp.get_platform("cpu")
    for mod in mods.values():
        for n, p in mod.named_parameters():
            g = mm.local(p.grad)
            if not mm.is_expert(n):
                platform.all_reduce(g, "sum", group)
            g.div_(ep)


def _pp_ep(name, checkpointed, steps, overlap_b_f=False):
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp_rank, ep_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    cls, v = SCHEDULES[name]
    n_stages = 2 * v
    per = LAYERS // n_stages
    placement = build_schedule(name, 2, MICRO)[1]
    mine = [s for s in range(n_stages) if placement[s] == pp_rank]
    full, ref = mm.build(n_layers=LAYERS, **MOE), mm.build(n_layers=LAYERS, **MOE)
    mods, local_moes, routes = {}, [], []
    for s in mine:
        mod = Stage(full, s * per, (s + 1) * per, s == 0, s == n_stages - 1)
        for i, layer in enumerate(mod.layers):
            parallelize_module(layer.moe, mesh["ep"], {"experts": hp_moe.ExpertParallel()})
            layer.moe.router.register_forward_hook(
                lambda m, a, o: routes.append((recomputing(), o[1].clone()))
            )
            local_moes.append((s * per + i, layer.moe))
        if checkpointed:
            mod.layers = nn.ModuleList(_Checkpointed(b) for b in mod.layers)
        mods[s] = mod
    names = {
        (s, n): mods[s].names[n.replace(".block.", ".")]
        for s in mine
        for n, _ in mods[s].named_parameters()
    }
    stages = [PipelineStage(mods[s], s, n_stages, group=mesh.get_group("pp")) for s in mine]
    sched = cls(stages if v > 1 else stages[0], MICRO, loss_fn=mm.loss_fn, overlap_b_f=overlap_b_f)
    opt = torch.optim.SGD([p for m in mods.values() for p in m.parameters()], lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    group = mesh.get_group("ep")  # a stage's ranks see different tokens (two pipelines)
    platform = hp.get_platform("cpu")
    live, all_losses = [], []
    for step in range(steps):
        tokens, targets = mm.batch(step, 4)  # 4 rows per pipeline: one per microbatch
        rows = slice(ep_rank * 2 * mm.B, (ep_rank + 1) * 2 * mm.B)
        ref_opt.zero_grad()
        mm.loss_fn(ref(tokens), targets).backward()
        opt.zero_grad()
        routes.clear()
        losses = []
        args = (tokens[rows],) if 0 in mods else ()
        kw = {"target": targets[rows], "losses": losses} if n_stages - 1 in mods else {}
        sched.step(*args, **kw)
        all_losses.append([float(x) for x in losses])
        first = [r for again, r in routes if not again]
        again = [r for again, r in routes if again]
        assert len(first) == len(local_moes) * MICRO, (len(first), len(again), step)
        if checkpointed:  # every router ran again (ZBV: for B and for W), same experts
            assert len(again) >= len(first), (len(again), len(first))
            for r in again:
                assert any(r.shape == f.shape and torch.equal(r, f) for f in first), "rerouted"
        else:
            assert not again
        _sync(mods, group, ep=2)
        for s in mine:
            for n, p in mods[s].named_parameters():
                torch.testing.assert_close(
                    mm.full(p.grad),
                    ref_params[names[s, n]].grad,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=f"{name} grad {names[s, n]} step {step}",
                )
        # tokens counted once per microbatch, however often the forward ran
        for idx, moe in local_moes:
            counts = moe.tokens_per_expert.clone()
            platform.all_reduce(counts, "sum", group)
            torch.testing.assert_close(counts, ref.layers[idx].moe.tokens_per_expert)
        hp_moe.update_expert_bias(nn.ModuleList(m for _, m in local_moes), group=group)
        hp_moe.update_expert_bias(ref)
        for idx, moe in local_moes:
            torch.testing.assert_close(moe.expert_bias, ref.layers[idx].moe.expert_bias)
        opt.step()
        ref_opt.step()
        if step in (min(4, steps - 1), steps - 1):
            live.append((_live(hp_moe.DispatchContext), _live(torch.Tensor)))
    return all_losses, live


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_pp2_x_ep2_equals_one_device(pool, name):
    res = pool.run(_pp_ep, name, False, 3)
    assert all(live[-1][0] == 0 for _, live in res)  # no DispatchContext outlives a step


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_pp2_x_ep2_with_overlapped_backward_and_forward(pool, name):
    """overlap_b_f fuses one microbatch's backward with another's forward (their all-to-alls
    in one step): every expert-parallel rank runs the same fused order."""
    res = pool.run(_pp_ep, name, False, 3, True)
    assert all(live[-1][0] == 0 for _, live in res)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_pp2_x_ep2_under_activation_checkpointing(pool, name):
    steps = 20
    for _, live in pool.run(_pp_ep, name, True, steps):
        (ctx5, tensors5), (ctx_end, tensors_end) = live
        assert ctx5 == ctx_end == 0
        assert tensors_end <= tensors5, f"tensors alive grew from {tensors5} to {tensors_end}"
