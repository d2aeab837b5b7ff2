"""Regressions found in review: each check failed before its fix (2 ranks)."""

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.dirname(__file__))
from dt_helpers import make_dtensor  # noqa: E402

import hp_dtensor as hp  # noqa: E402
from hp_dtensor import Partial, Replicate, Shard  # noqa: E402

pool = rank_pool_fixture(2)


def _close(a, b):
    return bool(torch.allclose(a.float(), b.float(), atol=1e-6))


def _partial_pointwise():
    mesh = hp.init_device_mesh("cpu", (2,))
    full = torch.arange(6.0).reshape(2, 3) - 2.0
    r = {}
    x = make_dtensor(full, mesh, [Partial("sum")])
    r["psum+1"] = _close((x + 1.0).full_tensor(), full + 1)
    r["psum+0d"] = _close((x + torch.tensor(1.0)).full_tensor(), full + 1)
    r["1-psum"] = _close((1.0 - x).full_tensor(), 1 - full)
    r["psum*2"] = (x * 2.0).placements == (Partial(),) and _close((x * 2.0).full_tensor(), full * 2)
    r["div(2,psum)"] = _close(
        torch.div(2.0, make_dtensor(full + 5, mesh, [Partial()])).full_tensor(), 2.0 / (full + 5)
    )
    m = make_dtensor(full, mesh, [Partial("max")])
    r["-pmax"] = _close((-m).full_tensor(), -full)
    r["1-pmax"] = _close((1.0 - m).full_tensor(), 1 - full)
    m.mul_(-1.0)
    r["pmax.mul_"] = _close(m.full_tensor(), -full)
    f = torch.tensor([[1.0, 2.0, 3.0]])
    r["psum.to(int)"] = make_dtensor(f, mesh, [Partial()]).to(
        torch.int64
    ).full_tensor().tolist() == [[1, 2, 3]]
    rep = hp.distribute_tensor(torch.randn(8, 6), mesh, [Replicate()])
    other = hp.distribute_tensor(torch.randn(3, dtype=torch.float64), mesh, [Shard(0)])
    t = rep.type_as(other)
    r["type_as"] = (
        t.placements == (Replicate(),)
        and t.dtype == torch.float64
        and _close(t.full_tensor(), rep.full_tensor().double())
    )
    nan = make_dtensor(torch.tensor([1.0, float("nan"), 2.0]), mesh, [Partial()])
    r["nansum_partial"] = nan.nansum().full_tensor().item() == 3.0
    return r


def test_partial_values_pass_only_through_linear_ops(pool):
    for res in pool.run(_partial_pointwise):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


def _cache_keys():
    mesh = hp.init_device_mesh("cpu", (2,))
    r = {}
    x = hp.distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(1)])
    a = x[1]
    b = x[True]
    r["x[1]"] = tuple(a.shape) == (4,) and _close(a.full_tensor(), torch.arange(4.0, 8.0))
    r["x[True]"] = tuple(b.shape) == (1, 2, 4) and _close(b.full_tensor(), x.full_tensor()[None])
    mask = hp.distribute_tensor(torch.tensor([True, False, True, True]), mesh, [Shard(0)])
    r["mask*1"] = (mask * 1).dtype == torch.int64
    r["mask*True"] = (mask * True).dtype == torch.bool and (
        mask * True
    ).to_local().dtype == torch.bool
    # sdpa: a dropout call must not reuse the plan of a no-dropout call
    q = hp.distribute_tensor(torch.randn(4, 2, 3, 4), mesh, [Shard(0)])
    F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    hp.manual_seed(11, mesh)
    out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(11)
    ref = F.scaled_dot_product_attention(*(q.full_tensor(),) * 3, dropout_p=0.5)
    r["sdpa_dropout"] = _close(out.full_tensor(), ref)
    return r


def test_cache_keys_separate_bool_int_and_dropout(pool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for res in pool.run(_cache_keys):
            assert all(res.values()), {k: v for k, v in res.items() if not v}


def _inplace():
    warnings.simplefilter("ignore")
    mesh = hp.init_device_mesh("cpu", (2,))
    r = {}
    x = hp.distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    x[0] = 5.0
    x[3, 1] += 1
    expect = torch.zeros(4, 3)
    expect[0] = 5.0
    expect[3, 1] += 1
    r["setitem"] = _close(x.full_tensor(), expect)
    p = make_dtensor(torch.tensor([-1.0, 2.0]), mesh, [Partial()])
    F.relu(p, inplace=True)
    r["relu_inplace"] = _close(p.full_tensor(), torch.tensor([0.0, 2.0]))
    x[1:3].fill_(7)  # a slice across shards is gathered; the in-place result is written back
    expect[1:3] = 7
    r["copy_view_written_back"] = _close(x.full_tensor(), expect)
    try:
        x.reshape(3, 4).zero_()  # gathered by reshape: no way to write back
        r["copy_view"] = False
    except hp.ShardingError as e:
        r["copy_view"] = "redistributed" in str(e)
    x[:, 1].add_(1)  # a true view of the local shard: allowed, writes through
    expect[:, 1] += 1
    r["true_view"] = _close(x.full_tensor(), expect)
    a = hp.distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    try:
        torch.add(a, a, out=hp.distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))
        r["out"] = False
    except hp.ShardingError as e:
        r["out"] = "out=" in str(e)
    alpha = torch.tensor(2.0, requires_grad=True)
    xs = hp.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    (xs * alpha).sum().full_tensor().backward()
    r["scalar_grad"] = alpha.grad.item() == 28.0
    return r


def test_inplace_writes_through_or_fails_loudly(pool):
    for res in pool.run(_inplace):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


@pytest.mark.parametrize("shape", [(4, 3), (5, 2)])
def test_shapes_even_and_uneven(pool, shape):
    assert pool.run(_setitem_shape, shape) == [True, True]


def _setitem_shape(shape):
    warnings.simplefilter("ignore")
    mesh = hp.init_device_mesh("cpu", (2,))
    x = hp.distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
    x[-1] = 1.0
    ref = torch.zeros(shape)
    ref[-1] = 1.0
    return _close(x.full_tensor(), ref)


def _second_review():
    import torch.nn as nn

    import hp_dtensor.parallel as hpp

    mesh = hp.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g)
    r = {}
    # a shared gradient all-reduce must not outlive an in-place change of its activation
    xs = hp.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    ws = hp.distribute_tensor(w, mesh, [Shard(1)])
    h = xs * 1
    y1 = torch.mm(h, ws)
    h.mul_(3)
    y2 = torch.mm(h, ws)
    (y1.full_tensor().sum() + y2.full_tensor().pow(2).sum()).backward()
    rx = x.clone().requires_grad_()
    rh = rx * 1
    ry1 = rh @ w
    rh.mul_(3)
    (ry1.sum() + (rh @ w).pow(2).sum()).backward()
    r["stale_cache"] = _close(xs.grad.full_tensor(), rx.grad)
    # gathered activations: in-place after a split use, dropout, to_local(grad_placements)
    for case in ("inplace", "dropout", "to_local_gp", "autograd_grad"):
        xs = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        rx = x.clone().requires_grad_()
        gx = xs.redistribute(mesh, [Replicate()])
        y = torch.mm(gx, ws).full_tensor().sum()
        ry = (rx @ w).sum()
        if case == "inplace":
            gx.mul_(3)
            rx2 = rx * 1
            rx2.mul_(3)
            z, rz = torch.mm(gx, ws).full_tensor().pow(2).sum(), (rx2 @ w).pow(2).sum()
        elif case == "dropout":
            hp.manual_seed(5, mesh)
            z = F.dropout(gx, 0.5, True).sum().full_tensor()
            torch.manual_seed(5)
            rz = F.dropout(rx, 0.5, True).sum()
        elif case == "to_local_gp":
            z = gx.to_local(grad_placements=[Replicate()]).pow(2).sum()
            rz = rx.pow(2).sum()
        else:
            (gg,) = torch.autograd.grad(y, [gx])
            (rg,) = torch.autograd.grad(ry, [rx])
            r[case] = _close(gg.full_tensor(), rg)
            continue
        (y + z).backward()
        (ry + rz).backward()
        r[case] = _close(xs.grad.full_tensor(), rx.grad)
    # to_local(grad_placements=[Partial()]) of a gathered activation, each rank's work after it
    # different: the gradient is the sum over ranks, whichever use of the activation comes
    # first (the partial one first: reduce-scattered by the gather)
    rank, n = dist.get_rank(), dist.get_world_size()
    for case in ("partial_first", "split_first", "exact_first"):
        xs = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        rx = x.clone().requires_grad_()
        gx = xs.redistribute(mesh, [Replicate()])
        parts = []
        if case == "split_first":
            parts.append(torch.mm(gx, ws).full_tensor().sum())
        if case == "exact_first":
            parts.append(gx.to_local().sin().sum())
        local = gx.to_local(grad_placements=[Partial()])
        parts.append((local * (rank + 1)).pow(2).sum())
        if case == "partial_first":
            parts.append(torch.mm(gx, ws).full_tensor().sum())
        sum(parts).backward()
        ref = sum((rx * (r + 1)).pow(2).sum() for r in range(n))
        if case != "exact_first":
            ref = ref + (rx @ w).sum()
        else:
            ref = ref + rx.sin().sum()
        ref.backward()
        r[f"to_local_partial_{case}"] = _close(xs.grad.full_tensor(), rx.grad)
    # ... and in the backward, the partial gradient is reduce-scattered, not all-reduced
    platform = hp.get_platform("cpu")
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("all_reduce", "reduce_scatter_into"):
            inner = getattr(platform, name)
            mp.setattr(
                platform, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n) or _f(*a, **k)
            )
        xs = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        local = xs.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        (local * (rank + 1)).sum().backward()
    r["to_local_partial_reduce_scatters"] = calls == ["reduce_scatter_into"]
    # losses over class shards where a rank holds no classes, or a -inf logit
    logits = torch.randn(5, 1, generator=g)
    tgt = torch.zeros(5, dtype=torch.long)
    lg = hp.distribute_tensor(logits, mesh, [Shard(1)])
    with hpp.loss_parallel():
        nll = F.nll_loss(F.log_softmax(lg, -1), tgt)
    r["no_classes"] = _close(nll.full_tensor(), F.nll_loss(F.log_softmax(logits, -1), tgt))
    logits = torch.randn(5, 6, generator=g)
    logits[:, 3] = float("-inf")
    tgt = torch.tensor([0, 1, 2, 4, 5])
    lg = hp.distribute_tensor(logits, mesh, [Shard(1)])
    r["neg_inf"] = _close(F.cross_entropy(lg, tgt).full_tensor(), F.cross_entropy(logits, tgt))
    with hpp.loss_parallel():
        lp = F.log_softmax(lg, -1, dtype=torch.float64)
    r["dtype"] = lp.dtype == lp.to_local().dtype == torch.float64
    # vocab-parallel embedding with scale_grad_by_freq
    ref = nn.Embedding(8, 3, scale_grad_by_freq=True)
    emb = nn.Embedding(8, 3, scale_grad_by_freq=True)
    emb.load_state_dict(ref.state_dict())
    hpp.parallelize_module(emb, mesh, hpp.RowwiseParallel())
    ids = torch.tensor([[0, 0, 5, 7, 0, 2]])
    emb(ids).sum().backward()
    ref(ids).sum().backward()
    r["scale_grad_by_freq"] = _close(emb.weight.grad.full_tensor(), ref.weight.grad)
    return r


def test_second_review_findings(pool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for res in pool.run(_second_review):
            assert all(res.values()), {k: v for k, v in res.items() if not v}


def _device_moves():
    mesh = hp.init_device_mesh("cpu", (2,))
    x = hp.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    outs = [x.to("cpu"), x.to(device=torch.device("cpu"), dtype=torch.float64), x.cpu()]
    return [(str(o.placements[0]), tuple(o.to_local().shape)) for o in outs]


def test_device_moves_keep_placements(pool):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        res = pool.run(_device_moves)
    assert res[0] == [("S(0)", (2, 2))] * 3


def _storage_is_the_shard():
    mesh = hp.init_device_mesh("cpu", (2,))
    x = make_dtensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    st = x.untyped_storage()
    return st.nbytes(), st._cdata == x.to_local().untyped_storage()._cdata


def test_untyped_storage_is_the_local_shard(pool):
    """A DTensor's storage is what this rank holds (memory tools such as torch's MemTracker,
    and hp-plan's dry run, count it): the shard's, not a gathered copy's."""
    assert pool.run(_storage_is_the_shard) == [(24, True), (24, True)]


def _broadcast_shard_is_compact():
    mesh = hp.init_device_mesh("cpu", (2,))
    full = torch.arange(12.0).reshape(4, 3)
    x = hp.distribute_tensor(full, mesh, [Shard(0)], src_data_rank=0)
    return x.to_local().untyped_storage().nbytes(), torch.equal(x.full_tensor(), full)


def test_distributed_shard_holds_only_its_rows(pool):
    """distribute_tensor with a source rank: the broadcast copy is the whole tensor, and a
    row shard of it is a view; the shard must not keep the whole copy alive."""
    assert pool.run(_broadcast_shard_is_compact) == [(24, True), (24, True)]
