import math

import pytest
import torch

from hp_optim import (
    AdamW,
    ChainedOptimizer,
    LRScheduleConfig,
    OptimError,
    clip_grad_norm_,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    lr_factor,
)


def test_lr_tables():
    cos = LRScheduleConfig(warmup_steps=2, total_steps=6, decay_style="cosine", min_lr_ratio=0.1)
    got = [round(lr_factor(s, cos), 6) for s in range(8)]
    want = (
        [0.5, 1.0]
        + [round(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 4)), 6) for t in range(4)]
        + [0.1, 0.1]
    )
    assert got == want
    lin = LRScheduleConfig(warmup_steps=0, total_steps=4, decay_style="linear")
    assert [lr_factor(s, lin) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = LRScheduleConfig(warmup_steps=1, total_steps=3, decay_style="constant")
    assert [lr_factor(s, const) for s in range(4)] == [1.0, 1.0, 1.0, 1.0]
    wsd = LRScheduleConfig(warmup_steps=1, total_steps=6, decay_style="wsd", decay_steps=2)
    assert [lr_factor(s, wsd) for s in range(7)] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0]


def test_scheduler_drives_every_group_of_a_chain():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    chain = ChainedOptimizer([AdamW([a], lr=1.0), torch.optim.SGD([b], lr=0.5)])
    sched = get_hyper_lr_scheduler(
        chain, {"warmup_steps": 2, "total_steps": 4, "decay_style": "linear"}
    )
    seen = [sched.get_last_lr()]
    for _ in range(3):
        chain.step()
        sched.step()
        seen.append(sched.get_last_lr())
    assert seen == [[0.5, 0.25], [1.0, 0.5], [1.0, 0.5], [0.5, 0.25]]


def test_chained_equals_separate_optimizers():
    torch.manual_seed(0)
    w1, w2 = torch.randn(4, 3), torch.randn(5)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    q1, q2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    chain = ChainedOptimizer([AdamW([p1], lr=0.1), torch.optim.SGD([p2], lr=0.1, momentum=0.9)])
    sep = [AdamW([q1], lr=0.1), torch.optim.SGD([q2], lr=0.1, momentum=0.9)]
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        gs = torch.randn(4, 3, generator=g), torch.randn(5, generator=g)
        for x, y in ((p1, p2), (q1, q2)):
            x.grad, y.grad = gs[0].clone(), gs[1].clone()
        chain.step()
        for o in sep:
            o.step()
    assert torch.equal(p1, q1) and torch.equal(p2, q2)
    state = chain.state_dict()
    chain.load_state_dict(state)
    assert len(state["optimizers"]) == 2


def test_factory_groups_by_name_and_ndim():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = get_hyper_optimizer(
        model, {"lr": 1e-3, "weight_decay": 0.1, "groups": [{"ndim": 1, "weight_decay": 0.0}]}
    )
    wd = sorted((len(g["params"]), g["weight_decay"]) for g in opt.param_groups)
    assert wd == [(1, 0.1), (3, 0.0)]


def test_errors():
    with pytest.raises(OptimError, match="unknown keys \\['warmup'\\]"):
        get_hyper_lr_scheduler(AdamW([torch.nn.Parameter(torch.ones(1))]), {"warmup": 3})
    with pytest.raises(OptimError, match="max_norm=0"):
        clip_grad_norm_([torch.nn.Parameter(torch.ones(1))], 0)
    with pytest.raises(OptimError, match="decay_style"):
        LRScheduleConfig(decay_style="step")
    with pytest.raises(OptimError, match="unknown keys"):
        get_hyper_optimizer(torch.nn.Linear(2, 2), {"learning_rate": 1})


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_plain_tensors_like_torch(norm_type):
    torch.manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        p.grad = torch.randn(3, 4)
        q.grad = p.grad.clone()
    a = clip_grad_norm_(ps, 0.5, norm_type)
    b = torch.nn.utils.clip_grad_norm_(qs, 0.5, norm_type)
    torch.testing.assert_close(a, b)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.grad, q.grad)


def test_muon_rejects_non_matrices_and_orthogonalizes():
    from hp_optim import Muon, zeropower_via_newtonschulz5

    with pytest.raises(OptimError, match="1-D parameter"):
        Muon([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(OptimError, match="adjust_lr"):
        Muon([torch.nn.Parameter(torch.ones(3, 3))], adjust_lr="huge")
    x = zeropower_via_newtonschulz5(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
    s = torch.linalg.svdvals(x)
    assert x.shape == (8, 4) and bool(((s > 0.5) & (s < 1.5)).all())


def test_factory_builds_muon_and_adamw_chain():
    from hp_optim import Muon

    model = torch.nn.Sequential(
        torch.nn.Embedding(5, 4),
        torch.nn.Linear(4, 4),
        torch.nn.LayerNorm(4),
        torch.nn.Linear(4, 5),
    )
    cfg = {
        "optimizer": "muon",
        "lr": 0.02,
        "groups": [
            {"match": ["0.*", "3.*"], "optimizer": "adamw", "lr": 1e-3},
            {"ndim": 1, "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        ],
    }
    opt = get_hyper_optimizer(model, cfg)
    assert isinstance(opt, ChainedOptimizer) and isinstance(opt.optimizers[0], Muon)
    muon_params = opt.optimizers[0].param_groups[0]["params"]
    assert [tuple(p.shape) for p in muon_params] == [(4, 4)]
    with pytest.raises(OptimError, match="1-D parameter"):
        get_hyper_optimizer(
            model,
            {"optimizer": "muon", "groups": [{"match": ["0.*", "3.*"], "optimizer": "adamw"}]},
        )
    with pytest.raises(OptimError, match="unknown keys"):
        get_hyper_optimizer(model, {"groups": [{"match": ["*"], "learning_rate": 1}]})
