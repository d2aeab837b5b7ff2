"""Pipeline schedules on a Llama-style model: hp_pipeline against torch.distributed.pipelining.

The model is split into 2 stages per rank count (GPipe, 1F1B: one stage per rank; interleaved
1F1B and ZBV: two per rank); both libraries run the same split, data and optimizer (AdamW) in
one launch, interleaved repeat by repeat. Prints, per schedule, the median step time, tokens/s
per GPU, the ratio (ours / PyTorch; target >= 1.0) and peak memory per rank, then our measured
bubble (one extra step with a recorded timeline, mean over ranks), and each implementation's
loss after the first and the last step against PyTorch's (same weights, data and step count).
``--threaded`` adds ours with ``threaded_b_f`` (interleaved, ZBV), ``--cuda-graphs`` ours with
``PipelineStage(cuda_graphs=True)`` (every schedule).

    python benchmarks/pipeline/llama.py                       # CPU: 2 gloo ranks, tiny model
    torchrun --nproc_per_node=2 benchmarks/pipeline/llama.py --device cuda --dim 2048 \\
        --layers 24 --heads 16 --kv-heads 16 --hidden 5632 --vocab 32000 --seq 2048 \\
        --microbatches 8 --mb-size 1 --bf16
"""

from __future__ import annotations

import argparse
import functools
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

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]


def _loss(logits, target):
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _run(rank, world, args, path, queue):
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp

    import hp_pipeline as hpp
    from hp_testing.models import LlamaStage, TinyLlama

    warnings.simplefilter("ignore")
    init_rank(rank, world, path, args.threads)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else None
    dev = dev or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    full = TinyLlama(**model_config(args))
    m = args.microbatches
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (m * args.mb_size, args.seq), generator=g).to(dev)
    ours_cls = {
        "gpipe": hpp.ScheduleGPipe,
        "1f1b": hpp.Schedule1F1B,
        "interleaved_1f1b": hpp.ScheduleInterleaved1F1B,
        "zbv": hpp.ScheduleZBV,
    }
    torch_cls = {
        "gpipe": tpp.ScheduleGPipe,
        "1f1b": tpp.Schedule1F1B,
        "interleaved_1f1b": tpp.ScheduleInterleaved1F1B,
        "zbv": tpp.ScheduleZBVZeroBubble,
    }
    results = {}
    for name in args.schedules:
        v = 1 if name in ("gpipe", "1f1b") else 2
        n = world * v
        placement = hpp.build_schedule(name, world, m)[1]
        mine = [s for s in range(n) if placement[s] == rank]
        bounds = [round(i * args.layers / n) for i in range(n + 1)]
        runs = {}
        impls = ["torch", "ours"] + ["ours_ov"] * args.overlap
        # GPipe has no B+F pair; 1F1B's pair makes each rank wait for the other's (B + F)
        impls += ["ours_th"] * (args.threaded and name in ("interleaved_1f1b", "zbv"))
        impls += ["ours_cg"] * args.cuda_graphs
        for impl in impls:
            mods = {
                s: LlamaStage(full, bounds[s], bounds[s + 1], s == 0, s == n - 1).to(dev)
                for s in mine
            }
            if impl.startswith("ours"):
                stages = [
                    hpp.PipelineStage(mods[s], s, n, device=dev, cuda_graphs=impl == "ours_cg")
                    for s in mine
                ]
                sched = ours_cls[name](
                    stages if v > 1 else stages[0],
                    m,
                    loss_fn=_loss,
                    overlap_p2p=impl == "ours_ov",
                    overlap_b_f=impl == "ours_th",
                    threaded_b_f=impl == "ours_th",
                )
            else:
                stages = [tpp.PipelineStage(mods[s], s, n, dev) for s in mine]
                sched = torch_cls[name](stages if v > 1 else stages[0], m, loss_fn=_loss)
            params = [p for mod in mods.values() for p in mod.parameters()]
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
            runs[impl] = (sched, opt, 0 in mine, n - 1 in mine)

        def step(impl, runs=runs, losses=None):
            sched, opt, first, last = runs[impl]
            tgt = {"target": ids, "losses": losses} if last else {}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                sched.step(*((ids,) if first else ()), **tgt)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def loss_step(impl, into, step=step):
            """One step; on the rank with the last stage, its mean microbatch loss into
            ``into[impl]``."""
            got = []
            step(impl, losses=got)
            if got:
                into[impl] = float(sum(x.float().item() for x in got) / len(got))

        def sync():
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        times = {k: [] for k in runs}
        peak = {k: 0.0 for k in runs}
        # every impl starts from the same weights and data: the same first loss. That step
        # counts as a warm-up one (one runs even with --warmup 0)
        first_loss = {}
        for k in runs:
            loss_step(k, first_loss)
            for _ in range(args.warmup - 1):
                step(k)
        for _ in range(args.repeats):
            for k in runs:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    step(k)
                sync()
                times[k].append((time.perf_counter() - t0) / args.iters)
                if cuda:
                    peak[k] = max(peak[k], torch.cuda.max_memory_allocated() / 2**30)
        if args.profile:
            for k in runs:
                profile_tables(
                    args, rank, f"{name}_{k}", functools.partial(step, k), trace=bool(args.trace)
                )
        last_loss = {}  # after the same number of steps: a wrong gradient shows here
        for k in runs:
            loss_step(k, last_loss)
        sched = runs["ours"][0]
        sync()
        sched.record_timeline = True
        step("ours")
        sched.record_timeline = False
        bubble = sched.bubble_fraction()
        if args.trace:  # every rank's own timeline
            os.makedirs(args.trace, exist_ok=True)
            path = os.path.join(args.trace, f"{name}_rank{rank}.json")
            hpp.to_chrome_trace(sched.timeline, path)
        results[name] = {k: (statistics.median(times[k]), peak[k]) for k in runs}
        results[name]["bubble"] = bubble
        both = [None] * world
        dist.all_gather_object(both, (first_loss, last_loss))
        results[name]["loss0"] = {k: v for f, _ in both for k, v in f.items()}
        results[name]["loss1"] = {k: v for _, la in both for k, v in la.items()}
        del runs, sched, step
        if cuda:
            torch.cuda.empty_cache()
    finish(rank, world, args, results, queue, _report)


def _report(args, world, results):
    tokens = args.microbatches * args.mb_size * args.seq
    print(
        f"pipeline Llama-style fwd+bwd+AdamW, {args.device}, {world} ranks, dim {args.dim}, "
        f"{args.layers} layers, vocab {args.vocab}, {args.microbatches} microbatches of "
        f"{args.mb_size}x{args.seq}, bf16 autocast={args.bf16}, overlap_p2p also={args.overlap}, "
        f"threaded_b_f also={args.threaded}, "
        f"torch {torch.__version__}; median of {args.repeats} x {args.iters}"
    )
    print(
        f"{'schedule':18s} {'impl':6s} {'ms/step':>9s} {'tok/s/GPU':>10s} "
        f"{'peak GiB (per rank)':>22s} {'bubble':>7s}"
    )
    for name in args.schedules:
        rows = {}
        impls = [
            k for k in ("torch", "ours", "ours_ov", "ours_th", "ours_cg") if k in results[0][name]
        ]
        for k in impls:
            med = max(r[name][k][0] for r in results.values())
            peaks = " / ".join(f"{results[r][name][k][1]:.1f}" for r in sorted(results))
            rows[k] = med
            bubs = [r[name]["bubble"] for r in results.values()]
            bub = sum(bubs) / len(bubs) if k == "ours" else None
            print(
                f"{name:18s} {k:6s} {med * 1e3:9.1f} {tokens / med / world:10.0f} {peaks:>22s} "
                + (f"{bub:7.3f}" if bub is not None else f"{'-':>7s}")
            )
        for k in impls[1:]:
            print(f"{name:18s} ratio {k}/PyTorch: {rows['torch'] / rows[k]:.3f}")
        for key, what in (("loss0", "first"), ("loss1", "last")):
            loss = results[0][name][key]
            if "torch" in loss:
                diffs = ", ".join(
                    f"{k} {abs(v - loss['torch']) / abs(loss['torch']):.1e}"
                    for k, v in loss.items()
                    if k != "torch"
                )
                print(f"{name:18s} {what}-step loss {loss['torch']:.5f}; relative to it: {diffs}")
        if name == "zbv" and "1f1b" in args.schedules:  # the ZBV target is against this
            t1 = max(r["1f1b"]["torch"][0] for r in results.values())
            for k in impls[1:]:
                print(f"{name:18s} ratio {k}/PyTorch 1F1B: {t1 / rows[k]:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, seq=64, kv_heads=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--mb-size", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 parameters)")
    ap.add_argument("--overlap", action="store_true", help="also ours with overlap_p2p=True")
    ap.add_argument(
        "--threaded",
        action="store_true",
        help="also ours with overlap_b_f=True, threaded_b_f=True (ours_th)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also ours with PipelineStage(cuda_graphs=True) (ours_cg)",
    )
    ap.add_argument("--profile", default="", help="folder for torch.profiler tables (rank 0)")
    ap.add_argument(
        "--trace",
        default="",
        help="folder for our timeline's Chrome trace (with --profile: the profiler's too)",
    )
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    add_timing_args(ap, repeats=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    return launch(_run, _report, args, world=2)


if __name__ == "__main__":
    sys.exit(main())
