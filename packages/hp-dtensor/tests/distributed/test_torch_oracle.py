"""PyTorch's torch.distributed.tensor as an oracle, and zero-copy interop with it (4 ranks)."""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import tensor as tdt
from torch.distributed.device_mesh import init_device_mesh as torch_mesh

import hp_dtensor as hp
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(4)

S0, S1, R, P = hp.Shard(0), hp.Shard(1), hp.Replicate(), hp.Partial()
_TORCH_PL = {"S0": tdt.Shard(0), "S1": tdt.Shard(1), "R": tdt.Replicate()}
_OUR_PL = {"S0": S0, "S1": S1, "R": R}


def _inputs(*shapes):
    g = torch.Generator().manual_seed(sum(sum(s) for s in shapes))
    return [torch.randn(tuple(s), generator=g) for s in shapes]


CASES = {
    "mm_row": (torch.mm, [(8, 6), (6, 5)], ["S0", "R"]),
    "mm_contract": (torch.mm, [(8, 6), (6, 5)], ["S1", "S0"]),
    "linear_col": (F.linear, [(7, 6), (8, 6), (8,)], ["R", "S0", "S0"]),
    "linear_row": (F.linear, [(7, 8), (6, 8), (6,)], ["S1", "S1", "R"]),
    "add_bcast": (torch.add, [(8, 6), (6,)], ["S0", "R"]),
    "sum_dim": (lambda x: x.sum(0), [(7, 5)], ["S0"]),
    "mean": (lambda x: x.mean(), [(8, 5)], ["S0"]),
    "softmax": (lambda x: torch.softmax(x, -1), [(7, 5)], ["S0"]),
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (6,), w, b),
        [(8, 6), (6,), (6,)],
        ["S0", "R", "R"],
    ),
    "transpose_view": (lambda x: x.t().reshape(-1), [(8, 4)], ["S1"]),
    "gelu_mul": (lambda x, y: F.gelu(x) * y, [(8, 6), (8, 6)], ["S1", "S1"]),
}


def _oracle(name):
    fn, shapes, pls = CASES[name]
    ours_mesh = hp.init_device_mesh("cpu", (4,))
    theirs_mesh = torch_mesh("cpu", (4,))
    xs = _inputs(*shapes)
    ours_in = [
        hp.distribute_tensor(x, ours_mesh, [_OUR_PL[p]]).requires_grad_() for x, p in zip(xs, pls)
    ]
    theirs_in = [
        tdt.distribute_tensor(x, theirs_mesh, [_TORCH_PL[p]]).requires_grad_()
        for x, p in zip(xs, pls)
    ]
    ours = fn(*ours_in)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fn(*theirs_in)
    torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), msg=name)
    w = _inputs(tuple(theirs.shape))[0]
    (ours.full_tensor() * w).sum().backward()
    (theirs.full_tensor() * w).sum().backward()
    for a, b in zip(ours_in, theirs_in):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), msg=name)
    return True


def test_same_results_as_torch_dtensor(pool):
    for name in CASES:
        assert pool.run(_oracle, name) == [True] * 4, name


def _redistribute_like_torch():
    ours_mesh = hp.init_device_mesh("cpu", (2, 2))
    theirs_mesh = torch_mesh("cpu", (2, 2))
    full = _inputs((7, 6))[0]
    pls = [("S0", "S1"), ("S1", "S0"), ("R", "S0"), ("S0", "S0"), ("R", "R")]
    n = 0
    for src in pls:
        for dst in pls:
            a = hp.distribute_tensor(full, ours_mesh, [_OUR_PL[p] for p in src])
            b = tdt.distribute_tensor(full, theirs_mesh, [_TORCH_PL[p] for p in src])
            a2 = a.redistribute(ours_mesh, [_OUR_PL[p] for p in dst])
            b2 = b.redistribute(theirs_mesh, [_TORCH_PL[p] for p in dst])
            torch.testing.assert_close(a2.to_local(), b2.to_local(), msg=f"{src}->{dst}")
            n += 1
    return n


def test_local_pieces_match_torch_dtensor(pool):
    assert pool.run(_redistribute_like_torch) == [25] * 4


def _interop():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _inputs((7, 6))[0]
    a = hp.distribute_tensor(full, mesh, [S0, S1])
    t = a.to_torch()
    assert isinstance(t, tdt.DTensor)
    assert t.to_local().data_ptr() == a.to_local().data_ptr()  # no copy
    assert tuple(t.placements) == (tdt.Shard(0), tdt.Shard(1)) and tuple(t.shape) == (7, 6)
    torch.testing.assert_close(t.full_tensor(), full)
    back = hp.DTensor.from_torch(t)
    assert back.to_local().data_ptr() == a.to_local().data_ptr()
    assert back.placements == (S0, S1) and back.device_mesh == mesh
    torch.testing.assert_close(back.full_tensor(), full)
    tp = tdt.distribute_tensor(full, t.device_mesh, [tdt.Replicate(), tdt.Shard(0)])
    ours = hp.DTensor.from_torch(tp)
    torch.testing.assert_close((ours * 2).full_tensor(), full * 2)
    return True


def test_interop_shares_local_data(pool):
    assert pool.run(_interop) == [True] * 4


def _module_training():
    """distribute_module + several optimizer steps match a single-process model."""
    mesh = hp.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(ref.state_dict())

    def shard_first(name, mod, m):
        if name == "0":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, [S0]))
            mod.bias = nn.Parameter(hp.distribute_tensor(mod.bias.data, m, [S0]))
        if name == "2":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, [S1]))

    hp.distribute_module(
        model,
        mesh,
        shard_first,
        input_fn=lambda mod, inputs, m: tuple(hp.distribute_tensor(i, m, [R]) for i in inputs),
        output_fn=lambda mod, out, m: out.redistribute(m, [R]).to_local(),
    )
    assert model[2].bias.placements == (R,)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        for mod, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = F.mse_loss(mod(x), y)
            loss.backward()
            o.step()
            losses.append(loss.item())
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=n)
    return losses


def test_distribute_module_trains_like_single_process(pool):
    losses = pool.run(_module_training)[0]
    assert losses[0::2] == losses[1::2] or all(
        abs(a - b) < 1e-5 for a, b in zip(losses[0::2], losses[1::2])
    )
