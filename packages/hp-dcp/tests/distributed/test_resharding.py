"""Save on 4 ranks (FSDP: model + AdamW state), load on 2 ranks with TP 2, on 2 ranks with FSDP
and in one process: equal values, and training resumes with the losses of the uninterrupted
run. Also: dedup and balance across ranks, async_save, and a rank failing mid-save."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hp_dcp
import hp_dtensor as hp
from hp_fsdp import fully_shard
from hp_optim import AdamW
from hp_testing.models import TinyLlama
from hp_testing.pytest_plugin import rank_pool_fixture

pool4 = rank_pool_fixture(4)
pool2 = rank_pool_fixture(2)

B, S = 4, 8


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 37, (B, S), generator=g), torch.randint(0, 37, (B, S), generator=g)


def _build(kind, seed):
    torch.manual_seed(seed)
    model = TinyLlama()  # vocab 37, hidden 42: uneven over 2 and 4 ranks
    if kind == "fsdp":
        mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        import hp_dtensor.parallel as hpp

        mesh = hp.init_device_mesh("cpu", (2,))
        plan = {
            "wq": hpp.ColwiseParallel(),
            "wk": hpp.ColwiseParallel(),
            "wv": hpp.ColwiseParallel(),
            "wo": hpp.RowwiseParallel(),
            "w1": hpp.ColwiseParallel(),
            "w3": hpp.ColwiseParallel(),
            "w2": hpp.RowwiseParallel(),
        }
        for layer in model.layers:
            hpp.parallelize_module(layer, mesh, plan)
    return model, AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, kind, step):
    ids, tgt = _batch(step)
    if kind == "fsdp":
        r, w = dist.get_rank(), dist.get_world_size()
        ids, tgt = ids.chunk(w)[r], tgt.chunk(w)[r]
    loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    if kind == "fsdp":
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def _state(model, opt, step):
    return {
        "model": hp_dcp.ModelState(model),
        "optim": hp_dcp.OptimizerState(model, opt),
        "train": {"step": step, "data_position": step * B},
    }


def _full(model, opt):
    """Every parameter and optimizer state tensor, unsharded."""
    out = {}

    def full(v):
        return (v.full_tensor() if isinstance(v, hp.DTensor) else v).detach().clone()

    for n, p in model.named_parameters():
        out[n] = full(p)
    for n, st in hp_dcp.get_optimizer_state_dict(model, opt)["state"].items():
        for k, v in st.items():
            out[f"{n}/{k}"] = full(v)
    return out


def _save_fsdp4(path):
    model, opt = _build("fsdp", seed=0)
    for step in range(2):
        _train_step(model, opt, "fsdp", step)
    ref = _full(model, opt)
    hp_dcp.save(_state(model, opt, 2), checkpoint_id=path)
    losses = [_train_step(model, opt, "fsdp", s) for s in (2, 3)]
    return ref, losses


def _resume(path, kind):
    model, opt = _build(kind, seed=7)  # other values, so a load that does nothing fails
    state = _state(model, opt, 0)
    hp_dcp.load(state, checkpoint_id=path)
    got = _full(model, opt)
    step = state["train"]["step"]
    losses = [_train_step(model, opt, kind, s) for s in (step, step + 1)]
    return got, losses, state["train"]


@pytest.fixture(scope="module")
def fsdp4_checkpoint(pool4, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    results = pool4.run(_save_fsdp4, path)
    return path, results[0][0], results[0][1]


def _check(got, train, ref, losses, ref_losses):
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert train == {"step": 2, "data_position": 8}
    torch.testing.assert_close(losses, ref_losses, rtol=2e-5, atol=0)


@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_fsdp4_to_two_ranks(pool2, fsdp4_checkpoint, kind):
    path, ref, ref_losses = fsdp4_checkpoint
    for got, losses, train in pool2.run(_resume, path, kind):
        _check(got, train, ref, losses, ref_losses)


def test_fsdp4_to_one_process(fsdp4_checkpoint):
    path, ref, ref_losses = fsdp4_checkpoint
    got, losses, train = _resume(path, "plain")
    _check(got, train, ref, losses, ref_losses)
    md = hp_dcp.open_checkpoint(path).metadata
    wq = md.tensors["model.layers.0.wq.weight"]
    assert wq.placements == "S(0) on mesh (4,)" and len(wq.chunks) == 4
    # the scalar AdamW step (a plain tensor on every rank) is stored once
    assert len(md.tensors["optim.state.layers.0.wq.weight.step"].chunks) == 1
    assert sorted(os.listdir(path)) == [
        "data_00000.bin",
        "data_00001.bin",
        "data_00002.bin",
        "data_00003.bin",
        "metadata.json",
    ]


def _hsdp_save(path):
    """A (2, 2) mesh (replicate, shard): every shard is held by two ranks."""
    mesh = hp.init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    full = {f"w{i}": torch.randn(6 + i, 5, generator=g) for i in range(6)}
    sd = {k: hp.distribute_tensor(v, mesh, [hp.Replicate(), hp.Shard(0)]) for k, v in full.items()}
    sd["scalar"] = torch.tensor(3.0)
    sd["rank_value"] = dist.get_rank()  # differs per rank: stored per rank
    hp_dcp.save(sd, checkpoint_id=path)
    out = {
        k: hp.distribute_tensor(torch.zeros_like(v), mesh, [hp.Shard(1), hp.Replicate()])
        for k, v in full.items()
    }
    out["scalar"], out["rank_value"] = torch.tensor(0.0), -1
    hp_dcp.load(out, checkpoint_id=path)
    ok = all(torch.equal(out[k].full_tensor(), full[k]) for k in full)
    return ok, out["rank_value"], out["scalar"].item()


def test_dedup_and_balance(pool4, tmp_path):
    path = str(tmp_path / "hsdp")
    for r, (ok, rank_value, scalar) in enumerate(pool4.run(_hsdp_save, path)):
        assert ok and rank_value == r and scalar == 3.0
    md = hp_dcp.open_checkpoint(path).metadata
    for i in range(6):
        assert len(md.tensors[f"w{i}"].chunks) == 2  # 2 distinct shards, each written once
    assert sorted(md.objects["rank_value"].per_rank) == [0, 1, 2, 3]
    sizes = [os.path.getsize(os.path.join(path, f"data_{r:05d}.bin")) for r in range(4)]
    total = sum(4 * (6 + i) * 5 for i in range(6)) + 4
    assert sum(sizes) - sum(o.nbytes for o in md.objects["rank_value"].per_rank.values()) == total
    assert max(sizes) - min(sizes) <= 4 * 11 * 5 // 2 + 64  # at most about one shard apart


def _async(path_a, path_b):
    model, opt = _build("fsdp", seed=0)
    _train_step(model, opt, "fsdp", 0)
    ref = _full(model, opt)
    fut = hp_dcp.async_save(_state(model, opt, 1), checkpoint_id=path_a)
    _train_step(model, opt, "fsdp", 1)  # runs while the background thread writes
    ref2 = _full(model, opt)
    fut2 = hp_dcp.async_save(_state(model, opt, 2), checkpoint_id=path_b)
    fut.result()
    fut2.result()
    got = []
    for path in (path_a, path_b):
        m2, o2 = _build("fsdp", seed=3)
        hp_dcp.load(_state(m2, o2, 0), checkpoint_id=path)
        got.append(_full(m2, o2))
    return all(torch.equal(got[0][k], ref[k]) for k in ref), all(
        torch.equal(got[1][k], ref2[k]) for k in ref2
    )


def test_async_save(pool4, tmp_path):
    assert pool4.run(_async, str(tmp_path / "a"), str(tmp_path / "b")) == [(True, True)] * 4


def _fail_on_rank(path, bad_rank):
    class Breaks(hp_dcp.FileSystemWriter):
        def write(self, rank, items):
            if rank == bad_rank:
                raise OSError("disk full (simulated)")
            return super().write(rank, items)

    sd = {
        "w": hp.distribute_tensor(
            torch.arange(8.0), hp.init_device_mesh("cpu", (4,)), [hp.Shard(0)]
        )
    }
    hp_dcp.save(sd, checkpoint_id=path)
    sd2 = {
        "w": hp.distribute_tensor(
            torch.arange(8.0) * 2, hp.init_device_mesh("cpu", (4,)), [hp.Shard(0)]
        )
    }
    try:
        hp_dcp.save(sd2, checkpoint_id=path, storage_writer=Breaks(path))
    except hp_dcp.CheckpointError as e:
        msg = str(e)
    else:
        msg = None
    bad = {"w": torch.ones(3) if dist.get_rank() == 1 else torch.ones(4)}
    try:
        hp_dcp.save(bad, checkpoint_id=path + "_bad")
    except hp_dcp.StateDictError as e:
        bad_msg = str(e)
    else:
        bad_msg = None
    out = {
        "w": hp.distribute_tensor(torch.zeros(8), hp.init_device_mesh("cpu", (4,)), [hp.Shard(0)])
    }
    hp_dcp.load(out, checkpoint_id=path)
    return msg, bad_msg, out["w"].full_tensor()


def test_rank_failure_raises_everywhere_and_keeps_previous(pool4, tmp_path):
    path = str(tmp_path / "c")
    for msg, bad_msg, w in pool4.run(_fail_on_rank, path, 2):
        assert msg is not None and "rank 2 failed to write: OSError: disk full" in msg
        assert "nothing was committed" in msg
        assert bad_msg is not None and "'w' differs between ranks" in bad_msg
        assert torch.equal(w, torch.arange(8.0))  # the previous checkpoint
    assert sorted(os.listdir(tmp_path)) == ["c"]


def _torch_dcp_to_ours(path):
    """PyTorch DCP saves row-sharded torch DTensors on 2 ranks; hp_dcp loads them column-sharded,
    and PyTorch's own load of the same checkpoint is the oracle."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as tdist

    tmesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, generator=g).bfloat16()}
    src = {k: tdist(v, tmesh, [TShard(0)]) for k, v in full.items()}
    src["extra"] = {"step": 4}
    tdcp.save(src, checkpoint_id=path)
    theirs = {k: tdist(torch.zeros_like(v), tmesh, [TShard(0)]) for k, v in full.items()}
    theirs["extra"] = {"step": 0}
    tdcp.load(theirs, checkpoint_id=path)
    mesh = hp.init_device_mesh("cpu", (2,))
    ours = {
        "a": hp.distribute_tensor(torch.zeros(7, 5), mesh, [hp.Shard(1)]),
        "b": hp.distribute_tensor(torch.zeros(3, dtype=torch.bfloat16), mesh, [hp.Shard(0)]),
        "extra": {"step": 0},
    }
    hp_dcp.load(ours, checkpoint_id=path)
    return all(
        torch.equal(ours[k].full_tensor(), theirs[k].full_tensor())
        and torch.equal(ours[k].full_tensor(), full[k])
        for k in full
    ) and ours["extra"] == theirs["extra"] == {"step": 4}


def test_loads_multi_rank_torch_dcp(pool2, tmp_path):
    assert pool2.run(_torch_dcp_to_ours, str(tmp_path / "t")) == [True, True]
