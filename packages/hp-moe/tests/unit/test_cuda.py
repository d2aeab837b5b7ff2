"""The MoE layer on a CUDA device against the same layer on the CPU (skipped without a GPU;
run on the H200): bf16 grouped GEMMs and the fused SwiGLU, forward and backward, and bitwise
reproducible gradients (no atomics in dispatch or combine)."""

import copy

import pytest
import torch

from hp_moe import MoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_moe_on_cuda_matches_cpu(capacity_factor):
    torch.manual_seed(0)
    moe = MoE(
        64,
        32,
        8,
        2,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        load_balance_coeff=1e-3,
        aux_loss_coeff=0.01,
        aux_loss_type="batch",
        capacity_factor=capacity_factor,
    )
    gpu = copy.deepcopy(moe).cuda().to(torch.bfloat16)
    ref = copy.deepcopy(moe).to(torch.bfloat16).float()  # the same bf16-rounded weights
    x = torch.randn(2, 24, 64).to(torch.bfloat16)
    out = gpu(x.cuda())
    want = ref(x.float())
    rel = (out.float().cpu() - want).norm() / want.norm()
    assert rel < 2e-2, rel
    up = torch.randn_like(want)
    out.backward(up.cuda().to(out.dtype))
    want.backward(up)
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters()):
        rel = (p.grad.float().cpu() - q.grad).norm() / q.grad.norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, rel.item())
    first = [p.grad.clone() for p in gpu.parameters()]
    gpu.zero_grad()
    gpu(x.cuda()).backward(up.cuda().to(out.dtype))
    for a, p in zip(first, gpu.parameters()):
        assert torch.equal(a, p.grad)


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_compiled_moe_on_cuda_under_checkpointing_equals_eager(capacity_factor):
    """bf16 on CUDA, what ``training.compile`` runs: the MoE layer compiled (the grouped GEMM,
    the SwiGLU traced instead of the Triton kernels), the recomputation check hoisted, under
    non-reentrant checkpointing, over three batches that route differently: outputs and input
    gradients as eager's (bf16), the same token counts (each forward counted once), no graph
    break and at most two graphs."""
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import checkpoint

    import hp_moe

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    kw = dict(num_shared_experts=1, score_func="sigmoid", route_norm=True, load_balance_coeff=0.0)
    kw["capacity_factor"] = capacity_factor
    eager = MoE(256, 512, 16, 4, **kw).cuda().to(torch.bfloat16)
    traced = copy.deepcopy(eager)
    region = hp_moe.hoist_recompute_check(torch.compile(traced.forward), traced)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(4, 128, 256, device="cuda", generator=g).to(torch.bfloat16)
        res = []
        for fn in (eager, region):
            xi = x.clone().requires_grad_(True)
            out = checkpoint(fn, xi, use_reentrant=False)
            out.float().pow(2).sum().backward()
            res.append((out.detach().float(), xi.grad.float()))
        for a, b in zip(*res):
            assert ((a - b).abs().max() / a.abs().max()).item() < 3e-2
    assert torch.equal(traced.tokens_per_expert, eager.tokens_per_expert)
    assert torch.equal(traced.dropped_tokens, eager.dropped_tokens)
    # the counts are of routed copies (what the bias balances), dropped ones included
    assert int(eager.tokens_per_expert.sum()) == 3 * 4 * 128 * 4
    assert (int(eager.dropped_tokens) > 0) == (capacity_factor is not None)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
