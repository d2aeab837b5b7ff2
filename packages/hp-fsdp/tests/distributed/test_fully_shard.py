"""fully_shard against a single-device reference and against PyTorch's FSDP2 (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hp_dtensor as hp
from hp_fsdp import (
    CPUOffloadPolicy,
    FSDPError,
    HSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from hp_testing.models import TinyLlama
from hp_testing.pytest_plugin import rank_pool_fixture

pool4 = rank_pool_fixture(4)
pool2 = rank_pool_fixture(2)

VOCAB, SEQ, B_LOCAL = 37, 8, 2


def _batch(step, world):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (B_LOCAL * world, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _shard(model, mesh, impl, **kw):
    if impl == "ours":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh, **kw)
        torch_fully_shard(model, mesh=mesh, **kw)


def _run(
    world_shape,
    impl="ours",
    steps=10,
    accumulate=1,
    reshard_after_forward=None,
    offload=False,
    shard_dim1=False,
):
    """Train ``steps`` AdamW steps; compare with the single-device reference every step."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = TinyLlama()
    model = TinyLlama()
    model.load_state_dict(ref.state_dict())
    if impl == "ours":
        names = ("dp",) if len(world_shape) == 1 else ("rep", "shard")
        mesh = hp.init_device_mesh("cpu", world_shape, mesh_dim_names=names)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("dp",) if len(world_shape) == 1 else ("rep", "shard")
        mesh = init_device_mesh("cpu", world_shape, mesh_dim_names=names)
    kw = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    if shard_dim1:  # matrices sharded on dim 1; "all" includes uneven ones (FSDP2 refuses them)
        if impl == "ours":
            shard_cls = hp.Shard
        else:
            from torch.distributed.tensor import Shard as shard_cls

        def fn(p):
            even = p.shape[-1] % world == 0
            return shard_cls(1) if p.ndim == 2 and (even or shard_dim1 == "all") else None

        kw["shard_placement_fn"] = fn
    _shard(model, mesh, impl, reshard_after_forward=reshard_after_forward, **kw)
    if offload:
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(accumulate):
            ids, tgt = _batch(step * accumulate + micro, world)
            mine = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
            last = micro == accumulate - 1
            if accumulate > 1:  # the same call on both implementations
                model.set_requires_gradient_sync(last)
            loss = F.cross_entropy(model(ids[mine]).flatten(0, 1), tgt[mine].flatten())
            (loss / accumulate).backward()
            ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten())
            (ref_loss / accumulate).backward()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg /= world
        torch.testing.assert_close(avg, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6, msg=f"grad {name} step {step}"
            )
        opt.step()
        ref_opt.step()
        losses.append(avg.item())
    return losses


def test_fsdp_4_ranks_matches_single_device(pool4):
    losses = pool4.run(_run, (4,))
    assert len(set(map(tuple, losses))) == 1 and len(losses[0]) == 10


def test_fsdp_2_ranks_matches_single_device(pool2):
    losses = pool2.run(_run, (2,), steps=10)  # each step is compared inside _run
    assert losses[0] == losses[1] and len(losses[0]) == 10


def test_hsdp_2x2_matches_single_device(pool4):
    losses = pool4.run(_run, (2, 2))
    assert all(x == losses[0] for x in losses) and len(losses[0]) == 10


def test_no_reshard_and_gradient_accumulation(pool4):
    losses = pool4.run(_run, (4,), steps=10, accumulate=2, reshard_after_forward=False)
    assert len(losses[0]) == 10


def test_reshard_to_a_smaller_group_after_forward(pool4):
    losses = pool4.run(_run, (4,), steps=5, reshard_after_forward=2, shard_dim1="all")
    assert len(losses[0]) == 5


def test_shard_on_dim1_uneven_matches_single_device(pool4):
    losses = pool4.run(_run, (4,), steps=5, shard_dim1="all")
    assert len(losses[0]) == 5


def test_cpu_offload_matches_single_device(pool4):
    losses = pool4.run(_run, (4,), steps=10, offload=True)
    assert len(losses[0]) == 10


@pytest.mark.parametrize(
    "world_shape,kw",
    [
        ((4,), {}),
        ((2, 2), {}),
        ((4,), {"reshard_after_forward": False, "accumulate": 2}),
        ((4,), {"reshard_after_forward": True}),
        ((4,), {"shard_dim1": "even"}),
        ((4,), {"reshard_after_forward": 2}),
    ],
)
def test_same_losses_as_torch_fsdp2(pool4, world_shape, kw):
    ours = pool4.run(_run, world_shape, "ours", 5, **kw)[0]
    theirs = pool4.run(_run, world_shape, "torch", 5, **kw)[0]
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def _root_after_forward():
    """Which groups hold unsharded parameters after forward, per reshard_after_forward."""
    mesh = hp.init_device_mesh("cpu", (2,))
    ids, _ = _batch(0, 2)
    out = {}
    for raf in (None, True):
        torch.manual_seed(0)
        model = TinyLlama()
        _shard(model, mesh, "ours", reshard_after_forward=raf)
        loss = model(ids).sum()
        out[raf] = (model._hp_fsdp.unsharded, [m._hp_fsdp.unsharded for m in model.layers])
        loss.backward()
        out[raf, "after backward"] = model._hp_fsdp.unsharded
        with torch.no_grad():
            model(ids)
        out[raf, "no_grad"] = model._hp_fsdp.unsharded
    return out


def test_root_keeps_parameters_after_forward_by_default(pool2):
    """As FSDP2: with the default (None) the root group, which backward needs first, is not
    resharded after forward; blocks are; an explicit True reshards the root too; no_grad
    forwards and the end of backward always reshard."""
    out = pool2.run(_root_after_forward)[0]
    assert out[None] == (True, [False, False])
    assert out[True] == (False, [False, False])
    for raf in (None, True):
        assert out[raf, "after backward"] is False and out[raf, "no_grad"] is False


def _all_gather_ordering():
    """Which all-gathers first wait for the compute stream (the ``follow`` flag of the side
    stream; on GPUs the others run ahead of compute). The first all-gather of every forward
    pass of a root must wait: the optimizer (or a load) may have written the sharded
    parameters since, even when another model's forward ran in between."""
    from hp_fsdp._state import FSDPContext

    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    a, b = TinyLlama(), TinyLlama()
    _shard(a, mesh, "ours")
    _shard(b, mesh, "ours")
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ids, _ = _batch(0, 2)
    seen = []
    real = FSDPContext.side_stream

    def spy(self, dev, kind, follow=True):
        seen.append((kind, follow))
        return real(self, dev, kind, follow)

    FSDPContext.side_stream = spy
    try:
        a(ids).sum().backward()
        b(ids).sum()  # another model's forward (grad mode, no backward) before the step
        opt.step()
        seen.clear()
        a(ids).sum().backward()
    finally:
        FSDPContext.side_stream = real
    return [f for k, f in seen if k == "all_gather"]


def test_first_all_gather_of_each_root_forward_waits_for_compute(pool2):
    follows = pool2.run(_all_gather_ordering)[0]
    assert follows[0] is True, follows  # the root's, right after the optimizer step
    assert False in follows, follows  # the in-pass ones run ahead


def _reduce_inputs_alive():
    """How many reduce-scatter inputs (the packed unsharded gradients) are still alive when
    backward reaches the embedding's output: every block has reduced by then, the root not."""
    import weakref

    from hp_fsdp import _collectives as col

    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref, model = TinyLlama(layers=4), TinyLlama(layers=4)
    model.load_state_dict(ref.state_dict())
    _shard(model, mesh, "ours")
    sends, alive, at_pack = [], [], []
    real = col.pack_gradients

    def spy(*args, **kwargs):
        at_pack.append(sum(r() is not None for r in sends))  # inputs alive as one is packed
        out = real(*args, **kwargs)
        sends.append(weakref.ref(out))
        return out

    col.pack_gradients = spy
    try:
        ids, tgt = _batch(0, 2)
        local = slice(dist.get_rank() * B_LOCAL, (dist.get_rank() + 1) * B_LOCAL)
        def count(grad):
            alive.append((len(sends), sum(r() is not None for r in sends)))

        def watch(module, args, out):
            out.register_hook(count)  # (returns None: the output is left as it is)

        h = model.tok.register_forward_hook(watch)
        out = model(ids[local])
        F.cross_entropy(out.flatten(0, 1), tgt[local].flatten()).backward()
        h.remove()
        ref_out = ref(ids)
        F.cross_entropy(ref_out.flatten(0, 1), tgt.flatten()).backward()
        err = max(
            (p.grad.full_tensor() - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters())
        )
    finally:
        col.pack_gradients = real
    return alive, at_pack, err


def test_a_reduce_scatter_input_is_released_when_the_next_one_starts(pool2):
    """FSDP2's memory behaviour: a group's packed gradients are let go of once its
    reduce-scatter is done, before the next group packs, not at the end of the backward: no
    earlier input is alive when one is packed (the 4 blocks' and the root's), only the newest
    block's when backward reaches the embedding (before, all 4 were), and the gradients stay
    exact."""
    for alive, at_pack, err in pool2.run(_reduce_inputs_alive):
        assert alive == [(4, 1)], alive
        assert at_pack == [0] * 5, at_pack
        assert err < 1e-5, err


def _kept_root_is_refreshed():
    """The root keeps its parameters after a grad-mode forward; if no backward follows and
    the sharded parameters change, the next forward must not reuse the stale copy."""
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref, model = TinyLlama(), TinyLlama()
    model.load_state_dict(ref.state_dict())
    _shard(model, mesh, "ours")
    ids, _ = _batch(0, 2)
    model(ids)  # grad mode, no backward: the root stays gathered
    kept = model._hp_fsdp.unsharded
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.to_local().mul_(0.5)
            q.mul_(0.5)
        diff = (model(ids) - ref(ids)).abs().max().item()
    return kept, diff, model._hp_fsdp.unsharded


def test_kept_root_parameters_are_refreshed(pool2):
    for kept, diff, after in pool2.run(_kept_root_is_refreshed):
        assert kept  # the root stayed gathered after the grad-mode forward
        assert diff < 1e-5  # yet the next forward saw the changed parameters
        assert not after  # and a no_grad forward resharded it


class _WithEmpty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def _zero_size_parameter():
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref, model = _WithEmpty(), _WithEmpty()
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    return [(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters())]


def test_zero_size_parameter(pool2):
    for grads in pool2.run(_zero_size_parameter):
        assert sorted(tuple(g.shape) for g, _ in grads) == [(0, 4), (4,), (4, 4)]
        for got, want in grads:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _memory():
    mesh = hp.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = TinyLlama(dim=32, hidden=64, vocab=64)
    total = sum(p.numel() for p in model.parameters())
    _shard(model, mesh, "ours")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, SEQ))
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    local = 0
    for p in model.parameters():
        local += p.to_local().numel() * 2  # parameter and gradient
        st = opt.state[p]
        local += sum(v.to_local().numel() for v in st.values() if isinstance(v, hp.DTensor))
    return local, total * 4


def test_memory_is_about_one_over_n(pool4):
    for local, unsharded in pool4.run(_memory):
        assert local <= unsharded / 4 * 1.1, (local, unsharded)


def _mixed_precision():
    mesh = hp.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = TinyLlama()
    model = TinyLlama()
    model.load_state_dict(ref.state_dict())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(model, mesh, "ours", mp_policy=mp)
    ids, tgt = _batch(0, 4)
    rank = dist.get_rank()
    mine = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    logits = model(ids[mine])
    F.cross_entropy(logits.float().flatten(0, 1), tgt[mine].flatten()).backward()
    F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten()).backward()
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        err = (p.grad.full_tensor() - q.grad).norm() / q.grad.norm().clamp_min(1e-12)
        worst = max(worst, err.item())
    return logits.dtype, worst


def test_mixed_precision_bf16_params_fp32_reduce(pool4):
    for dtype, worst in pool4.run(_mixed_precision):
        assert dtype == torch.bfloat16 and worst < 0.05


def _errors():
    mesh = hp.init_device_mesh("cpu", (4,))
    msgs = {}
    m = TinyLlama()
    fully_shard(m.layers[0], mesh=mesh)
    assert isinstance(m.layers[0], HSDPModule)
    try:
        fully_shard(m.layers[0], mesh=mesh)
    except FSDPError as e:
        msgs["twice"] = str(e)
    try:
        fully_shard(TinyLlama(), mesh=hp.init_device_mesh("cpu", (1, 2, 2)))
    except FSDPError as e:
        msgs["mesh"] = str(e)
    mixed = TinyLlama()
    mixed.out.weight = torch.nn.Parameter(torch.empty(37, 24, device="meta"))
    try:
        fully_shard(mixed, mesh=mesh)
    except FSDPError as e:
        msgs["devices"] = str(e)
    tied = TinyLlama()
    fully_shard(tied.layers[0], mesh=mesh)
    tied.out.weight = tied.layers[0].wq.weight  # shares a sharded parameter of another group
    try:
        fully_shard(tied, mesh=mesh)
    except FSDPError as e:
        msgs["shared"] = str(e)
    return msgs


def test_errors(pool4):
    for m in pool4.run(_errors):
        assert "already applied" in m["twice"]
        assert "3 dims" in m["mesh"]
        assert "different devices" in m["devices"]
        assert "shared" in m["shared"] or "already a DTensor" in m["shared"]


@pytest.mark.parametrize("world_shape", [(4,)])
def test_state_dict_round_trip(pool4, world_shape):
    assert pool4.run(_state_dict, world_shape) == [True] * 4


def _state_dict(world_shape):
    from hp_fsdp import get_full_state_dict, load_full_state_dict

    mesh = hp.init_device_mesh("cpu", world_shape)
    torch.manual_seed(0)
    ref = TinyLlama()
    model = TinyLlama()
    model.load_state_dict(ref.state_dict())
    _shard(model, mesh, "ours")
    sd = model.state_dict()
    assert all(isinstance(v, hp.DTensor) for k, v in sd.items())
    full = get_full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v)
    torch.manual_seed(1)
    other = TinyLlama()
    _shard(other, mesh, "ours")
    load_full_state_dict(other, full)
    ids, _ = _batch(0, 1)
    return bool(torch.allclose(other(ids), ref(ids), atol=1e-6))


def _run_tp_fsdp(steps=10, impl="ours"):
    """TP=2 inside each block x FSDP=2 over the batch, on a (dp, tp) mesh."""
    if impl == "ours":
        import hp_dtensor.parallel as hpp

        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        shard = fully_shard
        parallelize = hpp.parallelize_module
    else:
        import torch.distributed.tensor.parallel as hpp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize = hpp.parallelize_module
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    ref = TinyLlama()
    model = TinyLlama()
    model.load_state_dict(ref.state_dict())
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
        parallelize(layer, mesh["tp"], plan)
        shard(layer, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    wq = model.layers[0].wq.weight
    if impl == "ours":
        assert wq.placements == (hp.Shard(0), hp.Shard(0)) and tuple(wq.shape) == (24, 24)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids, tgt = _batch(step, 2)
        mine = slice(dp_rank * B_LOCAL, (dp_rank + 1) * B_LOCAL)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = F.cross_entropy(model(ids[mine]).flatten(0, 1), tgt[mine].flatten())
        loss.backward()
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten())
        ref_loss.backward()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=mesh.get_group("dp"))
        torch.testing.assert_close(avg / 2, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6, msg=f"grad {name} step {step}"
            )
        opt.step()
        ref_opt.step()
        losses.append(avg.item() / 2)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach(), rtol=1e-4, atol=1e-5, msg=name
        )
    return losses


def test_tp2_x_fsdp2_matches_single_device(pool4):
    res = pool4.run(_run_tp_fsdp)
    assert all(r == res[0] for r in res)


def test_tp2_x_fsdp2_same_losses_as_torch(pool4):
    ours = pool4.run(_run_tp_fsdp, 5, "ours")[0]
    theirs = pool4.run(_run_tp_fsdp, 5, "torch")[0]
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def _prefetch():
    mesh = hp.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = TinyLlama(layers=3)
    model = TinyLlama(layers=3)
    model.load_state_dict(ref.state_dict())
    _shard(model, mesh, "ours")
    layers = list(model.layers)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    seen = []
    layers[1].register_forward_pre_hook(
        lambda m, a: seen.append(m._hp_fsdp._ag is not None or m._hp_fsdp.unsharded),
        prepend=True,
    )
    ids, tgt = _batch(0, 4)
    rank = dist.get_rank()
    mine = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    F.cross_entropy(model(ids[mine]).flatten(0, 1), tgt[mine].flatten()).backward()
    F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6)
    return seen


def test_explicit_prefetch_gathers_early_and_stays_exact(pool4):
    assert pool4.run(_prefetch) == [[True]] * 4


class _Lin(torch.nn.Linear):
    def forward(self, x, use_bias=True):
        return F.linear(x, self.weight, self.bias if use_bias else None)


class _Two(torch.nn.Module):
    """Two linears; the second may skip its bias (a data-dependent branch) and an auxiliary head
    may run without taking part in the loss."""

    def __init__(self):
        super().__init__()
        self.a = _Lin(4, 4)
        self.b = _Lin(4, 4)
        self.aux = _Lin(4, 4)

    def forward(self, x, use_bias=True):
        h = torch.tanh(self.a(x))
        self.last_aux = self.aux(h)  # computed, not always used
        return self.b(h, use_bias)


def _review_cases():
    mesh = hp.init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    res = {}
    # rank-dependent unused bias; frozen a.bias; aux head unused in the loss; 3 SGD steps
    torch.manual_seed(0)
    ref, m = _Two(), _Two()
    m.load_state_dict(ref.state_dict())
    for mod in (m, ref):
        mod.a.bias.requires_grad_(False)
    for sub in (m.a, m.b, m.aux):
        fully_shard(sub, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(
        [p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    flags = [True, False]
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        use_aux = step != 1
        out = m(x[2 * rank : 2 * rank + 2], flags[rank])
        loss = out.pow(2).sum() + (m.last_aux.sum() if use_aux else 0)
        loss.backward()
        for i in range(2):
            o = ref(x[2 * i : 2 * i + 2], flags[i])
            ((o.pow(2).sum() + (ref.last_aux.sum() if use_aux else 0)) / 2).backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None, f"{n} step {step}: expected no gradient"
            else:
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=f"{n} {step}")
        opt.step()
        ref_opt.step()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), msg=n)
    res["mixed_usage"] = True
    # tied weights inside one group train as one parameter
    torch.manual_seed(0)
    ref, m = _Two(), _Two()
    ref.b.weight = ref.a.weight
    m.load_state_dict(ref.state_dict())
    m.b.weight = m.a.weight
    fully_shard(m, mesh=mesh)
    assert m.b.weight is m.a.weight
    m(x[2 * rank : 2 * rank + 2]).sum().backward()
    for i in range(2):
        (ref(x[2 * i : 2 * i + 2]).sum() / 2).backward()
    torch.testing.assert_close(m.a.weight.grad.full_tensor(), ref.a.weight.grad)
    res["tied"] = len(list(m.parameters())) == len(list(ref.parameters()))
    # tied across groups: an error, not a silent untie
    t = _Two()
    t.b.weight = t.a.weight
    fully_shard(t.a, mesh=mesh)
    try:
        fully_shard(t, mesh=mesh)
        res["tie_across"] = False
    except FSDPError as e:
        res["tie_across"] = "tied" in str(e)
    return res


def test_review_cases_tied_frozen_unused_aux(pool2):
    for res in pool2.run(_review_cases):
        assert res == {"mixed_usage": True, "tied": True, "tie_across": True}


class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under non-reentrant activation checkpointing."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def _run_checkpointed(steps=3):
    """fully_shard over checkpointed blocks: backward recomputes each block's forward, which
    needs the module's unsharded parameters in place during its backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = TinyLlama()
    model = TinyLlama()
    model.load_state_dict(ref.state_dict())
    for i, layer in enumerate(model.layers):
        model.layers[i] = _Checkpointed(layer)
    mesh = hp.init_device_mesh("cpu", (world,))
    _shard(model, mesh, "ours")
    for step in range(steps):
        ids, tgt = _batch(step, world)
        mine = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        F.cross_entropy(model(ids[mine]).flatten(0, 1), tgt[mine].flatten()).backward()
        F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6)
        assert all(
            not isinstance(p, hp.DTensor) or p.to_local().numel() < p.numel()
            for p in model.parameters()
        )  # sharded again after backward
    return True


def test_activation_checkpointing_inside_fully_shard(pool2):
    assert pool2.run(_run_checkpointed) == [True, True]
