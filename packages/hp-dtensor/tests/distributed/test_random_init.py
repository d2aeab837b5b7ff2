"""The random-number guarantee and deferred initialisation (4 ranks, 1-D and 2x2 meshes)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
from hp_dtensor import Replicate, Shard
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(4)


def _random_slices():
    mesh1 = hp.init_device_mesh("cpu", (4,))
    mesh2 = hp.init_device_mesh("cpu", (2, 2))
    cases = [
        (mesh1, [Shard(0)], (9, 5)),
        (mesh1, [Shard(1)], (6, 7)),
        (mesh1, [Replicate()], (4, 3)),
        (mesh2, [Shard(0), Shard(1)], (5, 6)),
        (mesh2, [Shard(1), Shard(1)], (3, 10)),
    ]
    checked = 0
    for mesh, placements, shape in cases:
        ops = [
            ("uniform_", lambda t: t.uniform_(-2, 3)),
            ("normal_", lambda t: t.normal_(1.0, 0.5)),
            ("bernoulli_", lambda t: t.bernoulli_(0.3)),
            ("kaiming", lambda t: nn.init.kaiming_uniform_(t, a=5**0.5)),
            ("trunc_normal", lambda t: nn.init.trunc_normal_(t, std=0.02)),
        ]
        for name, op in ops:
            hp.manual_seed(1234, mesh)
            x = hp.distribute_tensor(torch.zeros(shape), mesh, placements)
            y = op(x)
            assert y is x, f"{name} did not return self"
            torch.manual_seed(1234)
            ref = op(torch.zeros(shape))
            torch.testing.assert_close(x.full_tensor(), ref, msg=f"{name} {placements}")
            checked += 1
        hp.manual_seed(7, mesh)
        x = hp.distribute_tensor(torch.zeros(shape), mesh, placements)
        r = torch.randn_like(x)
        d = F.dropout(x + 1.0, p=0.4, training=True)
        torch.manual_seed(7)
        ref_r = torch.randn_like(torch.zeros(shape))
        ref_d = F.dropout(torch.zeros(shape) + 1.0, p=0.4, training=True)
        torch.testing.assert_close(r.full_tensor(), ref_r)
        torch.testing.assert_close(d.full_tensor(), ref_d)
        checked += 2
    # replicated tensors get identical values on every rank
    hp.manual_seed(3, mesh1)
    rep = hp.distribute_tensor(torch.zeros(4, 4), mesh1, [Replicate()]).normal_()
    return checked, rep.to_local().sum().item()


def test_random_ops_give_the_slices_of_the_single_process_result(pool):
    res = pool.run(_random_slices)
    assert all(n == 35 for n, _ in res)
    assert len({s for _, s in res}) == 1


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 5, bias=False)


def _plan(mesh):
    return {
        "emb.weight": [Shard(0)],
        "fc1.weight": [Shard(0)],
        "fc1.bias": [Shard(0)],
        "norm.weight": [Replicate()],
        "norm.bias": [Replicate()],
        "fc2.weight": [Shard(1)],
    }


def _deferred_init():
    mesh = hp.init_device_mesh("cpu", (4,))
    torch.manual_seed(42)
    ref = _Model()
    with hp.init_empty_weights():
        model = _Model()
    assert all(p.device.type == "meta" for p in model.parameters())
    plan = _plan(mesh)
    for name, p in list(model.named_parameters()):
        mod_name, _, pname = name.rpartition(".")
        sub = model.get_submodule(mod_name)
        dt = hp.distribute_tensor(p.data, mesh, plan[name])
        setattr(sub, pname, nn.Parameter(dt))
    hp.manual_seed(42, mesh)
    hp.init_parameters(model)
    n = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, hp.DTensor) and p.placements == tuple(plan[name]), name
        assert p.to_local().device.type == "cpu"
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)
        n += 1
    return n


def test_deferred_init_equals_single_device_init(pool):
    assert pool.run(_deferred_init) == [6] * 4
