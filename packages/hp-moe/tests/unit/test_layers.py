"""Single-process tests of the building blocks, load balancing and the local dispatcher."""

import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moe_helpers import loop_experts, reference_moe  # noqa: E402

import hp_moe  # noqa: E402
from hp_moe import (  # noqa: E402
    FeedForward,
    GroupedExperts,
    MoE,
    MoEAuxLossAutoScaler,
    MoEConfigError,
    TokenChoiceTopKRouter,
    update_expert_bias,
)
from hp_moe._balance import capacity_keep  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# -- experts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dim,hidden,counts",
    [
        (16, 8, [3, 0, 7, 0]),  # aligned: one grouped GEMM per projection
        (6, 5, [2, 4, 0, 1]),  # unaligned rows: the loop fallback
        (16, 8, [0, 0, 0, 0]),  # no rows at all
    ],
)
def test_grouped_experts_equal_a_loop(dim, hidden, counts):
    torch.manual_seed(0)
    ex = GroupedExperts(dim, hidden, len(counts))
    c = torch.tensor(counts)
    x = torch.randn(int(c.sum()), dim, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    w = [getattr(ex, n).detach().clone().requires_grad_(True) for n in ("w1", "w2", "w3")]
    out = ex(x, c)
    ref = loop_experts(x2, c, *w)
    torch.testing.assert_close(out, ref, **TOL)
    up = torch.randn_like(out)
    out.backward(up)
    if ref.requires_grad:
        ref.backward(up)
        torch.testing.assert_close(x.grad, x2.grad, **TOL)
        for name, r in zip(("w1", "w2", "w3"), w):
            torch.testing.assert_close(getattr(ex, name).grad, r.grad, **TOL)
    assert hp_moe.grouped_mm_supported(x.detach(), ex.w1.detach()) == (
        dim % 4 == 0 and hidden % 4 == 0
    )


def test_grouped_experts_bf16_and_rows_after_the_groups():
    torch.manual_seed(1)
    ex = GroupedExperts(16, 32, 3).to(torch.bfloat16)
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    c = torch.tensor([4, 0, 5])  # rows 9..11 belong to no expert (dropped copies)
    out = ex(x, c)
    ref = loop_experts(x[:9].float(), c, *(getattr(ex, n).float() for n in ("w1", "w2", "w3")))
    torch.testing.assert_close(out[:9].float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(MoEConfigError, match="one count per local expert"):
        ex(x, torch.tensor([4, 8]))


def test_feed_forward_is_swiglu():
    ff = FeedForward(8, 12)
    x = torch.randn(3, 8)
    ref = ff.w2(F.silu(ff.w1(x)) * ff.w3(x))
    torch.testing.assert_close(ff(x), ref)
    assert [n for n, _ in ff.named_children()] == ["w1", "w2", "w3"]


# -- router -------------------------------------------------------------------------------------


def test_expert_bias_changes_choice_not_gate_values():
    torch.manual_seed(2)
    r = TokenChoiceTopKRouter(8, 6, 2, score_func="sigmoid")
    x = torch.randn(20, 8)
    s0, i0, scores = r(x)
    bias = torch.tensor([5.0, 0, 0, 0, 0, 0])  # expert 0 is chosen by every token
    s1, i1, _ = r(x, bias)
    assert (i1 == 0).any(-1).all()
    torch.testing.assert_close(s1, scores.gather(-1, i1))  # gate values: unbiased scores
    torch.testing.assert_close(s0, scores.gather(-1, i0))


def test_group_limited_routing_matches_brute_force():
    torch.manual_seed(3)
    E, G, L, k = 12, 4, 2, 3
    r = TokenChoiceTopKRouter(
        8, E, k, score_func="sigmoid", num_expert_groups=G, num_limited_groups=L
    )
    x = torch.randn(30, 8)
    bias = torch.randn(E) * 0.1
    _, idx, scores = r(x, bias)
    choice = scores + bias
    for t in range(x.shape[0]):
        grp = choice[t].view(G, E // G)
        gscore = grp.topk(2, -1).values.sum(-1)
        keep = set(gscore.topk(L).indices.tolist())
        allowed = [e for e in range(E) if e // (E // G) in keep]
        best = sorted(allowed, key=lambda e: -choice[t, e].item())[:k]
        assert sorted(idx[t].tolist()) == sorted(best)


def test_route_norm_and_scale():
    torch.manual_seed(4)
    r = TokenChoiceTopKRouter(8, 6, 3, score_func="softmax", route_norm=True, route_scale=2.0)
    s, _, _ = r(torch.randn(5, 8))
    torch.testing.assert_close(s.sum(-1), torch.full((5,), 2.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=9), "top_k=9 is larger than num_experts=8"),
        (dict(num_expert_groups=3, num_limited_groups=1), "does not divide num_experts=8"),
        (dict(num_expert_groups=4, num_limited_groups=5), "num_limited_groups=5 must lie"),
        (dict(num_expert_groups=4), "needs both"),
        (dict(score_func="relu"), "score_func='relu' is not one of"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0 must be a positive"),
        (dict(capacity_factor=-1), "capacity_factor=-1 must be a positive"),
        (dict(aux_loss_type="token"), "aux_loss_type='token'"),
        (dict(load_balance_coeff=-0.1), "load_balance_coeff=-0.1 must be a number >= 0"),
        (dict(num_expert_groups=4, num_limited_groups=1, top_k=3), "top_k=3 exceeds the 2"),
    ],
)
def test_config_errors(kwargs, match):
    args = dict(top_k=2)
    args.update(kwargs)
    top_k = args.pop("top_k")
    with pytest.raises(MoEConfigError, match=match):
        MoE(16, 8, 8, top_k, **args)


# -- the layer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func,shared", [("softmax", 0), ("sigmoid", 2)])
def test_moe_equals_its_definition(score_func, shared):
    torch.manual_seed(5)
    moe = MoE(16, 8, 6, 2, num_shared_experts=shared, score_func=score_func, route_norm=True)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), **TOL)


def test_two_microbatches_in_flight_do_not_mix():
    """dispatch A, dispatch B, combine B, combine A: each equals its own forward."""
    torch.manual_seed(6)
    moe = MoE(16, 8, 4, 2)
    d = moe.experts.dispatcher
    xs = [torch.randn(7, 16), torch.randn(5, 16)]
    routed = [moe.router(x) for x in xs]
    flights = [d.dispatch(x, s, i) for x, (s, i, _) in zip(xs, routed)]
    outs = [None, None]
    for j in (1, 0):
        tokens, counts, ctx = flights[j]
        outs[j] = d.combine(moe.experts(tokens, counts), ctx)
    for j, x in enumerate(xs):
        torch.testing.assert_close(outs[j], reference_moe(moe, x[None])[0], **TOL)


def test_capacity_drops_lowest_scores_deterministically():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.6], [0.95, 0.5]])
    idx = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    # 8 copies, 2 experts, factor 0.5 -> capacity 2 per expert
    keep = capacity_keep(scores, idx, 2, 0.5)
    # expert 0: scores 0.9, 0.8, 0.7, 0.5 -> keeps 0.9 and 0.8; expert 1: 0.1, 0.2, 0.6, 0.95
    assert keep.tolist() == [[True, False], [True, False], [False, True], [True, False]]
    ties = capacity_keep(torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.long), 1, 0.5)
    assert ties.view(-1).tolist() == [True, True, False, False]  # earlier tokens first


def test_capacity_factor_in_the_layer_drops_and_counts():
    torch.manual_seed(7)
    moe = MoE(16, 8, 4, 2, capacity_factor=0.5)
    x = torch.randn(1, 12, 16, requires_grad=True)
    out = moe(x)
    flat = x.reshape(-1, 16)
    s, i, _ = moe.router(flat)
    keep = capacity_keep(s, i, 4, 0.5)
    assert int(moe.dropped_tokens) == int((~keep).sum()) > 0
    ref = reference_moe(moe, x.detach())[0]  # dropless reference minus the dropped copies
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(12):
        for j in range(2):
            if not keep[t, j]:
                e = int(i[t, j])
                h = F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])
                ref[t] = ref[t] - s[t, j] * (w2[e] @ h)
    torch.testing.assert_close(out[0], ref, **TOL)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


class _PoisonedGroupedMM(torch.autograd.Function):
    """grouped_mm whose rows outside every expert's block are NaN, forward and backward (the
    kernels leave them unspecified): nothing may read them."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        end = int(offsets[-1]) if offsets.numel() else 0
        out = loop_grouped(x, w, offsets)
        out[end:] = float("nan")
        return out

    @staticmethod
    def backward(ctx, g):
        x, w, offsets = ctx.saved_tensors
        with torch.enable_grad():
            xx, ww = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            out = loop_grouped(xx, ww, offsets)
            dx, dw = torch.autograd.grad(out, (xx, ww), torch.nan_to_num(g, nan=0.0))
        end = int(offsets[-1]) if offsets.numel() else 0
        dx = dx.clone()
        dx[end:] = float("nan")
        return dx, dw, None


def loop_grouped(x, w, offsets):
    out = x.new_zeros((x.shape[0], w.shape[1]))
    bounds = [0, *offsets.tolist()]
    for e in range(w.shape[0]):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e] : bounds[e + 1]] = x[bounds[e] : bounds[e + 1]] @ w[e].T
    return out


def test_dropped_rows_never_reach_outputs_or_gradients(monkeypatch):
    """Copies dropped over capacity sit after every expert's rows, where the grouped GEMM
    leaves garbage (NaN here): the output and every gradient stay finite and exact."""
    import hp_moe._experts as ex

    torch.manual_seed(11)
    moe = MoE(16, 8, 4, 2, capacity_factor=0.5, aux_loss_coeff=0.1, aux_loss_type="batch")
    x = torch.randn(1, 12, 16, requires_grad=True)
    out = moe(x)
    out.backward(torch.ones_like(out))
    clean = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    x.grad = None
    monkeypatch.setattr(ex, "grouped_mm", lambda a, w, offs: _PoisonedGroupedMM.apply(a, w, offs))
    out2 = moe(x)
    out2.backward(torch.ones_like(out2))
    torch.testing.assert_close(out2, out)
    for a, b in zip(clean, [x.grad] + [p.grad for p in moe.parameters()]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


# -- load balancing -------------------------------------------------------------------------------


def _aux_by_hand(scores, idx, kind, b, s, score_func):
    e, k = scores.shape[-1], idx.shape[-1]
    p = scores / scores.sum(-1, keepdim=True) if score_func == "sigmoid" else scores
    hits = torch.zeros_like(scores).scatter_(-1, idx, 1.0)
    if kind == "sequence":
        f = hits.view(b, s, e).sum(1) * e / (k * s)
        return (f * p.view(b, s, e).mean(1)).sum(-1).mean()
    f = hits.sum(0) * e / (k * p.shape[0])
    return (f * p.mean(0)).sum()


@pytest.mark.parametrize("kind", ["sequence", "batch"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_value_and_gradient(kind, score_func):
    torch.manual_seed(8)
    coeff = 0.3
    moe = MoE(16, 8, 6, 2, score_func=score_func, aux_loss_coeff=coeff, aux_loss_type=kind)
    x = torch.randn(3, 4, 16)
    out = moe(x)
    up = torch.randn_like(out)
    out.backward(up)
    got = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    # the reference: main branch without the loss, plus coeff * the loss written out by hand
    moe.aux_loss_coeff = 0.0
    out2 = moe(x)
    s, i, scores = moe.router(x.reshape(-1, 16))
    ref_aux = _aux_by_hand(scores, i, kind, 3, 4, score_func)
    ((out2 * up).sum() + coeff * ref_aux).backward()
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(moe.aux_loss_total, ref_aux.detach(), **TOL)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=n)


def test_global_aux_loss_needs_the_step_hook():
    moe = MoE(16, 8, 4, 2, aux_loss_coeff=0.1, aux_loss_type="global")
    with pytest.raises(hp_moe.DispatchError, match="register_expert_bias_update"):
        moe(torch.randn(1, 4, 16))


def test_global_aux_loss_accumulates_over_microbatches():
    """One process, two microbatches: f of the second uses both microbatches' counts."""
    torch.manual_seed(9)
    moe = MoE(16, 8, 4, 2, aux_loss_coeff=1.0, aux_loss_type="global")
    hp_moe.set_load_balance_group(moe, None)
    xs = [torch.randn(2, 3, 16), torch.randn(2, 5, 16)]
    counts, tokens = torch.zeros(4), 0
    expected = []
    for x in xs:
        _, i, scores = moe.router(x.reshape(-1, 16))
        counts += torch.zeros_like(scores).scatter_(-1, i, 1.0).sum(0)
        tokens += scores.shape[0]
        f = counts * 4 / (2 * tokens)
        expected.append((f * scores.mean(0)).sum())
        moe(x)
    torch.testing.assert_close(moe.aux_loss_total, sum(expected).detach(), **TOL)
    update_expert_bias(moe)  # a new step: counts start again
    assert moe.global_counts.abs().sum() == 0 and moe.aux_loss_total == 0


def test_aux_auto_scaler():
    out = torch.randn(3, requires_grad=True)
    aux = torch.tensor(2.0, requires_grad=True)
    y = MoEAuxLossAutoScaler.apply(out, aux, 0.25)
    torch.testing.assert_close(y, out)
    y.sum().backward()
    assert aux.grad.item() == 0.25 and torch.equal(out.grad, torch.ones(3))


def test_update_expert_bias_rule_and_hook():
    moe = MoE(16, 8, 4, 2, load_balance_coeff=0.1)
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 5.0, 7.0]))
    delta = 0.1 * torch.sign(torch.tensor(6.0) - torch.tensor([10.0, 2.0, 5.0, 7.0]))
    delta -= delta.mean()
    update_expert_bias(moe)
    torch.testing.assert_close(moe.expert_bias, delta)
    assert moe.tokens_per_expert.sum() == 0
    # the hook: counts of two forwards (a whole step) move the bias once, before the step
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    hp_moe.register_expert_bias_update(opt, moe)
    before = moe.expert_bias.clone()
    for _ in range(2):
        moe(torch.randn(1, 6, 16)).sum().backward()
    counts = moe.tokens_per_expert.clone()
    assert counts.sum() == 2 * 6 * 2
    opt.step()
    d = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, before + d - d.mean())


def test_init_buffers_after_to_empty():
    """Built on the meta device and materialised with to_empty, the buffers hold garbage
    until init_buffers zeroes them."""
    with torch.device("meta"):
        moe = MoE(16, 8, 4, 2, load_balance_coeff=0.1)
    moe.to_empty(device="cpu")
    for name in ("expert_bias", "tokens_per_expert", "aux_loss_total", "global_counts"):
        getattr(moe, name).fill_(7.0)
    moe.init_buffers()
    for name, buf in moe.named_buffers():
        assert buf.abs().sum() == 0, name


def test_zero_load_balance_coeff_keeps_a_fixed_bias():
    """0 keeps the bias (loaded from a checkpoint, say) routing but never moves it."""
    moe = MoE(16, 8, 4, 2, load_balance_coeff=0)
    assert "expert_bias" in moe.state_dict()
    moe.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 5.0]))
    moe(torch.randn(2, 6, 16)).sum().backward()
    assert set(torch.nonzero(moe.tokens_per_expert).flatten().tolist()) == {0, 3}  # it routes
    update_expert_bias(moe)
    assert moe.expert_bias.tolist() == [5.0, 0.0, 0.0, 5.0]
    assert moe.tokens_per_expert.sum() == 0


def test_tokens_counted_once_under_checkpoint_and_routing_replayed():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(10)
    moe = MoE(16, 8, 4, 2, load_balance_coeff=0.1, aux_loss_coeff=0.1, aux_loss_type="batch")
    x = torch.randn(2, 6, 16, requires_grad=True)
    seen = []
    hook = moe.router.register_forward_hook(lambda m, a, o: seen.append(o[1].clone()))
    out = checkpoint(moe, x, use_reentrant=False)
    out.backward(torch.ones_like(out))
    hook.remove()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # recomputed: the same routing
    assert moe.tokens_per_expert.sum() == 2 * 6 * 2  # counted once
    g_ckpt = {n: p.grad.clone() for n, p in moe.named_parameters()}
    aux_once = moe.aux_loss_total.clone()
    moe.zero_grad()
    moe.tokens_per_expert.zero_()
    moe.aux_loss_total.zero_()
    out = moe(x)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(moe.aux_loss_total, aux_once)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(g_ckpt[n], p.grad, msg=n)


def test_eval_mode_counts_nothing():
    moe = MoE(16, 8, 4, 2, load_balance_coeff=0.1, aux_loss_coeff=0.1).eval()
    with torch.no_grad():
        moe(torch.randn(1, 5, 16))
    assert moe.tokens_per_expert.sum() == 0 and moe.aux_loss_total == 0


def test_state_dict_keys_and_deepcopy():
    import copy

    moe = MoE(16, 8, 4, 2, num_shared_experts=1, load_balance_coeff=0.1)
    keys = set(moe.state_dict())
    assert "expert_bias" in keys and "tokens_per_expert" not in keys
    assert {"experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= keys
    twin = copy.deepcopy(moe)
    x = torch.randn(1, 3, 16)
    torch.testing.assert_close(twin(x), moe(x))


def test_all_combinations_run_forward_backward():
    """Every switch together (a smoke check beside the exact tests above)."""
    for score_func, shared, groups in itertools.product(("softmax", "sigmoid"), (0, 1), (0, 1)):
        kw = dict(num_expert_groups=2, num_limited_groups=1) if groups else {}
        moe = MoE(
            16,
            8,
            4,
            2,
            num_shared_experts=shared,
            score_func=score_func,
            load_balance_coeff=0.01,
            aux_loss_coeff=0.01,
            capacity_factor=1.5,
            **kw,
        )
        out = moe(torch.randn(2, 3, 16))
        out.backward(torch.randn_like(out))
        assert all(p.grad is not None for p in moe.parameters())


def test_aux_loss_refused_under_reentrant_checkpointing():
    from torch.utils.checkpoint import checkpoint

    moe = MoE(16, 8, 4, 2, aux_loss_coeff=0.1, aux_loss_type="batch")
    x = torch.randn(1, 6, 16, requires_grad=True)
    out = checkpoint(moe, x, use_reentrant=True)
    with pytest.raises(hp_moe.DispatchError, match="use_reentrant=False"):
        out.sum().backward()
    # without an auxiliary loss reentrant checkpointing is fine, and counts once
    moe2 = MoE(16, 8, 4, 2, load_balance_coeff=0.1)
    checkpoint(moe2, x, use_reentrant=True).sum().backward()
    assert moe2.tokens_per_expert.sum() == 12


def test_balance_buffers_stay_float32_under_a_dtype_cast():
    moe = MoE(16, 8, 4, 2, load_balance_coeff=1e-3).to(torch.bfloat16)
    assert moe.experts.w1.dtype == torch.bfloat16
    for name in ("expert_bias", "tokens_per_expert", "aux_loss_total", "global_counts"):
        assert getattr(moe, name).dtype == torch.float32, name
    moe.expert_bias.fill_(0.5)
    moe.tokens_per_expert.copy_(torch.tensor([4049.0, 4031.0, 4096.0, 4225.0]))
    update_expert_bias(moe)
    delta = 1e-3 * torch.sign(
        moe.expert_bias.new_tensor([4049.0, 4031.0, 4096.0, 4225.0]).mean()
        - torch.tensor([4049.0, 4031.0, 4096.0, 4225.0])
    )
    torch.testing.assert_close(moe.expert_bias, 0.5 + delta - delta.mean())


def test_deepcopy_keeps_the_unset_marker_and_shares_groups():
    import copy

    moe = MoE(16, 8, 4, 2, aux_loss_coeff=0.1, aux_loss_type="global")
    twin = copy.deepcopy(moe)
    with pytest.raises(hp_moe.DispatchError, match="register_expert_bias_update"):
        twin(torch.randn(1, 4, 16))
    hp_moe.set_load_balance_group(moe, None)
    twin2 = copy.deepcopy(moe)
    assert twin2.balance_group is None
    twin2(torch.randn(1, 4, 16))


def test_aux_loss_scale_scales_its_gradient():
    torch.manual_seed(12)
    moe = MoE(16, 8, 4, 2, aux_loss_coeff=0.5, aux_loss_type="batch")
    x = torch.randn(2, 3, 16)
    grads = []
    for scale in (1.0, 0.25):
        hp_moe.set_aux_loss_scale(moe, scale)
        moe.zero_grad()
        out = moe(x)
        (out * 0).sum().backward()  # only the auxiliary loss has a gradient
        grads.append(moe.router.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 0.25)
    with pytest.raises(MoEConfigError, match="scale=0"):
        hp_moe.set_aux_loss_scale(moe, 0)


def test_grouped_mm_of_fake_tensors_runs_balanced():
    """Under FakeTensorMode (hp-plan's dry run) the offsets cannot be read: the fp32 loop of
    matmuls splits the rows evenly over the experts, with the output a real call has."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_moe import grouped_mm

    x, w = torch.randn(10, 8), torch.randn(3, 6, 8)
    offsets = torch.tensor([4, 7, 10], dtype=torch.int32)
    real = grouped_mm(x, w, offsets)
    with FakeTensorMode() as mode:
        out = grouped_mm(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(offsets))
    assert out.shape == real.shape == (10, 6) and out.dtype == real.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_moe_layer_equals_eager_and_does_not_recompile_with_the_routing(dtype):
    """A MoE layer without expert parallelism under torch.compile (as ``training.compile``
    traces it inside its block): the same output, gradients and token counts as eager over
    three batches that route differently, and no new graph after the first batch. bf16 takes
    the grouped GEMM (counts read on the device); fp32 on CPU the loop of matmuls, which is
    never traced (its bounds are host values): a graph break, not a graph per routing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    kw = dict(num_shared_experts=1, score_func="sigmoid", route_norm=True, load_balance_coeff=0.0)
    eager = MoE(16, 32, 4, 2, **kw).to(dtype)
    traced = MoE(16, 32, 4, 2, **kw).to(dtype)
    traced.load_state_dict(eager.state_dict())
    step = torch.compile(traced)
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    graphs = []
    for seed in range(3):
        x = torch.randn(2, 6, 16, generator=_gen(seed)).to(dtype)
        outs = []
        for fn, m in ((eager, eager), (step, traced)):
            xi = x.clone().requires_grad_(True)
            out = fn(xi)
            out.float().pow(2).sum().backward()
            outs.append((out, xi.grad, m.router.gate.weight.grad.clone(), m.experts.w2.grad))
            m.zero_grad(set_to_none=True)
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, **tol)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs
    assert torch.equal(traced.tokens_per_expert, eager.tokens_per_expert)
    assert int(eager.tokens_per_expert.sum()) == 3 * 12 * 2


def test_hoisted_recompute_check_under_checkpointing_counts_each_forward_once():
    """``hoist_recompute_check`` around a compiled region holding a MoE layer, under
    non-reentrant activation checkpointing: the recomputation runs the compiled graph again
    without recording, so the token counts are those of the eager forwards (counted once),
    with the same outputs and gradients; no graph break (the check is read before the call)
    and at most two graphs (forward, recomputation). Outside the wrapper the layer checks for
    itself, and the flag is put back after each call."""
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    kw = dict(num_shared_experts=1, score_func="sigmoid", load_balance_coeff=0.0)
    eager = MoE(16, 32, 4, 2, **kw).to(torch.bfloat16)
    traced = MoE(16, 32, 4, 2, **kw).to(torch.bfloat16)
    traced.load_state_dict(eager.state_dict())
    region = hp_moe.hoist_recompute_check(torch.compile(traced.forward), traced)
    for seed in range(2):
        x = torch.randn(2, 6, 16, generator=_gen(seed)).to(torch.bfloat16)
        grads = []
        for fn in (eager, region):
            xi = x.clone().requires_grad_(True)
            out = checkpoint(fn, xi, use_reentrant=False)
            out.float().pow(2).sum().backward()
            grads.append((out.detach(), xi.grad))
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
        assert traced._recomputing is None
    assert torch.equal(traced.tokens_per_expert, eager.tokens_per_expert)
    assert int(eager.tokens_per_expert.sum()) == 2 * 12 * 2  # each forward counted once
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
    assert hp_moe.hoist_recompute_check(len, torch.nn.Linear(2, 2)) is len  # no MoE: unchanged
