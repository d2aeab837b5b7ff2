"""AdamW and clip_grad_norm_ on FSDP-, TP- and FSDP x TP-sharded models (4 ranks) against one
process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
import hp_dtensor.parallel as hpp
from hp_fsdp import fully_shard
from hp_optim import AdamW, clip_grad_norm_
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(4)
pool2 = rank_pool_fixture(2)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 8)
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        return self.head(self.fc2(F.gelu(self.fc1(self.emb(ids)))))


def _setup(mode):
    torch.manual_seed(0)
    ref, model = MLP(), MLP()
    model.load_state_dict(ref.state_dict())
    dp_rank, dp = dist.get_rank(), dist.get_world_size()
    if mode == "fsdp":
        fully_shard(model, mesh=hp.init_device_mesh("cpu", (dp,)))
    elif mode == "tp":
        mesh = hp.init_device_mesh("cpu", (4,))
        plan = {"fc1": hpp.ColwiseParallel(), "fc2": hpp.RowwiseParallel(use_local_output=False)}
        hpp.parallelize_module(model, mesh, plan)
        hp.distribute_module(  # the rest replicated over tp; ids enter as replicated
            model.emb,
            mesh,
            input_fn=lambda mod, inputs, m: tuple(
                hp.DTensor.from_local(i, m, [hp.Replicate()]) for i in inputs
            ),
        )
        hp.distribute_module(model.head, mesh)
        dp_rank, dp = 0, 1
    else:
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        hpp.parallelize_module(
            model, mesh["tp"], {"fc1": hpp.ColwiseParallel(), "fc2": hpp.RowwiseParallel()}
        )
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp = mesh.get_local_rank("dp"), 2
    return ref, model, dp_rank, dp


def _loss(model, ids):
    out = model(ids)
    if isinstance(out, hp.DTensor):
        out = out.full_tensor()
    return F.cross_entropy(out.flatten(0, 1), ids.flatten())


def _train(mode, max_norm):
    ref, model, dp_rank, dp = _setup(mode)
    opt, ref_opt = AdamW(model.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    norms = []
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 11, (2 * dp, 5), generator=g)
        mine = ids[dp_rank * 2 : (dp_rank + 1) * 2]
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(model, mine).backward()
        _loss(ref, ids).backward()
        n = clip_grad_norm_(model.parameters(), max_norm)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        torch.testing.assert_close(n, rn, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad.full_tensor(),
                q.grad,
                rtol=1e-5,
                atol=1e-6,
                msg=f"{mode} grad {name} step {step}",
            )
        opt.step()
        ref_opt.step()
        norms.append(n.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=f"{mode} param {name}"
        )
    return norms


@pytest.mark.parametrize("mode", ["fsdp", "tp", "fsdp_tp"])
def test_adamw_and_clipping_match_single_device(pool, mode):
    res = pool.run(_train, mode, 0.3)  # 0.3: clipping is active on most steps
    assert all(r == res[0] for r in res) and any(n > 0.3 for n in res[0])


def _inf_norm(mode):
    ref, model, dp_rank, dp = _setup(mode)
    ids = torch.randint(0, 11, (2 * dp, 5), generator=torch.Generator().manual_seed(0))
    _loss(model, ids[dp_rank * 2 : (dp_rank + 1) * 2]).backward()
    _loss(ref, ids).backward()
    n = clip_grad_norm_(model.parameters(), 1e-3, norm_type=float("inf"))
    rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=float("inf"))
    return abs(n.item() - rn.item()) <= 1e-6 * max(1.0, rn.item())


@pytest.mark.parametrize("mode", ["fsdp", "fsdp_tp"])
def test_inf_norm(pool, mode):
    assert pool.run(_inf_norm, mode) == [True] * 4


def _split(model):
    hidden = [model.fc1.weight, model.fc2.weight]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


def _train_muon(mode):
    from hp_optim import ChainedOptimizer, Muon

    ref, model, dp_rank, dp = _setup(mode)
    h, rest = _split(model)
    rh, rrest = _split(ref)
    opt = ChainedOptimizer([Muon(h, lr=0.02, weight_decay=0.01), AdamW(rest, lr=0.01)])
    ref_opt = ChainedOptimizer([Muon(rh, lr=0.02, weight_decay=0.01), AdamW(rrest, lr=0.01)])
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 11, (2 * dp, 5), generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(model, ids[dp_rank * 2 : (dp_rank + 1) * 2]).backward()
        _loss(ref, ids).backward()
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.detach().full_tensor(),
                q.detach(),
                rtol=1e-5,
                atol=1e-6,
                msg=f"{mode} {name} step {step}",
            )
    return True


@pytest.mark.parametrize("mode", ["fsdp", "tp", "fsdp_tp"])
def test_muon_chained_with_adamw_matches_single_device(pool, mode):
    assert pool.run(_train_muon, mode) == [True] * 4


def _naive_equals_distributed():
    from hp_optim import orthogonalize

    mesh = hp.init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    mats = [
        torch.randn(7, 5, generator=g),
        torch.randn(4, 9, generator=g),
        torch.randn(6, 6, generator=g),
    ]
    pls = [[hp.Shard(0), hp.Shard(1)], [hp.Shard(1), hp.Replicate()], [hp.Shard(0), hp.Shard(0)]]
    dts = [hp.distribute_tensor(m, mesh, p) for m, p in zip(mats, pls)]
    # a mesh whose rank order is not the group's (a (tp, dp) view of a (dp, tp) mesh)
    swapped = hp.DeviceMesh("cpu", [[0, 2], [1, 3]])
    dts += [hp.distribute_tensor(m, swapped, p) for m, p in zip(mats, pls)]
    a = orthogonalize(dts)
    b = orthogonalize(dts, naive=True)
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def test_owner_orthogonalize_equals_gathering_everything(pool):
    assert pool.run(_naive_equals_distributed) == [True] * 4


def test_two_ranks(pool2):
    pool2.run(_train, "fsdp", 0.3)
    assert pool2.run(_train_muon, "fsdp") == [True] * 2


def _state_round_trip():
    """Optimizer state is DTensors; saving and loading it mid-run changes nothing."""
    from hp_optim import ChainedOptimizer, Muon

    results = []
    for interrupt in (False, True):
        ref, model, dp_rank, dp = _setup("fsdp")
        h, rest = _split(model)

        def make(h=h, rest=rest):
            return ChainedOptimizer([Muon(h, lr=0.02), AdamW(rest, lr=0.01)])

        opt = make()
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 11, (2 * dp, 5), generator=g)
            opt.zero_grad()
            _loss(model, ids[dp_rank * 2 : (dp_rank + 1) * 2]).backward()
            opt.step()
            if interrupt and step == 1:
                sd = opt.state_dict()
                assert any(
                    isinstance(v, hp.DTensor)
                    for st in sd["optimizers"][1]["state"].values()
                    for v in st.values()
                )
                opt = make()
                opt.load_state_dict(sd)
        results.append([p.detach().full_tensor() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_sharded_state_dict_round_trip(pool):
    assert pool.run(_state_round_trip) == [True] * 4
