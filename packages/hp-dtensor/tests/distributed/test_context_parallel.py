"""Context parallelism on 2 and 4 gloo ranks against SDPA on the whole sequence in one
process: outputs and the gradients of q, k and v, for every method x causal / full x load
balance on / off x MHA / GQA (float64 within 1e-7, float32 within 1e-5), the ring with its
transfers overlapped, value heads narrower than the query heads (MLA's shape), bfloat16
error no larger than 1.5x single-device SDPA's, the styles on a module, shard / unshard, and
the errors, raised before any communication."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
from hp_dtensor import ContextParallelError, MeshError
from hp_dtensor.parallel import (
    AsyncContextParallel,
    ContextParallel,
    context_parallel_attention,
    context_parallel_loss,
    context_parallel_shard,
    context_parallel_unshard,
    parallelize_module,
)
from hp_dtensor.parallel import _cp_plan as plan
from hp_testing.pytest_plugin import rank_pool_fixture

pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4, timeout=300)

B, H, D = 2, 4, 8
CASES = [
    (method, causal, lb, kv)
    for method, causal, lb, kv in itertools.product(
        ("ring", "allgather", "ulysses"), (True, False), (True, False), (4, 2)
    )
]


def _inputs(seq, kv, dtype, dv=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv, seq, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv, seq, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, seq, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != H)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp(q, k, v, dout, mesh, method, causal, lb, overlap=False):
    """This rank's output and its q/k/v gradients, unsharded to the whole sequence."""
    ql, kl, vl, dl = (context_parallel_shard(t, mesh, 2, load_balance=lb) for t in (q, k, v, dout))
    ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
    out = context_parallel_attention(
        ql,
        kl,
        vl,
        mesh,
        is_causal=causal,
        method=method,
        load_balance=lb,
        enable_gqa=kl.shape[1] != H,
        overlap=overlap,
    )
    out.backward(dl)
    return [
        context_parallel_unshard(t.detach(), mesh, 2, load_balance=lb)
        for t in (out, ql.grad, kl.grad, vl.grad)
    ]


def _worst(got, expected):
    return max(
        ((g - e).abs().max() / e.abs().max().clamp_min(1e-30)).item() for g, e in zip(got, expected)
    )


def _all_methods(dtype):
    cp = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (cp,))
    seq = 4 * cp
    errors = {}
    for method, causal, lb, kv in CASES:
        q, k, v, dout = _inputs(seq, kv, dtype)
        expected = _reference(q, k, v, dout, causal)
        errors[(method, causal, lb, kv)] = _worst(
            _cp(q, k, v, dout, mesh, method, causal, lb), expected
        )
    for lb in (True, False):  # the ring with each next transfer in flight during the blocks
        q, k, v, dout = _inputs(seq, 2, dtype, seed=1)
        got = _cp(q, k, v, dout, mesh, "ring", True, lb, overlap=True)
        errors[("ring-overlap", True, lb, 2)] = _worst(got, _reference(q, k, v, dout, True))
    for method in ("ring", "allgather", "ulysses"):  # value heads narrower than q/k heads
        q, k, v, dout = _inputs(seq, 4, dtype, dv=D // 2, seed=2)
        got = _cp(q, k, v, dout, mesh, method, True, True)
        errors[(method + "-narrow-v", True, True, 4)] = _worst(got, _reference(q, k, v, dout, True))
    return errors


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-7), (torch.float32, 1e-5)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_method_equals_sdpa(pool2, pool4, ranks, dtype, tol):
    pool = pool2 if ranks == 2 else pool4
    for errors in pool.run(_all_methods, dtype):
        bad = {k: v for k, v in errors.items() if not v < tol}
        assert not bad, bad
        assert len(errors) == len(CASES) + 5


def _doc_mask(lengths, causal):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = doc[:, None] == doc[None, :]
    return mask & torch.ones_like(mask).tril() if causal else mask


def _documents():
    """Packed documents of lengths that divide by nothing in particular; per-document load
    balancing; every method against SDPA with the block-diagonal (causal) mask, float64."""
    cp = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (cp,))
    lengths = [5, 1, 11, 3, 4] if cp == 2 else [7, 13, 2, 9, 9]  # 24 and 40 tokens
    seq = sum(lengths)
    errors = {}
    for method, causal, lb, kv in CASES:
        q, k, v, dout = _inputs(seq, kv, torch.float64, seed=6)
        mask = _doc_mask(lengths, causal)
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, enable_gqa=kv != H)
        ref.backward(dout)
        expected = (ref.detach(), qr.grad, kr.grad, vr.grad)
        kw = dict(load_balance=lb, document_lengths=lengths)
        ql, kl, vl, dl = (context_parallel_shard(t, mesh, 2, **kw) for t in (q, k, v, dout))
        ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
        out = context_parallel_attention(
            ql, kl, vl, mesh, is_causal=causal, method=method, enable_gqa=kv != H, **kw
        )
        out.backward(dl)
        got = [
            context_parallel_unshard(t.detach(), mesh, 2, **kw)
            for t in (out, ql.grad, kl.grad, vl.grad)
        ]
        errors[(method, causal, lb, kv)] = _worst(got, expected)
    # every rank holds seq / cp tokens whatever the documents
    local = context_parallel_shard(torch.arange(seq)[None], mesh, 1, document_lengths=lengths)
    errors["equal_counts"] = 0.0 if local.shape[1] == seq // cp else 1.0
    return errors


@pytest.mark.parametrize("ranks", [2, 4])
def test_document_masks(pool2, pool4, ranks):
    pool = pool2 if ranks == 2 else pool4
    for errors in pool.run(_documents):
        bad = {k: v for k, v in errors.items() if not v < 1e-7}
        assert not bad, bad


def _usp():
    """USP on a 2 x 2 (ring, Ulysses) mesh: every causal / full x balanced / not x MHA / GQA
    case against SDPA (float64), and the style on a module."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    errors = {}
    for causal, lb, kv in itertools.product((True, False), (True, False), (4, 2, 1)):
        q, k, v, dout = _inputs(16, kv, torch.float64, seed=7)
        expected = _reference(q, k, v, dout, causal)
        errors[(causal, lb, kv)] = _worst(_cp(q, k, v, dout, mesh, "usp", causal, lb), expected)
    torch.manual_seed(0)
    ref = _Attention().double()
    x = torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model = _Attention().double()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, ContextParallel(method="usp"))
    y = context_parallel_unshard(model(context_parallel_shard(x, mesh, 1)).detach(), mesh, 1)
    errors["style"] = (y - ref(x)).abs().max().item()
    return errors


def test_usp_on_a_ring_by_ulysses_mesh(pool4):
    for errors in pool4.run(_usp):
        bad = {k: v for k, v in errors.items() if not v < 1e-7}
        assert not bad, bad


def _bf16_error():
    cp = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (cp,))
    seq = 64 * cp
    q, k, v, dout = _inputs(seq, 2, torch.float64, seed=3)
    exact = _reference(q, k, v, dout, True)
    low = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    one = _reference(*low, True)
    out = {}
    for method in ("ring", "allgather", "ulysses"):
        got = _cp(*low, mesh, method, True, True)
        out[method] = [
            ((g.double() - e).abs().mean() / (s.double() - e).abs().mean()).item()
            for g, s, e in zip(got, one, exact)
        ]
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_bf16_error_against_fp64_is_that_of_one_device(pool2, pool4, ranks):
    """Per tensor (output, dq, dk, dv): CP's mean error against fp64 over single-device bf16
    SDPA's; the merge accumulates in fp32, so the error does not grow with the ring."""
    pool = pool2 if ranks == 2 else pool4
    for ratios in pool.run(_bf16_error):
        for method, r in ratios.items():
            assert max(r) <= 1.5, (method, r)


def _tp_dtensors():
    """Tensor-parallel heads (DTensors Shard(1) over tp) inside context parallelism (cp), on a
    2 x 2 mesh: the local heads attend over the whole sequence; gradients too."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    tp, cpm = mesh["tp"], mesh["cp"]
    q, k, v, dout = _inputs(8 * 2, 2, torch.float64, seed=4)
    expected = _reference(q, k, v, dout, True)
    pieces = [context_parallel_shard(t, cpm, 2) for t in (q, k, v, dout)]
    qd, kd, vd = (hp.distribute_tensor(t, tp, [hp.Shard(1)]).requires_grad_() for t in pieces[:3])
    out = context_parallel_attention(qd, kd, vd, cpm, enable_gqa=True)
    out.backward(hp.distribute_tensor(pieces[3], tp, [hp.Shard(1)]))
    got = [
        context_parallel_unshard(t.full_tensor(), cpm, 2)
        for t in (out.detach(), qd.grad, kd.grad, vd.grad)
    ]
    return isinstance(out, hp.DTensor) and out.placements == (hp.Shard(1),), _worst(got, expected)


def test_tensor_parallel_heads_inside_context_parallel(pool4):
    for is_dtensor, err in pool4.run(_tp_dtensors):
        assert is_dtensor and err < 1e-9


class _Attention(nn.Module):
    """A torchtitan-style attention: projections, then SDPA (no parallelism in it)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(16, 16, bias=False) for _ in range(3))
        self.wo = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, 4, 4).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, 16))


def _styles():
    cp = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (cp,))
    torch.manual_seed(0)
    ref = _Attention().double()
    x = torch.randn(2, 8 * cp, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).sum().backward()
    out = {}
    for style in (
        ContextParallel(),
        AsyncContextParallel(method="ring"),
        ContextParallel(method="ulysses", load_balance=False),
    ):
        model = _Attention().double()
        model.load_state_dict(ref.state_dict())
        parallelize_module(model, mesh, style)
        xl = context_parallel_shard(x, mesh, 1, load_balance=style.load_balance)
        y = model(xl)
        y.pow(2).sum().backward()
        ok = True
        for p, rp in zip(model.parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)  # each rank's tokens' part of the gradient
            ok &= torch.allclose(g, rp.grad, rtol=1e-9, atol=1e-12)
        yf = context_parallel_unshard(y.detach(), mesh, 1, load_balance=style.load_balance)
        out[repr(style)] = ok and torch.allclose(yf, ref(x), rtol=1e-9, atol=1e-12)
    # head counts that do not divide by cp are fine for the ring (no tensor-parallel check)
    odd = _Attention().double()
    odd.n_heads, odd.n_kv_heads = 3, 1
    parallelize_module(odd, mesh, ContextParallel())
    out["odd_heads_accepted"] = True
    # a deep copy computes with its own parameters; applying twice is refused
    model = _Attention().double()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, ContextParallel())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    xl = context_parallel_shard(x, mesh, 1)
    out["deepcopy_own_params"] = not torch.allclose(twin(xl), model(xl))
    try:
        parallelize_module(model, mesh, ContextParallel())
        out["twice_refused"] = False
    except ContextParallelError as e:
        out["twice_refused"] = "context-parallel already" in str(e)
    # a context-parallel module inside another: the inner SDPA runs once as CP, not twice
    outer = nn.Sequential(model)
    parallelize_module(outer, mesh, ContextParallel(method="ulysses"))
    yo = context_parallel_unshard(outer(xl).detach(), mesh, 1)
    out["nested"] = torch.allclose(yo, ref(x), rtol=1e-9, atol=1e-12)
    # the mode is scoped to the module: SDPA outside it is the ordinary one
    q = torch.randn(1, 1, 4, 4)
    out["outside"] = torch.allclose(
        F.scaled_dot_product_attention(q, q, q), torch.softmax(q @ q.mT / 2, -1) @ q, atol=1e-6
    )
    return out


def test_styles_on_an_unchanged_attention_module(pool2):
    for res in pool2.run(_styles):
        assert all(res.values()), res


def _shard_and_errors():
    mesh = hp.init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    x = torch.arange(16.0).view(1, 8, 2).requires_grad_()
    r = {}
    r["lb_pieces"] = context_parallel_shard(x, mesh, 1)[0, :, 0].tolist() == (
        [0.0, 2.0, 12.0, 14.0] if rank == 0 else [4.0, 6.0, 8.0, 10.0]
    )
    r["plain_pieces"] = context_parallel_shard(x, mesh, 1, load_balance=False)[
        0, :, 0
    ].tolist() == ([0.0, 2.0, 4.0, 6.0] if rank == 0 else [8.0, 10.0, 12.0, 14.0])
    for lb in (True, False):
        part = context_parallel_shard(x, mesh, -2, load_balance=lb)
        whole = context_parallel_unshard(part, mesh, 1, load_balance=lb)
        r[f"roundtrip_{lb}"] = torch.equal(whole, x)
        whole.sum().backward()  # a replicated value: each part gets its own chunks' gradient
        own = torch.zeros_like(x)
        own[0, plan.positions(8, 2, rank, lb)] = 1.0
        r[f"grad_{lb}"] = torch.equal(x.grad, own)
        x.grad = None
    # inputs whose last dim is not dense (the fused kernels need it dense)
    g = torch.Generator().manual_seed(5)
    qf, kf, vf = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ql, kl, vl = (context_parallel_shard(t, mesh, 2) for t in (qf, kf, vf))
    odd = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (ql, kl, vl)]
    assert odd[0].stride(-1) != 1
    got = context_parallel_unshard(context_parallel_attention(*odd, mesh), mesh, 2)
    r["strided_inputs"] = torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    # a loss over sequence shards that count different numbers of tokens
    logits = torch.randn(2, 8, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 8), generator=g)
    labels[0, :5] = -100  # ignored: rank 0's head chunk and more
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (want_grad,) = torch.autograd.grad(want, logits)
    local = context_parallel_shard(logits, mesh, 1)
    lab = context_parallel_shard(labels, mesh, 1)
    summed = F.cross_entropy(local.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
    share = context_parallel_loss(summed, (lab != -100).sum(), mesh)
    share.backward()
    value = share.detach().clone()
    dist.all_reduce(value)
    grad = logits.grad.clone()
    dist.all_reduce(grad)
    r["loss_value"] = torch.allclose(value / 2, want, rtol=1e-12)
    r["loss_grad"] = torch.allclose(grad / 2, want_grad, rtol=1e-10, atol=1e-14)
    # under autocast, as SDPA: mixed dtypes taken, the result in autocast's dtype
    qa, ka, va = (
        torch.randn(1, 4, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = context_parallel_attention(qa, ka.bfloat16(), va, mesh)
    want = context_parallel_attention(qa.bfloat16(), ka.bfloat16(), va.bfloat16(), mesh)
    r["autocast"] = got.dtype == torch.bfloat16 and torch.equal(got, want)
    q = torch.randn(1, 4, 3, 8)
    errors = {
        "seq": lambda: context_parallel_attention(q, q, q, mesh),  # 6 not divisible by 4
        "shard_seq": lambda: context_parallel_shard(torch.randn(1, 6), mesh, 1),
        "method": lambda: context_parallel_attention(q, q, q, mesh, method="tree"),
        "ulysses_heads": lambda: context_parallel_attention(
            torch.randn(1, 3, 4, 8),
            torch.randn(1, 3, 4, 8),
            torch.randn(1, 3, 4, 8),
            mesh,
            method="ulysses",
        ),
        "gqa": lambda: context_parallel_attention(
            torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), mesh
        ),
        "mesh_rank": lambda: context_parallel_attention(
            q, q, q, hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
        ),
        "dtypes": lambda: context_parallel_attention(q, q.double(), q, mesh),
        "style_method": lambda: ContextParallel(method="tree"),
        "overlap_method": lambda: context_parallel_attention(
            torch.randn(1, 4, 4, 8),
            torch.randn(1, 4, 4, 8),
            torch.randn(1, 4, 4, 8),
            mesh,
            method="allgather",
            overlap=True,
        ),
        "async_method": lambda: AsyncContextParallel(method="ulysses"),
        "seq_dim": lambda: context_parallel_shard(torch.randn(2, 8), mesh, 2),
        "dtensor_mixed": lambda: context_parallel_attention(
            hp.distribute_tensor(torch.randn(1, 4, 4, 8), mesh, [hp.Shard(1)]),
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8),
            mesh,
        ),
    }
    messages = {}
    for name, fn in errors.items():
        try:
            fn()
            messages[name] = None
        except (ContextParallelError, MeshError) as e:
            messages[name] = str(e)
    r["messages"] = messages
    return r


def test_shard_unshard_and_errors(pool2):
    for res in pool2.run(_shard_and_errors):
        msgs = res.pop("messages")
        assert all(res.values()), res
        assert "sequence length 6 is not divisible by 2 x cp = 4" in msgs["seq"]
        assert "sequence length 6 is not divisible" in msgs["shard_seq"]
        assert "method='tree' is not one of" in msgs["method"]
        assert "splits the 3 query heads over cp = 2" in msgs["ulysses_heads"]
        assert "need enable_gqa=True" in msgs["gqa"]
        assert "needs a 1-D mesh" in msgs["mesh_rank"] and "mesh['cp']" in msgs["mesh_rank"]
        assert "must share a dtype" in msgs["dtypes"] and "torch.float64" in msgs["dtypes"]
        assert "method='tree'" in msgs["style_method"]
        assert "overlap=True overlaps the ring's transfers" in msgs["overlap_method"]
        assert "AsyncContextParallel overlaps the ring" in msgs["async_method"]
        assert "seq_dim=2 is out of range for a 2-D tensor" in msgs["seq_dim"]
        assert "DTensor inputs must be q, k and v alike" in msgs["dtensor_mixed"]
