"""hp_kernels' one-sided CUDA collectives (PyTorch symmetric memory, copy-engine peer copies)
against NCCL on the same GPUs, in one launch; GPU-side time from CUDA events. Sizes are the
bytes a rank receives (all-gather output, all-to-all output), bf16, as nccl-tests counts them.
Ratio > 1 means hp_kernels is faster. Target: >= 1.2x NCCL at 256 MiB.

    torchrun --standalone --nproc_per_node=2 benchmarks/kernels/gpu_collectives.py
    (set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch
import torch.distributed as dist

REQUIRES_CUDA = True  # nox -s bench runs it only where CUDA is

OPS = ["all_gather", "all_to_all", "reduce_scatter", "all_reduce"]


def _calls(op, mib, world, dev):
    """(ours, ours with the input in symmetric memory or None, ours writing into an output in
    symmetric memory or None, NCCL)."""
    from hp_kernels import comm, symm_mem

    n = mib * (1 << 20) // 2
    n -= n % world
    bf = torch.bfloat16
    if op == "all_gather":
        x, out = torch.randn(n // world, device=dev).to(bf), torch.empty(n, device=dev, dtype=bf)
        xs = symm_mem.empty(x.shape, bf, device=dev).buffer
        xs.copy_(x)
        return (
            lambda: comm.all_gather_into_tensor(out, x),
            lambda: comm.all_gather_into_tensor(out, xs),
            None,
            lambda: dist.all_gather_into_tensor(out, x),
        )
    if op == "all_to_all":
        x, out = torch.randn(n, device=dev).to(bf), torch.empty(n, device=dev, dtype=bf)
        xs = symm_mem.empty(x.shape, bf, device=dev).buffer
        xs.copy_(x)
        outs = symm_mem.empty(out.shape, bf, device=dev).buffer
        return (
            lambda: comm.all_to_all_single(out, x),
            lambda: comm.all_to_all_single(out, xs),
            lambda: comm.all_to_all_single(outs, x),
            lambda: dist.all_to_all_single(out, x),
        )
    if op == "reduce_scatter":
        x, out = torch.randn(n, device=dev).to(bf), torch.empty(n // world, device=dev, dtype=bf)
        return (
            lambda: comm.reduce_scatter_tensor(out, x),
            None,
            None,
            lambda: dist.reduce_scatter_tensor(out, x),
        )
    x = torch.randn(n, device=dev).to(bf)
    return lambda: comm.all_reduce(x), None, None, lambda: dist.all_reduce(x)


def _time(fn, iters):
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters / 1e3], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def init_gpu():
    """Under torchrun: this rank's GPU and an NCCL group; returns (world, rank, device)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    return dist.get_world_size(), dist.get_rank(), dev


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256], help="MiB")
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    world, rank, dev = init_gpu()
    rows = []
    for mib in args.sizes:
        for op in args.ops:
            fns = dict(zip(("hp", "sym", "push", "nccl"), _calls(op, mib, world, dev)))
            fns = {k: f for k, f in fns.items() if f is not None}
            for _ in range(3):
                for fn in fns.values():
                    fn()
            t = {k: [] for k in fns}
            for _ in range(args.repeats):
                for k, fn in fns.items():
                    t[k].append(_time(fn, args.iters))
            rows.append((op, mib, {k: statistics.median(v) for k, v in t.items()}))
    if rank == 0:
        factor = {
            "all_gather": (world - 1) / world,
            "all_to_all": (world - 1) / world,
            "reduce_scatter": (world - 1) / world,
            "all_reduce": 2 * (world - 1) / world,
        }
        print(
            f"hp_kernels.comm vs NCCL, {world} x {torch.cuda.get_device_name()}, bf16, GPU time, "
            f"median of {args.repeats} x {args.iters} calls; busbw as nccl-tests; sym: the input "
            "already in symmetric memory (read in place); push: the output in symmetric memory "
            "(peers write into it)"
        )
        print(
            f"{'op':<16}{'MiB':>5}{'hp us':>9}{'sym us':>9}{'nccl us':>9}{'hp busbw':>10}"
            f"{'nccl bw':>9}{'hp/nccl':>9}{'sym/nccl':>9}{'push us':>9}{'push/nccl':>10}"
        )
        for op, mib, t in rows:
            size = mib * (1 << 20) * (world if op == "reduce_scatter" else 1)
            hp, nc, sym, push = t["hp"], t["nccl"], t.get("sym"), t.get("push")
            bw = lambda v, size=size, op=op: size * factor[op] / v / 1e9  # noqa: E731
            print(
                f"{op:<16}{mib:>5}{hp * 1e6:>9.1f}{(f'{sym * 1e6:.1f}' if sym else '-'):>9}"
                f"{nc * 1e6:>9.1f}{bw(hp):>10.1f}{bw(nc):>9.1f}{nc / hp:>8.2f}x"
                + (f"{nc / sym:>8.2f}x" if sym else f"{'-':>9}")
                + (f"{push * 1e6:>9.1f}{nc / push:>9.2f}x" if push else f"{'-':>9}{'-':>10}")
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
