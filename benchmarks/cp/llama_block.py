"""A Llama block's step (forward and backward) under context parallelism on CPU ranks against
the same block on one process, one launch.

Each rank holds ``seq / cp`` tokens of the sequence (head-tail load balanced) and runs the
block with ``ContextParallel`` on its attention (hp_trainer's ``apply_context_parallel``: the
rotary tables sharded alike); the anchor is one process running the block on the whole
sequence with the same number of threads per process (one). Prints the medians and the ratio
(CP step time / one-process step time) for each degree.

    python benchmarks/cp/llama_block.py --seq 4096 --cp 2,4 --method ring
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


def _block(args):
    from hp_trainer.models import get_config
    from hp_trainer.models._transformer import TransformerBlock, rotary_tables

    cfg = get_config(
        "llama3-tiny",
        dim=args.dim,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        ffn_hidden=int(args.dim * 8 / 3) // 64 * 64,
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    cos, sin = rotary_tables(cfg)
    return block, cos, sin


def _time(step, args) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        times.append((time.perf_counter() - t0) / args.iters * 1e3)
    return statistics.median(times)


def _one_process(args) -> float:
    torch.set_num_threads(1)
    block, cos, sin = _block(args)
    x = torch.randn(1, args.seq, args.dim, generator=torch.Generator().manual_seed(1))

    def step():
        block(x.requires_grad_(), cos, sin).sum().backward()

    return _time(step, args)


def run(rank, world, args, path, queue):
    init_rank(rank, world, path, threads=1)
    import hp_dtensor as hp
    from hp_dtensor.parallel import ContextParallel, context_parallel_shard, parallelize_module

    mesh = hp.init_device_mesh("cpu", (world,))
    block, cos, sin = _block(args)
    parallelize_module(block.attention, mesh, ContextParallel(method=args.method))
    cos, sin = (context_parallel_shard(t[:, : args.seq], mesh, 1) for t in (cos, sin))
    x = torch.randn(1, args.seq, args.dim, generator=torch.Generator().manual_seed(1))
    xl = context_parallel_shard(x, mesh, 1)

    def step():
        block(xl.requires_grad_(), cos, sin).sum().backward()

    finish(rank, world, args, _time(step, args), queue, report)


def report(args, world, results) -> None:
    ms = max(results.values())  # the step ends when the slowest rank's does
    print(f"| {world} | {args.method} | {ms:.1f} | {args.one:.1f} | {ms / args.one:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--method", default="ring", choices=["ring", "allgather", "ulysses"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(
        f"# CPU, torch {torch.__version__}, Llama block dim {args.dim}, {args.heads} heads "
        f"({args.kv_heads} kv), seq {args.seq}, fp32, 1 thread per process, {os.cpu_count()} "
        "cores"
    )
    args.one = _one_process(args)
    print("| cp | method | CP ms/step (slowest rank) | one process ms/step | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for cp in (int(c) for c in args.cp.split(",")):
        launch(run, report, args, world=cp)


if __name__ == "__main__":
    main()
