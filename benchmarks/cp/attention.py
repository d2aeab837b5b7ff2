"""The blockwise attention path of context parallelism against one fused SDPA call on the same
work, in one process.

Context parallelism's ring (and all-gather) attention computes each rank's queries against
every rank's keys as blocks of whole chunks (full or causal) with a fused kernel that returns
the log-sum-exp, merges the partial outputs in float32, and in backward recomputes each block
from the merged output, the key/value gradients travelling with their blocks. Here all
``cp`` ranks' blocks run on one device (``hp_dtensor.parallel._context``'s own forward, merge
and ring backward steps, ``_ring_in_one_process``: keys, values and gradient accumulators
handed over directly instead of sent): together they are the whole sequence's causal
attention, which the anchor computes in one ``scaled_dot_product_attention`` call (its own
choice: cuDNN on Hopper, also timed flash-only; the CPU flash kernel on CPU), forward and
backward. The ratio (ours / SDPA) minus one is the blocking's overhead.

    python benchmarks/cp/attention.py --device cuda --seqs 32768,131072 --cp 2,4
    python benchmarks/cp/attention.py                     # CPU, small sequences
    python benchmarks/cp/attention.py --device cuda --seqs 32768 --cp 8 --profile
        # where the blockwise path's time goes: kernels by device time, launches, host gaps
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hp_dtensor.parallel import _context as ctxp
from hp_dtensor.parallel import _cp_plan as plan


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _pieces(q, k, v, dout, cp, load_balance=True):
    """Each rank's local q, k, v and output gradient (what context_parallel_shard gives)."""
    out = []
    for r in range(cp):
        idx = torch.tensor(plan.positions(q.shape[2], cp, r, load_balance), device=q.device)
        out.append([t.index_select(2, idx) for t in (q, k, v, dout)])
    return out


def _blockwise(pieces, cp, load_balance=True):
    """Every rank's blocks, forward and backward (the ring's own code, its transfers left
    out); returns each rank's output and dq, dk, dv."""
    q, k = pieces[0][0], pieces[0][1]
    cfgs = [
        ctxp._Config(
            mesh=None,
            cp=cp,
            rank=r,
            load_balance=load_balance,
            causal=True,
            scale=q.shape[-1] ** -0.5,
            groups=q.shape[1] // k.shape[1],
            method="ring",
            overlap=False,
        )
        for r in range(cp)
    ]
    return [list(t) for t in zip(*ctxp._ring_in_one_process(pieces, cfgs))]


def _sdpa(q, k, v, dout, backend=None):
    """SDPA forward and backward on the whole sequence (its own kernel choice, or
    ``backend``)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def _time(fn, dev, warmup, iters, repeats):
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seqs", default="", help="comma-separated sequence lengths")
    ap.add_argument("--cp", default="2,4", help="comma-separated context-parallel degrees")
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile one blockwise forward + backward per (seq, cp): device time by kernel, "
        "the number of launches and device time against wall time (host-bound or not)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seqs = [int(x) for x in (args.seqs or ("32768,131072" if cuda else "2048,4096")).split(",")]
    heads = args.heads or (16 if cuda else 4)
    d = args.head_dim if cuda else min(args.head_dim, 64)
    if not cuda:
        torch.set_num_threads(2)
    name = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"# {name}, torch {torch.__version__}, {dtype}, batch 1, {heads} heads of {d}, causal")
    print("| seq | cp | ours ms (fwd+bwd) | SDPA ms | ratio | overhead | max rel. error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in seqs:
        _one_length(args, dev, dtype, heads, d, s)


def _one_length(args, dev, dtype, heads, d, s) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, heads, s, d, device=dev, dtype=dtype, generator=g) for _ in range(4)
    )
    t_ref = _time(lambda: _sdpa(q, k, v, dout), dev, args.warmup, args.iters, args.repeats)
    if dev.type == "cuda":  # SDPA picks cuDNN on Hopper; its flash kernel for reference
        t_flash = _time(
            lambda: _sdpa(q, k, v, dout, SDPBackend.FLASH_ATTENTION),
            dev,
            args.warmup,
            args.iters,
            args.repeats,
        )
        print(f"# seq {s}: SDPA {t_ref:.2f} ms (its choice), flash-only SDPA {t_flash:.2f} ms")
    ref = _sdpa(q, k, v, dout)
    for cp in (int(x) for x in args.cp.split(",")):
        pieces = _pieces(q, k, v, dout, cp)  # already local on each rank: not timed
        t_ours = _time(
            lambda p=pieces, cp=cp: _blockwise(p, cp), dev, args.warmup, args.iters, args.repeats
        )
        outs, dqs, dks, dvs = _blockwise(pieces, cp)
        err = 0.0
        for r in range(cp):
            idx = torch.tensor(plan.positions(s, cp, r, True), device=dev)
            for got, want in zip((outs[r], dqs[r], dks[r], dvs[r]), ref):
                w = want.index_select(2, idx).float()
                err = max(err, ((got.float() - w).abs().max() / w.abs().max()).item())
        ratio = t_ours / t_ref
        if args.profile:
            _profile(pieces, cp, dev, t_ours, t_ref)
        print(
            f"| {s} | {cp} | {t_ours:.2f} | {t_ref:.2f} | {ratio:.3f} | "
            f"{100 * (ratio - 1):+.1f}% | {err:.1e} |",
            flush=True,
        )


def _profile(pieces, cp, dev, t_ours, t_ref) -> None:
    """One blockwise step under torch.profiler: device time by kernel (top 12), launches, and
    the device's busy time against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _blockwise(pieces, cp)
    _sync(dev)
    with profile(activities=acts) as prof:
        _blockwise(pieces, cp)
        _sync(dev)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if dev.type == "cuda" and e.device_type.name == "CUDA":
            kernels.setdefault(e.name[:70], []).append(e.device_time_total / 1e3)
    busy = sum(sum(v) for v in kernels.values())
    n = sum(len(v) for v in kernels.values())
    print(
        f"# profile cp={cp}: {n} kernels, device busy {busy:.2f} ms of a {t_ours:.2f} ms step "
        f"(SDPA {t_ref:.2f} ms); by device time:"
    )
    for name, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"#   {sum(ts):8.2f} ms  {len(ts):5d} x  {name}")


if __name__ == "__main__":
    main()
