"""Shared launch code for the benchmarks: spawn gloo ranks (CPU) or run under torchrun (GPU),
collect each rank's result, and fail instead of waiting forever when a rank dies.

A benchmark script defines ``run(rank, world, args, path, queue)`` (which calls
:func:`init_rank` first and :func:`finish` last) and ``report(args, world, results)``, and its
``main`` calls :func:`launch`.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["add_model_args", "add_timing_args", "finish", "init_rank", "launch", "model_config"]


def add_model_args(ap, *, seq: int = 64, kv_heads: int = 2) -> None:
    """``--device`` and the Llama-style model's shape (tiny by default, for CPU runs; pass the
    anchor's shapes on GPUs)."""
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=kv_heads)
    ap.add_argument("--hidden", type=int, default=344)
    ap.add_argument("--seq", type=int, default=seq)


def add_timing_args(ap, *, repeats: int = 5) -> None:
    """Warm-up steps, steps per timed repeat, repeats (the median is reported)."""
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=repeats)


def model_config(args) -> dict:
    """``TinyLlama`` keyword arguments from :func:`add_model_args`' options."""
    return dict(
        vocab=args.vocab,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        hidden=args.hidden,
        seq=args.seq,
    )


def init_rank(rank: int, world: int, path: str | None, threads: int = 1) -> None:
    """In a spawned rank (``path`` set): torchrun-like environment and a gloo group over a file
    rendezvous. Under torchrun (``path`` None) the group exists already; nothing to do."""
    if path is None:
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.set_num_threads(threads)


def finish(rank: int, world: int, args, result, queue, report) -> None:
    """Hand this rank's ``result`` to the launcher (spawned) or print the report on rank 0
    (torchrun), then tear the group down."""
    if queue is not None:
        queue.put((rank, result))
    elif rank == 0:
        report(args, world, {0: result})
    dist.barrier()
    dist.destroy_process_group()


def launch(run, report, args, *, world: int = 2) -> int:
    """Run ``run(rank, world, args, path, queue)`` on every rank, then ``report(args, world,
    {rank: result})``.

    Under torchrun (``RANK`` set) the group is torchrun's (NCCL for ``args.device == "cuda"``):
    ``run`` gets ``path`` and ``queue`` None and rank 0 reports. Otherwise ``world`` gloo ranks
    are spawned here.
    """
    if "RANK" in os.environ:
        backend = getattr(args, "backend", None) or ("nccl" if args.device == "cuda" else "gloo")
        dist.init_process_group(backend)
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, None)
        return 0
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=run, args=(r, world, args, path, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = _collect(q, procs)
        for p in procs:
            p.join(timeout=120)
    report(args, world, results)
    return 0


def _collect(q, procs, timeout_s: float = 900.0) -> dict:
    """Results from every rank; kills the rest and exits when one dies or time runs out."""
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            rank, value = q.get(timeout=1.0)
            results[rank] = value
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                msg = f"benchmark ranks {dead or 'timed out'} failed; see above"
                raise SystemExit(msg) from None
    return results


def profile_tables(args, rank: int, name: str, fn, *, trace: bool = False) -> None:
    """Profile one call of ``fn`` and write each rank's top operators by self CPU and GPU time
    to ``{args.profile}/{name}.txt`` (rank 0) or ``{name}_rank{rank}.txt``; with ``trace`` also
    every rank's Chrome trace (``{name}_rank{rank}.json.gz``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
    os.makedirs(args.profile, exist_ok=True)
    if trace:
        prof.export_chrome_trace(os.path.join(args.profile, f"{name}_rank{rank}.json.gz"))
    base = name if rank == 0 else f"{name}_rank{rank}"
    with open(os.path.join(args.profile, f"{base}.txt"), "w") as f:
        for key in ("self_cpu_time_total", "self_device_time_total"):
            if key == "self_device_time_total" and args.device != "cuda":
                continue
            f.write(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
