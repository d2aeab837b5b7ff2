"""Expert parallelism on CPU ranks: a MoE layer's forward + backward with the one-sided
dispatcher (hp-kernels' shared-memory all-to-all) against the all-to-all dispatcher on gloo, in
one launch, on the same tokens and weights. Also the dispatch + combine alone (no expert
compute). Ratio > 1: one-sided faster.

    python benchmarks/moe/dispatch.py                   # EP 2 and EP 4
    python benchmarks/moe/dispatch.py --world 4 --tokens 4096 --repeats 7

Each figure is the median over ``--repeats`` rounds of the slowest rank's mean time per step
(``--iters`` steps); implementations alternate within each round. Like the collectives
benchmark, ranks allocate on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402

IMPLS = ("all_to_all", "one_sided")


def _layers(args, world):
    import hp_dtensor as hp
    import hp_moe
    from hp_dtensor.parallel import parallelize_module

    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for name in IMPLS:
        torch.manual_seed(0)
        moe = hp_moe.MoE(args.dim, args.hidden, args.experts, args.top_k, score_func="sigmoid")
        parallelize_module(moe, mesh, {"experts": hp_moe.ExpertParallel(dispatcher=name)})
        out[name] = moe
    return out


def run(rank, world, args, path, queue):
    init_rank(rank, world, path)
    layers = _layers(args, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, args.tokens, args.dim, generator=g)
    up = torch.randn(1, args.tokens, args.dim, generator=g)

    def layer_step(moe):
        xx = x.detach().requires_grad_(True)
        out = moe(xx)
        out.backward(up)

    def dispatch_step(moe):
        flat = x[0].detach().requires_grad_(True)
        s, i, _ = moe.router(flat)
        d = moe.experts.dispatcher
        tokens, counts, ctx = d.dispatch(flat, s.detach(), i)
        y = d.combine(tokens * 2.0, ctx)
        y.backward(up[0])

    outs = {}
    for kind, fn in (("layer fwd+bwd", layer_step), ("dispatch+combine fwd+bwd", dispatch_step)):
        for moe in layers.values():
            for _ in range(args.warmup):
                fn(moe)
        times = {n: [] for n in IMPLS}
        for _ in range(args.repeats):
            for name, moe in layers.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn(moe)
                dt = torch.tensor([(time.perf_counter() - t0) / args.iters * 1e3])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(float(dt))
        outs[kind] = {n: statistics.median(v) for n, v in times.items()}
    finish(rank, world, args, outs, queue, report)


def report(args, world, results):
    res = results[0]
    print(
        f"# EP {world} on CPU ranks: {args.tokens} tokens per rank, dim {args.dim}, "
        f"{args.experts} experts, top-{args.top_k}, expert hidden {args.hidden}, fp32; torch "
        f"{torch.__version__}; median of {args.repeats} x {args.iters} steps, slowest rank"
    )
    print("| EP | what | gloo all-to-all ms | one-sided ms | one-sided / gloo speedup |")
    print("| --- | --- | --- | --- | --- |")
    for kind, t in res.items():
        a, b = t["all_to_all"], t["one_sided"]
        print(f"| {world} | {kind} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu"])
    args = ap.parse_args()
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    for world in args.world:
        launch(run, report, args, world=world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
