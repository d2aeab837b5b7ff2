"""The CUDA paths of hp_kernels.moe: Triton SwiGLU kernels against the torch composite, the
permutation against the CPU's counting sort (skipped without a GPU; run on the H200)."""

import pytest
import torch

from hp_kernels import moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(37, 1408), (5, 7), (0, 64)])
def test_fused_swiglu_matches_torch(dtype, weighted, shape):
    g = torch.Generator().manual_seed(0)
    a, b, dh = (torch.randn(*shape, generator=g).to("cuda", dtype) for _ in range(3))
    w = torch.rand(shape[0], generator=g).to("cuda") if weighted else None
    fused = moe._triton_ops()
    assert fused is not None, "Triton is missing on this GPU machine"
    h = fused.swiglu_forward(a, b, w)
    ref = moe._swiglu_torch(a, b, w)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, ref, **tol)
    got = fused.swiglu_backward(dh, a, b, w)
    want = moe._swiglu_backward_torch(dh, a, b, w)
    for x, y in zip(got, want):
        if y is None:
            assert x is None
        else:
            torch.testing.assert_close(x.float(), y.float(), **tol)


def test_permutation_and_combine_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(50, 8, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 6, (50, 2), generator=g)
    probs = torch.rand(50, 2, generator=g, dtype=torch.float64)
    keep = torch.rand(50, 2, generator=g) > 0.2
    for kw in ({}, {"keep": keep}):
        cpu = moe.permute_tokens(tokens, idx, 6, **kw)
        gpu = moe.permute_tokens(
            tokens.cuda(), idx.cuda(), 6, **{k: v.cuda() for k, v in kw.items()}
        )
        assert torch.equal(gpu.order.cpu(), cpu.order) and torch.equal(gpu.counts.cpu(), cpu.counts)
        kk = kw.get("keep")
        out_cpu = moe.unpermute_tokens(cpu.tokens, cpu.order, probs, keep=kk)
        out_gpu = moe.unpermute_tokens(
            gpu.tokens, gpu.order, probs.cuda(), keep=None if kk is None else kk.cuda()
        )
        torch.testing.assert_close(out_gpu.cpu(), out_cpu)
        # bitwise reproducible: gathers only, no atomics
        again = moe.unpermute_tokens(
            gpu.tokens, gpu.order, probs.cuda(), keep=None if kk is None else kk.cuda()
        )
        assert torch.equal(again, out_gpu)
