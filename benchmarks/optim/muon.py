"""Muon's orthogonalisation on FSDP-sharded matrices: whole-matrix work spread over owner ranks
(hp_optim.orthogonalize) against the naive version that all-gathers every matrix on every rank,
in one launch. Prints the median time per optimizer step's orthogonalisation and the speedup
(target >= 1.5x).

    python benchmarks/optim/muon.py                      # CPU: 2 gloo ranks, 16 matrices
    torchrun --nproc_per_node=2 benchmarks/optim/muon.py --device cuda --dim 2048 --count 96
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402


def _run(rank, world, args, path, queue):
    import hp_dtensor as hp
    from hp_optim import orthogonalize

    init_rank(rank, world, path, args.threads)
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = hp.init_device_mesh(dev, (world,))
    g = torch.Generator().manual_seed(0)
    if args.llama:  # the hidden matrices of the 1.3B Llama-style anchor model (24 layers)
        shapes = [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632)]
        shapes = shapes * 24
    else:
        shapes = [(args.dim, args.dim)] * args.count
    mats = [hp.distribute_tensor(torch.randn(*s, generator=g), mesh, [hp.Shard(0)]) for s in shapes]

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    times = {"owner": [], "naive": []}
    for _ in range(2):
        orthogonalize(mats)
        orthogonalize(mats, naive=True)
    for _ in range(args.repeats):
        for kind in times:
            sync()
            t0 = time.perf_counter()
            orthogonalize(mats, naive=kind == "naive")
            sync()
            times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    finish(rank, world, args, med, queue, _report)


def _report(args, world, results):
    what = "the 1.3B model's 168 hidden" if args.llama else f"{args.count} {args.dim}x{args.dim}"
    med = {k: max(r[k] for r in results.values()) for k in ("owner", "naive")}
    print(
        f"Muon orthogonalisation, {what} matrices sharded over "
        f"{world} ranks ({args.device}), torch {torch.__version__}; median of {args.repeats}"
    )
    print(f"naive (all-gather every matrix): {med['naive'] * 1e3:9.2f} ms")
    print(f"owner ranks (hp_optim):          {med['owner'] * 1e3:9.2f} ms")
    print(f"speedup: {med['naive'] / med['owner']:.2f}x (target >= 1.5x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--llama",
        action="store_true",
        help="the 168 hidden matrices of the 1.3B anchor model instead of --dim/--count",
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    return launch(_run, _report, args, world=2)


if __name__ == "__main__":
    sys.exit(main())
