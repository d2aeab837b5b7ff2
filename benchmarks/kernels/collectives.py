"""hp_kernels' one-sided collectives (shared memory) against gloo on the same CPU ranks, in one
launch. Sizes are the bytes a rank receives (all-gather output, all-to-all output, reduce-
scatter input). Ratios > 1 mean hp_kernels is faster. Target: >= 3x gloo at 16 MiB for
all_gather and all_to_all on 4 ranks.

    python benchmarks/kernels/collectives.py                  # 4 ranks, 1 / 16 / 64 MiB
    python benchmarks/kernels/collectives.py --world 2 --sizes 16 --repeats 3

Each figure is the median over ``--repeats`` rounds of the slowest rank's mean time per call
(``--iters`` calls after a barrier). The machine has fewer cores than ranks may be: ranks
sleep in their waits after a few milliseconds so that the others can run.

The ranks allocate on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, PyTorch's switch,
as hp-kernels' README recommends for CPU ranks): reading another process's memory pins its
pages one by one, and 2 MiB pages make those reads 20-35% faster. ``--thp off`` measures
without them; gloo runs with the same setting in the same launch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402

OPS = ["all_gather", "all_to_all", "reduce_scatter", "all_reduce"]


def _calls(op, mib, world):
    """(ours on ordinary tensors, ours with the input in symmetric memory or None, gloo)."""
    from hp_kernels import comm, symm_mem

    n = mib * (1 << 20) // 4  # float32 elements a rank receives
    n -= n % world
    size_in = {"all_gather": n // world, "all_to_all": n, "reduce_scatter": n, "all_reduce": n}[op]
    x = torch.randn(size_in)
    mem = symm_mem.empty((size_in,), torch.float32) if op != "all_reduce" else None
    xs = None
    if mem is not None:
        xs = mem.buffer
        xs.copy_(x)
    if op == "all_gather":
        out = torch.empty(n)
        return (
            lambda: comm.all_gather_into_tensor(out, x),
            lambda: comm.all_gather_into_tensor(out, xs),
            lambda: dist.all_gather_into_tensor(out, x),
        )
    if op == "all_to_all":
        out = torch.empty(n)
        return (
            lambda: comm.all_to_all_single(out, x),
            lambda: comm.all_to_all_single(out, xs),
            lambda: dist.all_to_all_single(out, x),
        )
    if op == "reduce_scatter":
        out = torch.empty(n // world)
        return (
            lambda: comm.reduce_scatter_tensor(out, x),
            lambda: comm.reduce_scatter_tensor(out, xs),
            lambda: dist.reduce_scatter_tensor(out, x),
        )
    return lambda: comm.all_reduce(x), None, lambda: dist.all_reduce(x)


def _time(fn, iters):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def run(rank, world, args, path, queue):
    init_rank(rank, world, path)
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    for mib in args.sizes:
        for op in args.ops:
            fns = dict(zip(("hp", "hp_sym", "gloo"), _calls(op, mib, world)))
            fns = {k: f for k, f in fns.items() if f is not None}
            for fn in fns.values():
                fn()  # warm-up (our workspace is allocated here)
            times = {k: [] for k in fns}
            for _ in range(args.repeats):  # interleaved, so drifts hit all alike
                for k, fn in fns.items():
                    times[k].append(_time(fn, args.iters))
            results[(op, mib)] = {k: statistics.median(v) for k, v in times.items()}
    finish(rank, world, args, results, queue, report)


def report(args, world, results):
    res = results[0]
    print(
        f"hp_kernels.comm vs gloo, {world} CPU ranks, float32, median of {args.repeats} "
        f"x {args.iters} calls (size = bytes a rank receives), huge pages {args.thp}"
    )
    print("hp: ordinary tensors; hp sym: the input already in symmetric memory (read in place)")
    print(
        f"{'op':<16}{'MiB':>5}{'hp ms':>9}{'sym ms':>9}{'gloo ms':>9}{'hp GB/s':>9}"
        f"{'hp/gloo':>9}{'sym/gloo':>9}"
    )
    for (op, mib), t in res.items():
        gbs = mib * (1 << 20) / t["hp"] / 1e9
        sym = t.get("hp_sym")
        print(
            f"{op:<16}{mib:>5}{t['hp'] * 1e3:>9.2f}"
            f"{(f'{sym * 1e3:.2f}' if sym else '-'):>9}{t['gloo'] * 1e3:>9.2f}{gbs:>9.2f}"
            f"{t['gloo'] / t['hp']:>8.2f}x" + (f"{t['gloo'] / sym:>8.2f}x" if sym else f"{'-':>9}")
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MiB")
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu"])
    ap.add_argument("--thp", default="on", choices=["on", "off"], help="huge pages (see above)")
    args = ap.parse_args()
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1" if args.thp == "on" else "0"  # ranks inherit it
    return launch(run, report, args, world=args.world)


if __name__ == "__main__":
    sys.exit(main())
