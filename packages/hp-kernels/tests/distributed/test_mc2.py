"""MC2 ops on 2 and 4 CPU ranks equal the unfused computation: all-gather (gloo) then matmul,
and matmul then reduce-scatter (gloo)."""

import pytest
import torch
import torch.distributed as dist

from hp_kernels import mc2
from hp_testing.pytest_plugin import rank_pool_fixture

pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4)


def _ag_body(dtype, gather_dim):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(24, 10, generator=g).to(dtype)
    w2 = torch.randn(24, 7, generator=g).to(dtype)
    shape = [3, 5, 24]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    gathered_ref = torch.cat(parts, dim=gather_dim)
    refs = [gathered_ref @ w1, gathered_ref @ w2]
    outs = mc2.all_gather_matmul(x, [w1, w2], gather_dim=gather_dim)
    gathered, outs2 = mc2.all_gather_matmul(
        x, [w1, w2], gather_dim=gather_dim, return_gathered=True
    )
    assert torch.equal(gathered, gathered_ref)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for out, out2, ref in zip(outs, outs2, refs):
        torch.testing.assert_close(out, ref, **tol)
        assert torch.equal(out, out2)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gather_dim", [0, 1])
def test_all_gather_matmul(pool2, pool4, dtype, gather_dim):
    assert pool2.run(_ag_body, dtype, gather_dim) == [True] * 2
    assert pool4.run(_ag_body, dtype, gather_dim) == [True] * 4


def _rs_body(dtype, scatter_dim, op):
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.randn(16, 4 * 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    x = torch.randn(2, 4 * 3, 16, generator=torch.Generator().manual_seed(20 + rank)).to(dtype)
    ours = mc2.matmul_reduce_scatter(x, w, scatter_dim=scatter_dim, reduce_op=op)
    # unfused oracle: matmul, then gloo's reduce-scatter in float32 along scatter_dim
    y = (x @ w).float()
    dim = scatter_dim % y.dim()
    chunks = [c.contiguous() for c in y.chunk(world, dim=dim)]
    ref = torch.empty_like(chunks[0])
    dist.reduce_scatter(ref, chunks)
    if op == "avg":
        ref /= world
    assert ours.shape == ref.shape and ours.dtype == dtype
    tol = dict(rtol=1.6e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.float(), ref, **tol)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scatter_dim", [1, -1])
def test_matmul_reduce_scatter(pool2, pool4, dtype, scatter_dim):
    assert pool2.run(_rs_body, dtype, scatter_dim, "sum") == [True] * 2
    assert pool4.run(_rs_body, dtype, scatter_dim, "avg") == [True] * 4


def _bad_body():
    rank = dist.get_rank()
    errors = []
    w = torch.randn(8, 4)
    for call in (
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), [w], gather_dim=1),
        lambda: mc2.all_gather_matmul(torch.randn(3, 5), [w]),
        lambda: mc2.matmul_reduce_scatter(torch.randn(3, 8), w),
        lambda: mc2.all_gather_matmul(torch.randn(3 + rank, 8), [w]),
        # one rank alone is wrong: the other must fail too, not wait
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8 if rank == 0 else 9), w),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_bad_input(pool2):
    results = pool2.run(_bad_body)
    for errors in results:
        assert "other than the last" in errors[0]
        assert "first dim must equal" in errors[1]
        assert "does not divide by the group size 2" in errors[2]
        assert "ranks disagree on x_shard's size" in errors[3]
    assert [
        ("first dim must equal" in e, "rank(s) [1] passed invalid" in e)
        for e in (r[4] for r in results)
    ] == [(False, True), (True, False)]
