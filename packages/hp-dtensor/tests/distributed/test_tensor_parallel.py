"""Tensor, sequence and loss parallelism; shard_module, custom_shard, DFunction (2 ranks).

A Llama-style block under TP=2, TP=2 with sequence parallelism, and a Layout-based plan must
match the single-device block (forward output, loss, every parameter gradient) over 5 AdamW
steps; the same plans through torch.distributed.tensor.parallel must give the same numbers.
"""

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.dirname(__file__))
import llama_block as lb  # noqa: E402

import hp_dtensor as hp  # noqa: E402
import hp_dtensor.parallel as hpp  # noqa: E402
from hp_dtensor import Layout, Replicate, Shard  # noqa: E402

pool = rank_pool_fixture(2)

B, S, DIM = 2, 6, 32
TOL = dict(rtol=1e-5, atol=1e-6)


def _styles(kind):
    return lb.tp_library(kind)[0]


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, DIM, generator=g), torch.randn(B, S, DIM, generator=g)


def _full_of(p):
    if isinstance(p, hp.DTensor):
        return p.full_tensor()
    if hasattr(p, "full_tensor"):  # torch DTensor
        return p.full_tensor()
    return p


def _train(variant, kind="ours"):
    """Returns per-step (loss, max grad error) after checking against the reference."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    ref = lb.Block()
    model = lb.Block()
    model.load_state_dict(ref.state_dict())
    cos, sin = lb.rope_tables(S, DIM // 4)
    if kind == "ours":
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    sp = variant == "tp_sp"
    if variant in ("tp", "tp_sp"):
        if kind == "ours":
            hpp.parallelize_module(model, mesh, lb.tp_plan(_styles(kind), sequence_parallel=sp))
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh, lb.tp_plan(_styles(kind), sequence_parallel=sp))
    elif variant == "layouts":
        _shard_with_layouts(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out_log = []
    for step in range(5):
        x, y = _data(step)
        ref_out = ref(x, cos, sin)
        ref_loss = F.mse_loss(ref_out, y)
        ref_opt.zero_grad()
        ref_loss.backward()
        if sp:
            xs = x.chunk(2, dim=1)[rank]
            out = model(xs, cos, sin)
            full = (
                hp.DTensor.from_local(
                    out, hp.init_device_mesh("cpu", (2,)), [Shard(1)]
                ).full_tensor()
                if kind == "ours"
                else _torch_gather_seq(out, mesh)
            )
        elif variant == "layouts":
            lay = Layout((2,), ("tp",))
            dx = hp.DTensor.from_local(x, lay("None", "None", "None"))
            dcos = hp.DTensor.from_local(cos, lay("None", "None"))
            dsin = hp.DTensor.from_local(sin, lay("None", "None"))
            full = model(dx, dcos, dsin).full_tensor()
        else:
            full = model(x, cos, sin)
        torch.testing.assert_close(full, ref_out, **TOL, msg=f"{variant} output step {step}")
        loss = F.mse_loss(full, y)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        opt.zero_grad()
        loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                _full_of(p.grad), q.grad, **TOL, msg=f"{variant}/{kind} grad {name} step {step}"
            )
        opt.step()
        ref_opt.step()
        out_log.append(loss.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (_full_of(p.detach()) - q.detach()).abs().max().item()
        assert err < 1e-5, f"{variant}/{kind} parameter {name} differs by {err:.3e}"
    placements = {
        n: str(tuple(str(x) for x in p.placements))
        for n, p in model.named_parameters()
        if hasattr(p, "placements")
    }
    return out_log, placements


def _torch_gather_seq(out, mesh):
    from torch.distributed import tensor as tdt

    return tdt.DTensor.from_local(out, mesh, [tdt.Shard(1)]).full_tensor()


def _shard_with_layouts(model):
    """The same TP plan written with Layouts: shard_module on the linears (outputs stay
    DTensors, so the whole block runs through sharding rules) and custom_shard on the
    attention core (local heads)."""
    lay = Layout((2,), ("tp",))
    rep3 = lay("None", "None", "None")
    col = {"parameter": {"weight": lay("tp", "None")}}
    row = {"parameter": {"weight": lay("None", "tp")}, "forward": {"output": (rep3,)}}
    for name in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "feed_forward.w1",
        "feed_forward.w3",
    ):
        hp.shard_module(model.get_submodule(name), col)
    for name in ("attention.wo", "feed_forward.w2"):
        hp.shard_module(model.get_submodule(name), row)
    for name in ("attention_norm", "ffn_norm"):
        hp.shard_module(model.get_submodule(name), {"parameter": {"weight": lay("None")}})
    heads = lay("None", "None", "tp", "None")
    model.attention.core = hp.custom_shard(
        lb.attention_core,
        in_layouts=(heads, heads, heads, lay("None", "None"), lay("None", "None")),
        out_layouts=(heads,),
    )


@pytest.mark.parametrize("variant", ["tp", "tp_sp", "layouts"])
def test_block_matches_single_device_over_adamw_steps(pool, variant):
    res = pool.run(_train, variant)
    assert res[0] == res[1]
    losses, placements = res[0]
    assert len(losses) == 5
    assert placements["attention.wq.weight"] == "('S(0)',)"
    if variant != "layouts":
        assert placements["attention.wo.weight"] == "('S(1)',)"


@pytest.mark.parametrize("variant", ["tp", "tp_sp"])
def test_torch_tensor_parallel_gives_the_same_numbers(pool, variant):
    ours = pool.run(_train, variant, "ours")[0][0]
    theirs = pool.run(_train, variant, "torch")[0][0]
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours, theirs)


def _styles_are_values():
    mesh = hp.init_device_mesh("cpu", (2,))
    style = hpp.ColwiseParallel()
    before = repr(style)
    a, b = nn.Linear(4, 6), nn.Linear(4, 8)
    style.apply(a, mesh)
    style.apply(b, mesh)
    assert repr(style) == before and hash(style) == hash(hpp.ColwiseParallel())
    x = torch.randn(3, 4)
    return tuple(a(x).shape), tuple(b(x).shape)


def test_one_style_serves_many_modules(pool):
    assert pool.run(_styles_are_values)[0] == ((3, 3), (3, 4))


def _errors():
    mesh = hp.init_device_mesh("cpu", (2,))
    msgs = {}
    try:
        hpp.parallelize_module(lb.Block(), mesh, {"attention.wqq": hpp.ColwiseParallel()})
    except hp.PlacementError as e:
        msgs["key"] = str(e)
    blk = lb.Block(n_heads=4, n_kv_heads=1)
    try:
        hpp.parallelize_module(blk, mesh, {"attention.w*": hpp.ColwiseParallel()})
    except hp.MeshError as e:
        msgs["heads"] = str(e)
    msgs["untouched"] = not isinstance(blk.attention.wq.weight, hp.DTensor)
    other = Layout((2,), ("tp",), rank_list=[1, 0])
    lin = nn.Linear(4, 4)
    hp.shard_module(lin, {"forward": {"input": (other("None", "None"),)}})
    x = hp.distribute_tensor(torch.randn(2, 4), mesh, [Replicate()])
    try:
        lin(x)
    except hp.MeshError as e:
        msgs["layout_mesh"] = str(e)
    try:
        hp.shard_module(lin, {"parameter": {"wieght": Layout((2,), ("tp",))("tp", "None")}})
    except hp.LayoutError as e:
        msgs["param"] = str(e)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    msgs["alive"] = t.item()
    return msgs


def test_errors_are_clear_and_early(pool):
    for m in pool.run(_errors):
        assert "'attention.wqq' matches no submodule" in m["key"] and "attention.wq" in m["key"]
        assert "n_kv_heads=1 is not divisible by the tensor-parallel degree 2" in m["heads"]
        assert m["untouched"]
        assert "Layout's mesh" in m["layout_mesh"]
        assert "'wieght'" in m["param"] and "weight" in m["param"]
        assert m["alive"] == 2.0


def _loss_parallel():
    mesh = hp.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.randint(0, 11, (2, 5), generator=g)
    target[0, 1] = -100
    head = nn.Linear(11, 11, bias=False)
    ref_head = nn.Linear(11, 11, bias=False)
    ref_head.load_state_dict(head.state_dict())
    hpp.parallelize_module(head, mesh, hpp.ColwiseParallel(use_local_output=False))
    results = {}
    for smoothing in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            head.zero_grad()
            ref_head.zero_grad()
            out = head(logits)
            assert out.placements == (Shard(-1 % 3),)
            with hpp.loss_parallel():
                loss = F.cross_entropy(
                    out.flatten(0, 1),
                    target.flatten(),
                    reduction=reduction,
                    label_smoothing=smoothing,
                )
                ref = F.cross_entropy(
                    ref_head(logits).flatten(0, 1),
                    target.flatten(),
                    reduction=reduction,
                    label_smoothing=smoothing,
                )
                torch.testing.assert_close(loss.full_tensor(), ref, **TOL)
                (loss.sum() if reduction == "none" else loss).backward()
            (ref.sum() if reduction == "none" else ref).backward()
            torch.testing.assert_close(head.weight.grad.full_tensor(), ref_head.weight.grad, **TOL)
            results[(smoothing, reduction)] = True
    # log_softmax + nll_loss stay sharded inside the context
    out = head(logits)
    with hpp.loss_parallel():
        lp = F.log_softmax(out, dim=-1)
        assert lp.placements == (Shard(2),)
        nll = F.nll_loss(lp.flatten(0, 1), target.flatten())
    ref = F.nll_loss(F.log_softmax(ref_head(logits), -1).flatten(0, 1), target.flatten())
    torch.testing.assert_close(nll.full_tensor(), ref, **TOL)
    # outside the context log_softmax gathers the class dim instead
    assert F.log_softmax(out, dim=-1).placements == (Replicate(),)
    return len(results)


def test_loss_parallel_equals_full_cross_entropy(pool):
    assert pool.run(_loss_parallel) == [6, 6]


def _dfunction_and_skip():
    mesh = hp.init_device_mesh("cpu", (2,))

    class ScaledMatmul(hp.DFunction):
        in_layouts = ((Shard(0),), (Replicate(),))
        out_layouts = ((Shard(0),),)
        reduce_grads = {1: "sum"}

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return 2 * x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return 2 * g @ w.T, 2 * x.T @ g

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 3, generator=g)
    dx = hp.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    dw = hp.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    out = ScaledMatmul.apply(dx, dw)
    assert out.placements == (Shard(0),)
    out.pow(2).sum().backward()
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    (2 * rx @ rw).pow(2).sum().backward()
    torch.testing.assert_close(out.full_tensor(), 2 * x @ w)
    torch.testing.assert_close(dx.grad.full_tensor(), rx.grad)
    torch.testing.assert_close(dw.grad.full_tensor(), rw.grad)
    # SkipDTensorDispatch: local ops, in-place keeps identity
    p = hp.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with hp.SkipDTensorDispatch():
        q = p.mul_(3)
        local_sum = p.sum()
    assert q is p and not isinstance(local_sum, hp.DTensor)
    return local_sum.item(), p.full_tensor().sum().item()


def test_dfunction_and_skip_dispatch(pool):
    assert pool.run(_dfunction_and_skip) == [(12.0, 24.0), (12.0, 24.0)]


def _rope_rule():
    mesh = hp.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 6, 4, 8, generator=g), torch.randn(2, 6, 2, 8, generator=g)
    cos, sin = lb.rope_tables(6, 8)
    rq, rk = hp.rotary_position_embedding(q, k, cos, sin)
    seen = []
    for pl in ([Shard(0)], [Shard(1)], [Shard(2)], [Shard(3)]):
        dq = hp.distribute_tensor(q, mesh, pl)
        dk = hp.distribute_tensor(k, mesh, pl)
        dc = hp.distribute_tensor(cos, mesh, [Replicate()])
        ds = hp.distribute_tensor(sin, mesh, [Replicate()])
        oq, ok = hp.rotary_position_embedding(dq, dk, dc, ds)
        torch.testing.assert_close(oq.full_tensor(), rq)
        torch.testing.assert_close(ok.full_tensor(), rk)
        seen.append(str(oq.placements[0]))
    return seen


def test_rotary_op_keeps_batch_heads_and_sequence_sharding(pool):
    assert pool.run(_rope_rule)[0] == ["S(0)", "S(1)", "S(2)", "R"]


def _embedding_and_prepare_styles():
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ids = torch.tensor([[0, 5, 9, 3], [7, 7, 1, 8]])
    out = {}
    for name, style in (
        ("rowwise", hpp.RowwiseParallel()),  # vocab sharded, partial sums all-reduced
        ("rowwise_sp", hpp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)),
        ("colwise", hpp.ColwiseParallel(output_layouts=Replicate())),
    ):
        ref = nn.Embedding(11, 6)
        emb = nn.Embedding(11, 6)
        emb.load_state_dict(ref.state_dict())
        hpp.parallelize_module(emb, mesh, style)
        y = emb(ids)
        full = y.full_tensor() if isinstance(y, hp.DTensor) else y
        torch.testing.assert_close(full, ref(ids), **TOL)
        (full * torch.arange(6.0)).sum().backward()
        (ref(ids) * torch.arange(6.0)).sum().backward()
        torch.testing.assert_close(emb.weight.grad.full_tensor(), ref.weight.grad, **TOL)
        out[name] = str(emb.weight.placements[0])
    # PrepareModuleOutput / PrepareModuleInputOutput on a plain module
    lin = nn.Linear(4, 4)
    hpp.parallelize_module(
        lin,
        mesh,
        hpp.PrepareModuleInputOutput(
            input_layouts=(Shard(0),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(0),),
            use_local_output=True,
        ),
    )
    ref_lin = nn.Linear(4, 4)
    ref_lin.load_state_dict(
        {
            k: v.full_tensor() if isinstance(v, hp.DTensor) else v
            for k, v in lin.state_dict().items()
        }
    )
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    rank = torch.distributed.get_rank()
    local_out = lin(x.chunk(2)[rank])  # local rows in, gathered, local rows of the result out
    torch.testing.assert_close(local_out, ref_lin(x).chunk(2)[rank], **TOL)
    # SequenceParallel dropout: the mask is the slice of the single-process mask
    drop = nn.Dropout(0.5)
    hpp.parallelize_module(drop, mesh, hpp.SequenceParallel())
    hp.manual_seed(9, mesh)
    z = drop(torch.ones(2, 6, 4).chunk(2, dim=1)[rank])
    torch.manual_seed(9)
    ref_z = F.dropout(torch.ones(2, 6, 4), 0.5, True)
    torch.testing.assert_close(z.full_tensor(), ref_z)
    out["dropout"] = str(z.placements[0])
    return out


def test_embedding_styles_prepare_styles_and_sp_dropout(pool):
    res = pool.run(_embedding_and_prepare_styles)[0]
    assert res == {"rowwise": "S(0)", "rowwise_sp": "S(0)", "colwise": "S(1)", "dropout": "S(1)"}


def _gathered(order):
    """NOTE [Gathered activations]: an all-gathered activation read by split and replicated
    consumers in either order gives single-process gradients."""
    mesh = hp.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(4)
    x, w, a = (
        torch.randn(4, 6, generator=g),
        torch.randn(6, 4, generator=g),
        torch.randn(4, 4, generator=g),
    )
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    xs = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    ws = hp.distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()
    gx = xs.redistribute(mesh, [Replicate()])
    assert gx.placements == (Replicate(),)
    terms, ref_terms = [], []
    for kind in order:
        if kind == "split":
            terms.append((torch.mm(gx, ws).full_tensor() * a).sum())
            ref_terms.append(((rx @ rw) * a).sum())
        elif kind == "replicated":
            terms.append((gx * 3).sum().full_tensor())
            ref_terms.append((rx * 3).sum())
        elif kind == "to_local":
            terms.append(gx.to_local().pow(2).sum())
            ref_terms.append(rx.pow(2).sum())
        elif kind == "view":
            terms.append(gx.view(24).sum().full_tensor())
            ref_terms.append(rx.view(24).sum())
    sum(terms).backward()
    sum(ref_terms).backward()
    torch.testing.assert_close(xs.grad.full_tensor(), rx.grad, **TOL)
    if rw.grad is not None:
        torch.testing.assert_close(ws.grad.full_tensor(), rw.grad, **TOL)
    return sorted(gx._gr["gather"].state.values()) if gx._gr else None


@pytest.mark.parametrize(
    "order",
    [
        ("split", "split"),
        ("split", "replicated"),
        ("replicated", "split"),
        ("split", "to_local"),
        ("to_local",),
        ("split", "view", "split"),
    ],
)
def test_gathered_activation_gradients_in_any_order(pool, order):
    states = pool.run(_gathered, order)[0]
    assert states == (["partial"] if order[0] == "split" else ["exact"])


class _Counting:
    """A CollectiveMatmul over the reference kernels that counts its calls."""

    def __init__(self):
        self.calls = {"ag": 0, "rs": 0}

        def ag(*a, **k):
            self.calls["ag"] += 1
            return hpp.UNFUSED.all_gather_matmul(*a, **k)

        def rs(*a, **k):
            self.calls["rs"] += 1
            return hpp.UNFUSED.matmul_reduce_scatter(*a, **k)

        self.kernels = hpp.CollectiveMatmul(ag, rs, name="counting")


def _mlp_collective_matmul(fused: bool):
    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(2, 8, 16)
    ref = down(F.gelu(up(x)))
    ref.square().sum().backward()
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    r = torch.distributed.get_rank()
    pu, pd = nn.Linear(16, 32), nn.Linear(32, 16)
    pu.load_state_dict(up.state_dict())
    pd.load_state_dict(down.state_dict())
    count = _Counting()
    kw = {"collective_matmul": count.kernels} if fused else {}
    hpp.parallelize_module(pu, mesh, hpp.ColwiseParallel(input_layouts=Shard(1), **kw))
    hpp.parallelize_module(pd, mesh, hpp.RowwiseParallel(output_layouts=Shard(1), **kw))
    xl = x.chunk(2, dim=1)[r].clone().requires_grad_(True)
    out = pd(F.gelu(pu(xl)))  # this rank's half of the sequence
    out.square().sum().backward()
    torch.testing.assert_close(out, ref.chunk(2, dim=1)[r])
    for mine, theirs in ((pu, up), (pd, down)):
        for name in ("weight", "bias"):
            g = getattr(mine, name).grad
            torch.testing.assert_close(g.full_tensor(), getattr(theirs, name).grad)
    return count.calls, xl.grad


def test_collective_matmul_matches_the_unfused_styles(pool):
    fused = pool.run(_mlp_collective_matmul, True)
    plain = pool.run(_mlp_collective_matmul, False)
    # forward: one all-gather-matmul (colwise), one matmul-reduce-scatter (rowwise);
    # backward: the same pair the other way round
    assert [c for c, _ in fused] == [{"ag": 2, "rs": 2}] * 2
    for (_, a), (_, b) in zip(fused, plain):
        torch.testing.assert_close(a, b)


def test_collective_matmul_needs_a_sequence_layout():
    with pytest.raises(hp.PlacementError, match="input_layouts must be Shard"):
        hpp.ColwiseParallel(collective_matmul=hpp.UNFUSED)
    with pytest.raises(hp.PlacementError, match="output_layouts must be Shard"):
        hpp.RowwiseParallel(output_layouts=Shard(-1), collective_matmul=hpp.UNFUSED)
    with pytest.raises(hp.HPDTensorTypeError, match="collective_matmul='mc2'"):
        hpp.RowwiseParallel(output_layouts=Shard(1), collective_matmul="mc2")


def _collective_matmul_autocast_and_copy():
    import copy

    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    r = torch.distributed.get_rank()
    x = torch.randn(2, 8, 32).chunk(2, dim=1)[r].contiguous()
    outs = {}
    for fused in (False, True):
        torch.manual_seed(1)
        m = nn.Linear(32, 16)
        kw = {"collective_matmul": hpp.UNFUSED} if fused else {}
        hpp.parallelize_module(m, mesh, hpp.ColwiseParallel(input_layouts=Shard(1), **kw))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 matmuls
            y = m(x)
        y.float().square().sum().backward()
        outs[fused] = (y, m.weight.grad.to_local().clone())
        if fused:
            twin = copy.deepcopy(m)  # computes with its own weights
            with torch.no_grad():
                twin.weight.to_local().zero_()
                twin.bias.to_local().zero_()
            outs["twin"] = twin(x)
    return outs


def test_collective_matmul_under_autocast_and_deepcopy(pool):
    for outs in pool.run(_collective_matmul_autocast_and_copy):
        (y0, g0), (y1, g1) = outs[False], outs[True]
        assert y0.dtype == y1.dtype == torch.bfloat16
        # bf16 products: the bias is added after the matmul's rounding in one, inside it in
        # the other
        torch.testing.assert_close(y1, y0, atol=2e-3, rtol=2e-2)
        torch.testing.assert_close(g1, g0, atol=2e-2, rtol=2e-2)
        assert outs["twin"].abs().max() == 0  # not the original's weights
