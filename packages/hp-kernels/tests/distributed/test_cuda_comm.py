"""The CUDA path (PyTorch symmetric memory, copy engines, hp_kernels' cuda_reduce) on 2 GPUs,
against NCCL: the four collectives (uneven all-to-all, bf16 wire) and both MC2 ops against the
unfused computation. Skipped without two GPUs."""

import pytest
import torch
import torch.distributed as dist

from hp_kernels import comm, mc2

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

if torch.cuda.device_count() >= 2:
    from hp_testing.pytest_plugin import rank_pool_fixture

    gpus = rank_pool_fixture(
        2,
        backend="nccl",
        env={
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        },
    )


def _collectives_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1000, 1 << 20):
            x = torch.randn(n, generator=g, device=dev).to(dtype)
            ours, ref = (
                torch.empty(world * n, device=dev, dtype=dtype),
                torch.empty(world * n, device=dev, dtype=dtype),
            )
            comm.all_gather_into_tensor(ours, x)
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(ours, ref)
            y = torch.randn(world * n, generator=g, device=dev).to(dtype)
            ours, ref = (
                torch.empty(n, device=dev, dtype=dtype),
                torch.empty(n, device=dev, dtype=dtype),
            )
            comm.reduce_scatter_tensor(ours, y)
            dist.reduce_scatter_tensor(ref, y)
            torch.testing.assert_close(
                ours, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5
            )
            z = y.clone()
            comm.all_reduce(z, "avg")
            zr = y.clone()
            dist.all_reduce(zr)
            torch.testing.assert_close(
                z, zr / world, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5
            )
        splits = [[3, 5], [0, 7]]  # splits[i][j]: rows i sends to j
        x = torch.randn(sum(splits[rank]), 4, generator=g, device=dev).to(dtype)
        out_rows = [splits[i][rank] for i in range(world)]
        ours = torch.empty(sum(out_rows), 4, device=dev, dtype=dtype)
        ref = torch.empty_like(ours)
        comm.all_to_all_single(ours, x, out_rows, splits[rank])
        dist.all_to_all_single(ref, x, out_rows, splits[rank])
        assert torch.equal(ours, ref)
    # bf16 wire, fp32 accumulation
    x = torch.randn(world * 4096, generator=g, device=dev) * 10
    exact = torch.empty(4096, device=dev)
    dist.reduce_scatter_tensor(exact, x)
    ours = torch.empty(4096, device=dev)
    comm.reduce_scatter_tensor(ours, x, wire_dtype=torch.bfloat16)
    low = torch.empty(4096, device=dev, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(low, x.bfloat16())
    assert (ours - exact).abs().mean() <= (low.float() - exact).abs().mean()
    torch.testing.assert_close(ours, exact, rtol=2**-7, atol=0.5)
    torch.cuda.synchronize()
    return True


def test_collectives_match_nccl(gpus):
    assert gpus.run(_collectives_body) == [True, True]


def _push_body():
    """all_to_all into outputs in symmetric memory (peers write into them), even and uneven,
    twice in a row (the second call must not overwrite an output still being read)."""
    from hp_kernels import symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(3 + rank)
    out = symm_mem.empty((64, 4), torch.bfloat16, device=dev).buffer
    for splits in ([[16, 16], [16, 16]], [[3, 5], [0, 7]], [[0, 9], [11, 2]]):
        out_rows = [splits[i][rank] for i in range(world)]
        for _ in range(2):
            x = torch.randn(sum(splits[rank]), 4, generator=g, device=dev).bfloat16()
            ours = out[: sum(out_rows)]
            ref = torch.empty_like(ours)
            if splits[0] == [16, 16]:
                comm.all_to_all_single(ours, x)
                dist.all_to_all_single(ref, x)
            else:
                comm.all_to_all_single(ours, x, out_rows, splits[rank])
                dist.all_to_all_single(ref, x, out_rows, splits[rank])
            assert torch.equal(ours, ref), splits
    torch.cuda.synchronize()
    return True


def test_all_to_all_into_symmetric_output_matches_nccl(gpus):
    assert gpus.run(_push_body) == [True, True]


def _mc2_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(7)
    w1 = torch.randn(256, 384, generator=g, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(256, 128, generator=g, device=dev, dtype=torch.bfloat16)
    gr = torch.Generator(device=dev).manual_seed(10 + rank)
    x = torch.randn(64, 256, generator=gr, device=dev, dtype=torch.bfloat16)
    gathered_ref = torch.empty(world * 64, 256, device=dev, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered_ref, x)
    gathered, (y1, y2) = mc2.all_gather_matmul(x, [w1, w2], return_gathered=True)
    assert torch.equal(gathered, gathered_ref)
    torch.testing.assert_close(y1, gathered_ref @ w1)
    torch.testing.assert_close(y2, gathered_ref @ w2)
    x3 = torch.randn(2, 32, 256, generator=gr, device=dev, dtype=torch.bfloat16)
    (y3,) = mc2.all_gather_matmul(x3, [w1], gather_dim=1)
    parts = [torch.empty_like(x3) for _ in range(world)]
    dist.all_gather(parts, x3)
    torch.testing.assert_close(y3, torch.cat(parts, 1) @ w1)
    for scatter_dim in (0, -1):
        a = torch.randn(128, 256, generator=gr, device=dev, dtype=torch.bfloat16)
        ours = mc2.matmul_reduce_scatter(a, w1, scatter_dim=scatter_dim)
        full = (a @ w1).float()
        chunks = [c.contiguous() for c in full.chunk(world, dim=scatter_dim)]
        ref = torch.empty_like(chunks[0])
        dist.reduce_scatter(ref, chunks)
        torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=0.25)
    torch.cuda.synchronize()
    return True


def test_mc2_matches_unfused(gpus):
    assert gpus.run(_mc2_body) == [True, True]


def _symmetric_body():
    """GPU symmetric memory: put/get/barrier, and collectives reading inputs in place."""
    import hp_kernels.symm_mem as symm

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    mem = symm.empty((4096,), torch.bfloat16, device=dev)
    mem.put(torch.full((16,), float(rank), device=dev, dtype=torch.bfloat16), (rank + 1) % world)
    mem.barrier()
    assert float(mem.buffer[:16].float().mean()) == float((rank - 1) % world)
    got = mem.get((rank + 1) % world, torch.empty(16, device=dev, dtype=torch.bfloat16))
    assert float(got.float().mean()) == float(rank)
    mem.barrier()
    # one-sided: put into the right neighbour, signal it; wait for the left one's signal
    right, left = (rank + 1) % world, (rank - 1) % world
    mem.put(torch.full((8,), 7.0 + rank, device=dev, dtype=torch.bfloat16), right, offset=64)
    mem.signal(right)
    mem.wait(left)
    assert float(mem.buffer[32:40].float().mean()) == 7.0 + left
    mem.barrier()
    x = mem.buffer[100:1100]  # an offset inside the allocation, the same on every rank
    x.copy_(torch.randn(1000, device=dev).bfloat16())
    ours = torch.empty(world * 1000, device=dev, dtype=torch.bfloat16)
    ref = torch.empty_like(ours)
    comm.all_gather_into_tensor(ours, x)
    dist.all_gather_into_tensor(ref, x)
    assert torch.equal(ours, ref)
    y = mem.buffer[2000 : 2000 + world * 300]
    ours = torch.empty(world * 300, device=dev, dtype=torch.bfloat16)
    ref = torch.empty_like(ours)
    comm.all_to_all_single(ours, y)
    dist.all_to_all_single(ref, y)
    assert torch.equal(ours, ref)
    # in place, as FSDP gathers: each rank's input is its own chunk of a symmetric output
    out_mem = symm.empty((world * 256,), torch.bfloat16, device=dev)
    own = out_mem.buffer[rank * 256 : (rank + 1) * 256]
    own.copy_(torch.randn(256, device=dev).bfloat16())
    ref = torch.empty(world * 256, device=dev, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(ref, own.clone())
    comm.all_gather_into_tensor(out_mem.buffer, own)
    assert torch.equal(out_mem.buffer, ref)
    # all-to-all where one rank has no rows to send
    splits = [[0, 0], [3, 2]]
    x = torch.randn(sum(splits[rank]), 4, device=dev)
    out_rows = [splits[p][rank] for p in range(world)]
    ours = torch.full((sum(out_rows), 4), -1.0, device=dev)
    ref = torch.empty_like(ours)
    comm.all_to_all_single(ours, x, out_rows, splits[rank])
    dist.all_to_all_single(ref, x, out_rows, splits[rank])
    assert torch.equal(ours, ref)
    # two calls on different streams stay ordered (one workspace, one barrier channel)
    side = torch.cuda.Stream()
    a, b = torch.randn(1 << 20, device=dev), torch.randn(1 << 20, device=dev)
    ga, gb = torch.empty(world << 20, device=dev), torch.empty(world << 20, device=dev)
    comm.all_gather_into_tensor(ga, a)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_gather_into_tensor(gb, b)
    torch.cuda.synchronize()
    ra, rb = torch.empty_like(ga), torch.empty_like(gb)
    dist.all_gather_into_tensor(ra, a)
    dist.all_gather_into_tensor(rb, b)
    assert torch.equal(ga, ra) and torch.equal(gb, rb)
    torch.cuda.synchronize()
    return True


def test_symmetric_inputs(gpus):
    assert gpus.run(_symmetric_body) == [True, True]


def test_moe_permutation_on_cuda():
    from hp_kernels import moe

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(50, 8, generator=g)
    idx = torch.randint(0, 6, (50, 2), generator=g)
    probs = torch.rand(50, 2, generator=g)
    cpu = moe.permute_tokens(tokens, idx, 6)
    gpu = moe.permute_tokens(tokens.to(dev), idx.to(dev), 6)
    assert torch.equal(gpu.order.cpu(), cpu.order) and torch.equal(gpu.counts.cpu(), cpu.counts)
    torch.testing.assert_close(gpu.tokens.cpu(), cpu.tokens)
    out_cpu = moe.unpermute_tokens(cpu.tokens, cpu.order, probs)
    out_gpu = moe.unpermute_tokens(gpu.tokens, gpu.order, probs.to(dev))
    torch.testing.assert_close(out_gpu.cpu(), out_cpu)
