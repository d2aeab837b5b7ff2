"""CPU time per dispatched DTensor op: hp_dtensor against torch.distributed.tensor.

Both libraries run the same ops on the same small tensors in one launch (2 gloo ranks, one
thread each). For every op the table gives the median time per call, the time of the same op on
plain local tensors, the dispatch overhead (the difference) and the ratio of our overhead to
PyTorch's. Target (issue 2): ratio <= 0.5 for add, mm, a view and a cached redistribution.

    python benchmarks/dtensor/dispatch_overhead.py [--repeats 7] [--iters 2000] [--world 2]
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


def _time_per_call(fn, iters: int, repeats: int, sync=lambda: None) -> float:
    for _ in range(max(50, iters // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def _run(rank, world, args, path, queue):
    init_rank(rank, world, path, threads=1)
    iters, repeats, device = args.iters, args.repeats, args.device
    warnings.simplefilter("ignore")
    from torch.distributed import tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hp_dtensor as hp

    ours_mesh = hp.init_device_mesh(device, (world,))
    torch_m = torch_mesh(device, (world,))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x, y, w = (torch.randn(16, 16, device=ours_mesh.device) for _ in range(3))

    def both(placements):
        ours = [hp.distribute_tensor(t, ours_mesh, [p]) for t, p in zip((x, y, w), placements)]
        tp = {hp.Shard(0): tdt.Shard(0), hp.Replicate(): tdt.Replicate()}
        theirs = [tdt.distribute_tensor(t, torch_m, [tp[p]]) for t, p in zip((x, y, w), placements)]
        return ours, theirs

    (a, b, r), (ta, tb, tr) = both([hp.Shard(0), hp.Shard(0), hp.Replicate()])
    la, lb, lr = a.to_local(), b.to_local(), r.to_local()
    R, S0 = [hp.Replicate()], [hp.Shard(0)]
    TR, TS0 = [tdt.Replicate()], [tdt.Shard(0)]
    n = la.shape[0]
    gather_out = torch.empty(16, 16, device=x.device)
    cases = [
        ("add  (S0 + S0)", lambda: a + b, lambda: ta + tb, lambda: la + lb),
        (
            "mm   (S0 @ R)",
            lambda: torch.mm(a, r),
            lambda: torch.mm(ta, tr),
            lambda: torch.mm(la, lr),
        ),
        ("view (S0 -> flat)", lambda: a.view(-1), lambda: ta.view(-1), lambda: la.view(-1)),
        (
            "redistribute R->S0 (cached)",
            lambda: r.redistribute(ours_mesh, S0),
            lambda: tr.redistribute(torch_m, TS0),
            lambda: lr.narrow(0, rank * n, n),
        ),
        (
            "redistribute S0->R (all-gather)",
            lambda: a.redistribute(ours_mesh, R),
            lambda: ta.redistribute(torch_m, TR),
            lambda: dist.all_gather_into_tensor(gather_out, la),
        ),
    ]
    rows = []
    for name, ours, theirs, plain in cases:
        # interleave the three so that drift on a busy machine hits all of them alike
        o, t, p = [], [], []
        for _ in range(repeats):
            o.append(_time_per_call(ours, iters, 1, sync))
            t.append(_time_per_call(theirs, iters, 1, sync))
            p.append(_time_per_call(plain, iters, 1, sync))
        rows.append((name, statistics.median(p), statistics.median(t), statistics.median(o)))
    finish(rank, world, args, rows, queue, _report)


def _report(args, world, results):
    print(
        f"torch {torch.__version__}, {args.device}, {world} gloo ranks, 1 thread each, "
        f"median of {args.repeats} x {args.iters} calls, rank 0 (us per call)"
    )
    head = (
        f"{'op':34s} {'plain':>7s} {'torch':>8s} {'ours':>8s} {'torch ovh':>9s} "
        f"{'ours ovh':>9s} {'ratio':>6s}"
    )
    print(head)
    print("-" * len(head))
    worst = 0.0
    for name, plain, theirs, ours in results[0]:
        to, oo = theirs - plain, ours - plain
        ratio = oo / to if to > 0 else float("nan")
        if "all-gather" not in name:
            worst = max(worst, ratio)
        print(f"{name:34s} {plain:7.2f} {theirs:8.2f} {ours:8.2f} {to:9.2f} {oo:9.2f} {ratio:6.2f}")
    print(f"worst overhead ratio (target <= 0.50, all-gather excluded): {worst:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: tensors on the GPU (ranks share GPU 0), gloo between ranks",
    )
    args = ap.parse_args(argv)
    return launch(_run, _report, args, world=args.world)


if __name__ == "__main__":
    sys.exit(main())
