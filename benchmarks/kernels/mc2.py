"""MC2 on two GPUs: hp_kernels' all_gather_matmul and matmul_reduce_scatter against the unfused
NCCL path and PyTorch's fused symmetric-memory ops, same shapes, one launch; GPU time from CUDA
events. Shapes as GPU-ANCHORS.md (TP=2 MLP, bf16): AG+MM: A_shard [M/2, 4096] gathered, times
B [4096, 7168]; MM+RS: [M, 7168] x [7168, 4096], reduce-scatter on dim 0.
Targets: >= 1.15x unfused and >= 1.0x PyTorch's fused ops.

    torchrun --standalone --nproc_per_node=2 benchmarks/kernels/mc2.py
    (set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from gpu_collectives import _time, init_gpu  # noqa: E402  (same folder)

REQUIRES_CUDA = True  # nox -s bench runs it only where CUDA is


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    world, rank, dev = init_gpu()
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm

    from hp_kernels import mc2

    if hasattr(symm, "enable_symm_mem_for_group"):
        symm.enable_symm_mem_for_group(group.group_name)
    bf = torch.bfloat16
    m, k, n = args.m, args.k, args.n
    a_shard = torch.randn(m // world, k, device=dev, dtype=bf)
    b = torch.randn(k, n, device=dev, dtype=bf) / k**0.5
    gathered = torch.empty(m, k, device=dev, dtype=bf)

    def ag_unfused():
        dist.all_gather_into_tensor(gathered, a_shard)
        return gathered @ b

    def ag_torch():
        return torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, group.group_name)

    def ag_ours():
        return mc2.all_gather_matmul(a_shard, [b])

    x = torch.randn(m, n, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf) / n**0.5
    rs_out = torch.empty(m // world, k, device=dev, dtype=bf)

    def rs_unfused():
        dist.reduce_scatter_tensor(rs_out, x @ w)
        return rs_out

    def rs_torch():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", 0, group.group_name)

    def rs_ours():
        return mc2.matmul_reduce_scatter(x, w)

    # correctness against the unfused path before timing
    ref = ag_unfused().float()
    torch.testing.assert_close(ag_ours()[0].float(), ref, rtol=2e-2, atol=2e-2)
    ref = rs_unfused().clone().float()
    torch.testing.assert_close(rs_ours().float(), ref, rtol=3e-2, atol=6e-2)

    rows = []
    for case, fns in (
        ("AG+MM", (ag_unfused, ag_torch, ag_ours)),
        ("MM+RS", (rs_unfused, rs_torch, rs_ours)),
    ):
        for fn in fns:
            for _ in range(3):
                fn()
        t = {i: [] for i in range(3)}
        for _ in range(args.repeats):
            for i, fn in enumerate(fns):
                t[i].append(_time(fn, args.iters))
        rows.append((case, *(statistics.median(t[i]) for i in range(3))))
    if rank == 0:
        print(
            f"MC2 on {world} x {torch.cuda.get_device_name()}, bf16, M={m} K={k} N={n}, "
            f"GPU time, median of {args.repeats} x {args.iters}"
        )
        print(
            f"{'case':<8}{'unfused ms':>12}{'torch fused':>13}{'hp ms':>9}{'vs unfused':>12}"
            f"{'vs torch':>10}"
        )
        for case, un, tf, hp in rows:
            print(
                f"{case:<8}{un * 1e3:>12.3f}{tf * 1e3:>13.3f}{hp * 1e3:>9.3f}{un / hp:>11.2f}x"
                f"{tf / hp:>9.2f}x"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
