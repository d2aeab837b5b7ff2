"""PipelineStage's split backward (B then W) gives exactly the gradients of one backward, on one
process, for layers that take the matmul fast path and for those that go through autograd."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hp_pipeline._stage as stage_mod
from hp_pipeline import PipelineStage


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.up = nn.Linear(12, 20)  # addmm with bias
        self.down = nn.Linear(20, 12, bias=False)  # mm
        self.scale = nn.Parameter(torch.rand(12) + 0.5)  # an elementwise weight

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.scale


class Model(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.emb = nn.Embedding(17, 12) if first else None
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(self.emb(x) if self.emb is not None else x)


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_b_then_w_equals_full_backward(first, autocast, monkeypatch):
    torch.manual_seed(0)
    ref = Model(first)
    model = Model(first)
    model.load_state_dict(ref.state_dict())
    x = torch.randint(0, 17, (3, 5)) if first else torch.randn(3, 5, 12)
    g = torch.randn(3, 5, 12)
    fast = []
    real = stage_mod._matmul_weight_grads
    monkeypatch.setattr(stage_mod, "_matmul_weight_grads", lambda *a: fast.append(True) or real(*a))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    st_full = PipelineStage(ref, 1 - first, 2, device="cpu")
    st = PipelineStage(model, 1 - first, 2, device="cpu")
    with ctx:
        st_full.forward_one_chunk(0, (x,))
        st.forward_one_chunk(0, (x,))
    dx_full = st_full.backward_full(0, (g,))
    dx = st.backward_input(0, (g,))
    assert all(p.grad is None for p in model.parameters())  # B computes no weight gradient
    st.backward_weight(0)
    for a, b in zip(dx, dx_full):
        torch.testing.assert_close(a, b)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    if not first:  # stages with an input: the linear layers took the fast path
        assert fast.count(True) == 4, fast


def test_w_before_b_is_an_error():
    st = PipelineStage(Model(False), 1, 2)
    st.forward_one_chunk(0, (torch.randn(2, 3, 12),))
    with pytest.raises(Exception, match="before its B"):
        st.backward_weight(0)


def test_activation_hooks_wrap_each_forward():
    seen = []

    class Hooks:
        def __init__(self, mb):
            self.mb = mb

        def __enter__(self):
            seen.append(("pack", self.mb))
            self.ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda t: ("cpu", t.clone()), lambda p: p[1]
            )
            self.ctx.__enter__()

        def __exit__(self, *exc):
            self.ctx.__exit__(*exc)

    torch.manual_seed(0)
    ref, model = Model(False), Model(False)
    model.load_state_dict(ref.state_dict())
    st = PipelineStage(model, 1, 2, activation_hooks=Hooks)
    x, g = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    for mb in range(2):
        st.forward_one_chunk(mb, (x,))
    for mb in range(2):
        st.backward_input(mb, (g,))
        st.backward_weight(mb)
    (ref(x) * g).sum().mul(2).backward()
    assert seen == [("pack", 0), ("pack", 1)]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(Exception, match="activation_hooks"):
        PipelineStage(model, 1, 2, activation_hooks=3)


class Shared(nn.Module):
    """A weight read by a matmul and elementwise: its branches meet below the cut nodes."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 12) / 4)
        self.norm = nn.RMSNorm(12)

    def forward(self, x):
        return self.norm(x) @ self.w.t() * self.w[0] + x


@pytest.mark.parametrize("ckpt", [False, True])
def test_b_then_w_with_checkpointing_and_shared_weights(ckpt):
    """Checkpointed blocks (non-reentrant) and a weight shared between a matmul and an
    elementwise use: B then W equals one backward, and W runs each block's forward again at
    most once (reading saved inputs one by one outside a backward used to rerun the block for
    every read, and kept each rerun's activations until the step ended)."""
    import torch.utils.checkpoint as cp

    calls = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Shared()])

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                if ckpt:
                    x = cp.checkpoint(
                        lambda y, b=b, i=i: calls.append(i) or b(y), x, use_reentrant=False
                    )
                else:
                    x = b(x)
            return x

    torch.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    x, g = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    st_full = PipelineStage(ref, 1, 2, device="cpu")
    st = PipelineStage(model, 1, 2, device="cpu")
    st_full.forward_one_chunk(0, (x,))
    dx_full = st_full.backward_full(0, (g,))
    calls.clear()
    st.forward_one_chunk(0, (x,))
    dx = st.backward_input(0, (g,))
    assert all(p.grad is None for p in model.parameters())
    after_b = len(calls)
    st.backward_weight(0)
    torch.testing.assert_close(dx[0], dx_full[0])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    if ckpt:
        assert after_b == 4  # forward, then B's recompute, for each block
        if hasattr(cp, "GraphExecGroup"):
            assert len(calls) - after_b == 2, calls  # W: once per block


class _ParamOnlyOutput(nn.Module):
    """A second output that reaches a parameter of the input path but not the input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x * self.w, self.w * 2.0


class _NormWeightOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(6), nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(self.norm(x)), self.norm.weight.unsqueeze(0).expand(4, 6) * 1.0


class _Hooked(nn.Module):
    def __init__(self, which):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(6), nn.Linear(6, 6)
        getattr(self, which).weight.register_hook(lambda g: g * 2)

    def forward(self, x):
        return self.lin(self.norm(x))


class _Addcmul(nn.Module):
    """One node reading the same parameter twice."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return torch.addcmul(x, self.w, self.w)


class _RowBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.W, self.b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(1, 6))

    def forward(self, x):
        return torch.addmm(self.b, x, self.W.t())


class _OutputHooks(nn.Module):
    """Tensor hooks on 2-D linear outputs (the matmul node is the output's own grad_fn)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6, bias=False), nn.Linear(6, 6)

    def forward(self, x):
        y = self.a(x)
        y.register_hook(lambda g: g * 3)
        z = self.b(torch.relu(y))
        z.register_hook(lambda g: g * 0.5)
        return z


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.s = nn.Parameter(torch.rand(6))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.s + x * self.a.bias


@pytest.mark.parametrize(
    "make",
    [
        _ParamOnlyOutput,
        _NormWeightOutput,
        lambda: _Hooked("norm"),
        lambda: _Hooked("lin"),
        _Addcmul,
        _RowBias,
        _Tied,
        _OutputHooks,
    ],
    ids=[
        "param-only-output",
        "norm-weight-output",
        "hook-norm",
        "hook-linear",
        "addcmul",
        "row-bias",
        "tied",
        "output-hooks",
    ],
)
def test_b_then_w_equals_full_backward_on_awkward_graphs(make):
    """Outputs off the input path, tensor hooks on parameters, a parameter read twice by one
    node, a (1, N) bias, tied weights: B then W gives FULL_B's gradients (each was once wrong
    by a factor of 2, or 1.1-1.7, in a version of the split)."""
    torch.manual_seed(0)
    ref, mod = make(), make()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(4, 6)
    outs = ref(x)
    gs = tuple(torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
    a, b = PipelineStage(ref, 1, 2, device="cpu"), PipelineStage(mod, 1, 2, device="cpu")
    a.forward_one_chunk(0, (x,))
    b.forward_one_chunk(0, (x,))
    dx_full = a.backward_full(0, gs)
    dx = b.backward_input(0, gs)
    b.backward_weight(0)
    torch.testing.assert_close(dx[0], dx_full[0])
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_w_inside_a_group_the_caller_opened():
    """A caller's GraphExecGroup around B and W: W runs in its own group (under one group, W
    would find the checkpointed inputs B already read)."""
    import torch.utils.checkpoint as cp

    if not hasattr(cp, "GraphExecGroup"):
        pytest.skip("torch without GraphExecGroup")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return cp.checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    x, g = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    (ref(x) * g).sum().backward()
    st = PipelineStage(model, 1, 2, device="cpu")
    with cp.GraphExecGroup():
        st.forward_one_chunk(0, (x,))
        st.backward_input(0, (g,))
        st.backward_weight(0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def _two_microbatches(model, ref, device="cpu", autocast=False, **stage_kw):
    """B then W for two microbatches on ``model`` and FULL_B on ``ref``; returns nothing, the
    gradients are in the parameters."""
    xs = [torch.randn(3, 5, 12, device=device) for _ in range(2)]
    gs = [torch.randn(3, 5, 12, device=device) for _ in range(2)]
    a = PipelineStage(ref, 1, 2, device=device)
    b = PipelineStage(model, 1, 2, device=device, **stage_kw)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        for mb, x in enumerate(xs):
            a.forward_one_chunk(mb, (x,))
            b.forward_one_chunk(mb, (x,))
    for mb, g in enumerate(gs):
        a.backward_full(mb, (g,))
        b.backward_input(mb, (g,))
        b.backward_weight(mb)


def test_linear_weight_gradients_go_straight_into_grad(monkeypatch):
    """A linear weight with nothing between it and its matmul but the transpose gets its
    gradient from one GEMM into ``.grad`` (the first microbatch sets it, the second adds with
    beta=1), equal to autograd's two microbatches of FULL_B."""
    torch.manual_seed(0)
    ref, model = Model(False), Model(False)
    model.load_state_dict(ref.state_dict())
    took = []
    real = stage_mod._accumulate_into
    monkeypatch.setattr(
        stage_mod, "_accumulate_into", lambda p, a, b: took.append(real(p, a, b)) or took[-1]
    )
    _two_microbatches(model, ref)
    assert took == [True] * 8, took  # 4 linear layers x 2 microbatches
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_hooked_linear_weight_keeps_autograd_accumulation():
    """A post-accumulate-grad hook (how optimizers in backward and some sharding libraries
    learn a gradient is complete) or a tensor hook on a linear weight: the weight's gradient
    takes autograd's way, and the hooks run once per microbatch, as in FULL_B."""
    torch.manual_seed(0)
    ref, model = Model(False), Model(False)
    model.load_state_dict(ref.state_dict())
    seen = {"ref": [], "ours": []}
    for key, m in (("ref", ref), ("ours", model)):
        up, down = m.blocks[0].up.weight, m.blocks[1].down.weight
        up.register_post_accumulate_grad_hook(lambda p, k=key: seen[k].append(p.grad.clone()))
        down.register_hook(lambda g: g * 3)
    _two_microbatches(model, ref)
    assert len(seen["ours"]) == len(seen["ref"]) == 2
    for a, b in zip(seen["ours"], seen["ref"]):
        torch.testing.assert_close(a, b)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_accumulate_grad_node_hooks_need_direct_weight_grads_off():
    """Hooks on a parameter's AccumulateGrad node (Megatron-style main_grad folding) are
    invisible from Python: with ``direct_weight_grads=False`` W leaves every weight to
    autograd, and the hooks run as often, with the same gradients, as under FULL_B."""
    torch.manual_seed(0)
    ref, model = Model(False), Model(False)
    model.load_state_dict(ref.state_dict())
    calls = {"ref": 0, "ours": 0}
    for key, m in (("ref", ref), ("ours", model)):
        for p in m.parameters():
            p.main_grad = torch.zeros_like(p)
            acc = p.view_as(p).grad_fn.next_functions[0][0]

            def fold(*_, p=p, key=key):
                calls[key] += 1
                p.main_grad.add_(p.grad)
                p.grad = None

            acc.register_hook(fold)
            p._acc = acc  # the node lives as long as the parameter
    _two_microbatches(model, ref, direct_weight_grads=False)
    assert calls["ours"] == calls["ref"] > 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.main_grad, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="out_dtype GEMMs need CUDA")
def test_autocast_weight_gradients_accumulate_in_fp32_on_cuda():
    """Under bf16 autocast with fp32 parameters, W's GEMM writes fp32 into ``.grad`` (with
    ``out_dtype``): within bf16 rounding of autograd's cast-then-add, on CUDA."""
    torch.manual_seed(0)
    ref, model = Model(False).cuda(), Model(False).cuda()
    model.load_state_dict(ref.state_dict())
    took = []
    real = stage_mod._accumulate_into
    stage_mod._accumulate_into = lambda p, a, b: took.append(real(p, a, b)) or took[-1]
    try:
        _two_microbatches(model, ref, device="cuda", autocast=True)
    finally:
        stage_mod._accumulate_into = real
    assert took and all(took), took
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n, atol=2e-2, rtol=2e-2)
