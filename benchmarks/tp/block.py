"""TP=2 Llama block, forward + backward: hp_dtensor.parallel against PyTorch's TP.

Both run the same block (RMSNorm, RoPE + grouped-query attention, SwiGLU; the model lives in
packages/hp-dtensor/tests/distributed/llama_block.py) with the same torchtitan plan, in one
launch, interleaved. Prints the median time per step and the throughput ratio (ours / PyTorch;
target >= 1.0).

    python benchmarks/tp/block.py                         # CPU: 2 gloo ranks, small shapes
    python benchmarks/tp/block.py --sp                    # with sequence parallelism
    python benchmarks/tp/block.py --sp --async-tp         # and ours with MC2 (async TP)
    torchrun --nproc_per_node=2 benchmarks/tp/block.py --device cuda --dim 4096 --seq 4096 \\
        --heads 32 --kv-heads 8 --hidden 11008 --batch 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "packages", "hp-dtensor", "tests", "distributed"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402


def _run(rank, world, args, path, queue):
    import llama_block as lb

    warnings.simplefilter("ignore")
    init_rank(rank, world, path, args.threads)
    from torch.distributed.device_mesh import init_device_mesh

    import hp_dtensor as hp

    device = (
        torch.device(args.device, rank % max(torch.cuda.device_count(), 1))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ours_mesh = hp.init_device_mesh(args.device, (world,))
    torch_mesh = init_device_mesh(args.device, (world,))
    models = {}
    kinds = [("ours", ours_mesh, None), ("torch", torch_mesh, None)]
    if args.async_tp:  # ours with the row-parallel reduce-scatters fused (hp-kernels' MC2)
        from hp_dtensor.parallel import CollectiveMatmul
        from hp_kernels import mc2

        fused = CollectiveMatmul(mc2.all_gather_matmul, mc2.matmul_reduce_scatter)
        kinds.append(("ours_async", ours_mesh, {"collective_matmul": fused}))
    for kind, mesh, row_kwargs in kinds:
        torch.manual_seed(0)
        with torch.device(device):
            m = lb.Block(args.dim, args.heads, args.kv_heads, args.hidden).to(dtype)
        styles, parallelize = lb.tp_library(kind.removesuffix("_async"))
        parallelize(m, mesh, lb.tp_plan(styles, sequence_parallel=args.sp, row_kwargs=row_kwargs))
        models[kind] = m
    cos, sin = lb.rope_tables(args.seq, args.dim // args.heads)
    cos, sin = cos.to(device, dtype), sin.to(device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim, generator=g).to(device, dtype)
    if args.sp:
        x = x.chunk(world, dim=1)[rank].contiguous()

    def step(m):
        out = m(x, cos, sin)
        out.float().pow(2).mean().backward()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in models}
    for _ in range(args.warmup):
        for k in models:
            step(models[k])
    for _ in range(args.repeats):
        for k in models:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(models[k])
            sync()
            times[k].append((time.perf_counter() - t0) / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    finish(rank, world, args, med, queue, _report)


def _report(args, world, results):
    tokens = args.batch * args.seq
    print(
        f"TP={world} Llama block fwd+bwd, {args.device}, dim {args.dim}, heads "
        f"{args.heads}/{args.kv_heads}, hidden {args.hidden}, batch {args.batch}, seq "
        f"{args.seq}, {args.dtype}, sp={args.sp}, torch {torch.__version__}; median of "
        f"{args.repeats} x {args.iters} steps, max over ranks"
    )
    ours = max(r["ours"] for r in results.values())
    theirs = max(r["torch"] for r in results.values())
    rows = [("torch", theirs), ("ours", ours)]
    if args.async_tp:
        rows.append(("ours_async", max(r["ours_async"] for r in results.values())))
    print(f"{'impl':10s} {'ms/step':>9s} {'tokens/s':>11s}")
    for name, t in rows:
        print(f"{name:10s} {t * 1e3:9.2f} {tokens / t:11.0f}")
    print(f"throughput ratio ours/torch: {theirs / ours:.3f} (target >= 1.0)")
    if args.async_tp:
        fused = rows[-1][1]
        print(
            f"throughput ratio ours_async/torch: {theirs / fused:.3f}, ours_async/ours: "
            f"{ours / fused:.3f}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=688)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism too")
    ap.add_argument(
        "--async-tp",
        action="store_true",
        help="also ours with the row-parallel reduce-scatters fused into the matmuls (MC2); "
        "needs --sp",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.async_tp and not args.sp:
        ap.error("--async-tp fuses sequence parallelism's collectives: add --sp")
    return launch(_run, _report, args, world=2)


if __name__ == "__main__":
    sys.exit(main())
