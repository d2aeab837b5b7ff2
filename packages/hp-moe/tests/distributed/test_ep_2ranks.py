"""Expert parallelism on 2 gloo ranks against one process: every dispatcher, errors."""

import os
import sys

import pytest
import torch

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import moe_model as mm  # noqa: E402

import hp_dtensor as hp  # noqa: E402
import hp_moe  # noqa: E402
from hp_dtensor import MeshError  # noqa: E402
from hp_dtensor.parallel import parallelize_module  # noqa: E402

pool = rank_pool_fixture(2)


def _ep_run(style_kwargs):
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    ref = mm.build()
    model = mm.build()
    for layer in model.layers:
        parallelize_module(layer.moe, mesh, {"experts": hp_moe.ExpertParallel(**style_kwargs)})
    assert model.layers[0].moe.experts.w1.to_local().shape[0] == mm.EXPERTS // 2
    group = mesh.get_group()
    return mm.train_and_compare(
        model,
        ref,
        dp_group=group,
        dp_rank=mesh.get_local_rank(),
        dp_size=2,
        after_backward=lambda m: mm.sync_grads(m, group, ep=2),
    )


@pytest.mark.parametrize(
    "style",
    [
        {},
        {"dispatcher": "one_sided"},
        {"sync_free": True},
        {"sync_free": True, "dispatcher": "one_sided"},
    ],
    ids=["all_to_all", "one_sided", "sync_free", "sync_free_one_sided"],
)
def test_ep2_equals_one_device(pool, style):
    losses = pool.run(_ep_run, style)
    assert losses[0] == losses[1] and len(losses[0]) == 5


def _in_flight():
    """Two microbatches dispatched before either is combined (1F1B / overlap order)."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    moe = hp_moe.MoE(16, 8, 4, 2)
    ref = hp_moe.MoE(16, 8, 4, 2)
    ref.load_state_dict(moe.state_dict())
    parallelize_module(moe, mesh, {"experts": hp_moe.ExpertParallel()})
    d = moe.experts.dispatcher
    rank = mesh.get_local_rank()
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 9 + 2 * j, 16, generator=g) for j in range(2)]  # uneven sizes
    handles = []
    for x in xs:
        s, i, _ = moe.router(x[rank])
        handles.append(d.dispatch_async(x[rank], s, i))
    outs = {}
    for j in (1, 0):
        tokens, counts, ctx = handles[j].wait()
        outs[j] = d.combine(moe.experts(tokens, counts), ctx)
    for j, x in enumerate(xs):
        torch.testing.assert_close(outs[j], ref(x)[rank], rtol=1e-5, atol=1e-5)
    return True


def test_microbatches_in_flight(pool):
    assert pool.run(_in_flight) == [True, True]


def _overflow():
    """A tight rows_per_peer drops what overflows, counts it, and equals the dropless layer
    with those copies taken out."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(1)
    moe = hp_moe.MoE(16, 8, 4, 2)
    parallelize_module(
        moe, mesh, {"experts": hp_moe.ExpertParallel(sync_free=True, rows_per_peer=3)}
    )
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(mesh.get_local_rank()))
    s, i, _ = moe.router(x)
    tokens, counts, ctx = moe.experts.dispatcher.dispatch(x, s, i)
    y = moe.experts.dispatcher.combine(moe.experts(tokens, counts), ctx)
    kept = int(ctx.keep.sum())
    assert kept + int(ctx.overflow) == 20 and int(ctx.overflow) > 0
    moe(x[None])  # the layer counts what overflowed among its dropped copies
    assert int(moe.dropped_tokens) == int(ctx.overflow)
    # the same drops through the exact dispatcher (keep given explicitly)
    exact = hp_moe.AllToAllDispatcher(4, mesh)
    t2, c2, ctx2 = exact.dispatch(x, s, i, keep=ctx.keep)
    y2 = exact.combine(moe.experts(t2, c2), ctx2)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    return int(ctx.overflow)


def test_sync_free_overflow_is_dropped_and_counted(pool):
    assert all(n > 0 for n in pool.run(_overflow))


def _errors():
    """Every rank raises before any collective (a collective after a one-rank error would
    hang); the pool's timeout would catch a hang."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    mesh2 = hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "tp"))
    found = []
    cases = [
        (
            hp_moe.MoE(16, 8, 3, 2),
            mesh,
            hp_moe.ExpertParallel(),
            hp_moe.MoEConfigError,
            "num_experts=3 is not divisible by the expert-parallel degree 2",
        ),
        (
            hp_moe.MoE(16, 8, 4, 2),
            mesh2,
            hp_moe.ExpertParallel(),
            MeshError,
            "expert-parallel mesh must be 1-D",
        ),
        (
            hp_moe.MoE(16, 8, 4, 2),
            mesh,
            hp_moe.ExpertTensorParallel(),
            MeshError,
            "needs a 2-D \\[ep, tp\\] mesh",
        ),
        (
            hp_moe.MoE(16, 8, 4, 2),
            mesh,
            hp_moe.ExpertParallel(dispatcher="nccl"),
            hp_moe.MoEConfigError,
            "dispatcher='nccl' is not one of",
        ),
        (hp_moe.MoE(16, 8, 4, 2), mesh2, hp_moe.TensorParallel(), MeshError, "needs a 1-D mesh"),
        (
            hp_moe.MoE(16, 8, 4, 2),
            mesh,
            hp_moe.ExpertParallel(rows_per_peer=4),
            hp_moe.MoEConfigError,
            "pass sync_free=True",
        ),
        (
            hp_moe.MoE(16, 8, 4, 2),
            mesh,
            hp_moe.ExpertParallel(sync_free=True, rows_per_peer=0),
            hp_moe.MoEConfigError,
            "rows_per_peer=0 must be a positive int",
        ),
    ]
    for moe, m, style, exc, match in cases:
        with pytest.raises(exc, match=match):
            parallelize_module(moe, m, {"experts": style})
        assert not isinstance(moe.experts.w1, hp.DTensor)  # nothing was distributed
        found.append(exc.__name__)
    with pytest.raises(hp_moe.DispatchError, match="applies to GroupedExperts"):
        parallelize_module(hp_moe.MoE(16, 8, 4, 2), mesh, {"router": hp_moe.ExpertParallel()})
    hp.get_platform("cpu").barrier()  # every rank is still in step
    return found


def test_errors_before_any_collective(pool):
    res = pool.run(_errors)
    assert res[0] == res[1] and len(res[0]) == 7


def _ep_capacity(style_kwargs):
    """Capacity drops under expert parallelism: each rank drops from its own tokens (capacity
    from its local count), so the reference runs each rank's slice as its own forward. Output,
    token gradients and every parameter gradient (a summed loss) match."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    rank = mesh.get_local_rank()
    torch.manual_seed(3)
    kw = dict(num_shared_experts=1, score_func="sigmoid", capacity_factor=0.6)
    ref = hp_moe.MoE(16, 8, 4, 2, **kw)
    moe = hp_moe.MoE(16, 8, 4, 2, **kw)
    moe.load_state_dict(ref.state_dict())
    parallelize_module(moe, mesh, {"experts": hp_moe.ExpertParallel(**style_kwargs)})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 9, 16, generator=g)
    up = torch.randn(2, 2, 9, 16, generator=g)
    xs = x[rank].clone().requires_grad_(True)
    out = moe(xs)
    (out * up[rank]).sum().backward()
    xr = x.clone().requires_grad_(True)
    refs = [ref(xr[r]) for r in range(2)]
    sum((o * u).sum() for o, u in zip(refs, up)).backward()
    torch.testing.assert_close(out, refs[rank].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad[rank], rtol=1e-5, atol=1e-5)
    assert int(moe.dropped_tokens) > 0
    platform = hp.get_platform("cpu")
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        if isinstance(p, hp.DTensor):  # expert shards: this rank's experts' gradients
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5)
        else:  # replicated: each rank saw its own tokens
            g = p.grad.clone()
            platform.all_reduce(g, "sum", mesh.get_group())
            torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    return True


@pytest.mark.parametrize(
    "style",
    [{}, {"sync_free": True}, {"dispatcher": "one_sided"}],
    ids=["a2a", "sync_free", "one_sided"],
)
def test_ep2_capacity_drops(pool, style):
    assert pool.run(_ep_capacity, style) == [True, True]
