"""fully_shard on a Llama-style model, forward + backward + AdamW: hp_fsdp against FSDP2.

Both shard the same model (per block, then the root) and train on the same data in one launch,
interleaved; prints the median step time, tokens/s per rank, the ratio (ours / FSDP2; target
>= 1.0) and peak memory on GPUs.

    python benchmarks/fsdp/llama.py                       # CPU: 2 gloo ranks, tiny model
    torchrun --nproc_per_node=2 benchmarks/fsdp/llama.py --device cuda --dim 2048 --layers 24 \\
        --heads 16 --kv-heads 16 --hidden 5632 --vocab 32000 --seq 2048 --batch 4 --bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import (  # noqa: E402
    add_model_args,
    add_timing_args,
    finish,
    init_rank,
    launch,
    model_config,
    profile_tables,
)


def _run(rank, world, args, path, queue):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import hp_dtensor as hp
    from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from hp_testing.models import TinyLlama

    warnings.simplefilter("ignore")
    init_rank(rank, world, path, args.threads)
    dev = (
        torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    cfg = model_config(args)
    runs = {}
    for kind in ("ours", "torch"):
        torch.manual_seed(0)
        with torch.device(dev):
            model = TinyLlama(**cfg)
        if kind == "ours":
            mesh = hp.init_device_mesh(args.device, (world,))
            mpp = (
                MixedPrecisionPolicy(torch.bfloat16, torch.float32)
                if args.bf16
                else MixedPrecisionPolicy()
            )
            shard = fully_shard
            offload = CPUOffloadPolicy() if args.offload else None
        else:
            mesh = init_device_mesh(args.device, (world,))
            mpp = TorchMP(torch.bfloat16, torch.float32) if args.bf16 else TorchMP()
            shard = torch_fully_shard
            offload = TorchOffload() if args.offload else None
        kw = {"offload_policy": offload} if offload is not None else {}
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=mpp, **kw)
        shard(model, mesh=mesh, mp_policy=mpp, **kw)
        runs[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)

    def step(model, opt):
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in runs}
    peak = dict.fromkeys(runs, 0.0)
    losses = {}
    for _ in range(args.warmup):
        for k in runs:
            step(*runs[k])
    # repeats alternate between the two, so drift in clocks or neighbours hits both alike
    for _ in range(args.repeats):
        for k in runs:
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                losses[k] = step(*runs[k])
            sync()
            times[k].append((time.perf_counter() - t0) / args.iters)
            if args.device == "cuda":
                peak[k] = max(peak[k], torch.cuda.max_memory_allocated() / 2**30)
    if args.profile:
        for k in runs:
            profile_tables(args, rank, f"fsdp_{k}", lambda k=k: step(*runs[k]), trace=args.trace)
    # same init, data and step count: the last losses agree (to bf16 noise with --bf16)
    res = {k: (statistics.median(v), peak[k], float(losses[k])) for k, v in times.items()}
    finish(rank, world, args, res, queue, _report)


def _report(args, world, results):
    tokens = args.batch * args.seq
    print(
        f"fully_shard Llama-style fwd+bwd+AdamW, {args.device}, {world} ranks, dim {args.dim}, "
        f"{args.layers} layers, vocab {args.vocab}, batch {args.batch}x{args.seq}, "
        f"bf16={args.bf16}, offload={args.offload}, torch {torch.__version__}; "
        f"median of {args.repeats} x {args.iters}"
    )
    med = {k: max(r[k][0] for r in results.values()) for k in ("ours", "torch")}
    peak = {k: max(r[k][1] for r in results.values()) for k in ("ours", "torch")}
    print(f"{'impl':8s} {'ms/step':>9s} {'tokens/s/rank':>14s} {'peak GiB':>9s}")
    for k in ("torch", "ours"):
        print(f"{k:8s} {med[k] * 1e3:9.2f} {tokens / med[k]:14.0f} {peak[k]:9.2f}")
    loss = {k: results[0][k][2] for k in ("ours", "torch")}
    print(f"last loss (rank 0): ours {loss['ours']:.6f}, FSDP2 {loss['torch']:.6f}")
    print(f"throughput ratio ours/FSDP2: {med['torch'] / med['ours']:.3f} (target >= 1.0)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, seq=64, kv_heads=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy for both")
    add_timing_args(ap, repeats=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default="", help="folder for torch.profiler tables (rank 0)")
    ap.add_argument("--trace", action="store_true", help="with --profile: Chrome traces too")
    args = ap.parse_args(argv)
    return launch(_run, _report, args, world=2)


if __name__ == "__main__":
    sys.exit(main())
