"""Activation memory on a Llama-style model: no offload, full checkpoint, selective checkpoint,
our swap, and ``torch.autograd.graph.save_on_cpu`` in one launch.

Per mode: median step time (forward + backward + AdamW), peak memory of the step, activation
memory (the forward + backward peak minus what is allocated before the forward) and ratios to no
offload. ``swap_half`` swaps the first half of the layers (whose tensors backward needs last, so
their transfers have the most time to hide). Targets: our swap
within 10% of no offload's step time, >= 50% less activation memory, faster than save_on_cpu.

    python benchmarks/offload/llama.py                          # CPU, tiny model
    python benchmarks/offload/llama.py --device cuda --dim 2048 --layers 24 --heads 16 \\
        --kv-heads 16 --hidden 5632 --vocab 32000 --seq 4096 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import add_model_args, add_timing_args, model_config  # noqa: E402

MODES = ["none", "checkpoint", "selective", "swap", "swap_half", "save_on_cpu"]


def main(argv=None) -> int:
    from hp_offload import CheckpointPolicy, SwapManager, checkpoint
    from hp_testing.models import TinyLlama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, seq=256, kv_heads=4)
    ap.add_argument("--batch", type=int, default=2)
    add_timing_args(ap, repeats=3)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = TinyLlama(**model_config(args)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    mgr = SwapManager()
    peak: dict[str, float] = {}  # GiB, the whole step (optimizer included)
    act: dict[str, float] = {}  # GiB, forward + backward over what was allocated before
    full, selective = CheckpointPolicy(), CheckpointPolicy(mode="selective")

    def forward(mode):
        x = model.tok(ids)
        for i, layer in enumerate(model.layers):
            if mode == "checkpoint":
                x = checkpoint(layer, x, model.cos, model.sin, policy=full)
            elif mode == "selective":
                x = checkpoint(layer, x, model.cos, model.sin, policy=selective)
            elif mode == "swap" or (mode == "swap_half" and i < len(model.layers) // 2):
                with mgr.region():
                    x = layer(x, model.cos, model.sin)
            else:
                x = layer(x, model.cos, model.sin)
        return model.out(model.norm(x))

    def forward_backward(mode):
        ctx = (
            torch.autograd.graph.save_on_cpu(pin_memory=cuda)
            if mode == "save_on_cpu"
            else contextlib.nullcontext()
        )
        with ctx:
            logits = forward(mode)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()

    def step(mode):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        forward_backward(mode)
        if cuda:  # activation memory: the forward + backward peak over what was there before
            act[mode] = max(act.get(mode, 0.0), (torch.cuda.max_memory_allocated() - base) / 2**30)
        opt.step()
        if cuda:
            peak[mode] = max(peak.get(mode, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        opt.zero_grad(set_to_none=True)
        if mode.startswith("swap"):
            mgr.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def grads(mode):
        forward_backward(mode)
        out = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        if mode.startswith("swap"):
            mgr.step()
        return out

    ref = grads("none")  # same parameters, same data: offload must not change a bit
    for m in args.modes:  # "none" against itself: whether this device's backward is deterministic
        got = grads(m)
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        diff = max(
            ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(ref, got)
        )
        print(f"{m}: gradients bitwise equal to no offload: {same} (max relative diff {diff:.2e})")
    del ref
    times = {m: [] for m in args.modes}
    for m in args.modes:
        for _ in range(args.warmup):
            step(m)
    for _ in range(args.repeats):
        for m in args.modes:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(m)
            sync()
            times[m].append((time.perf_counter() - t0) / args.iters)
    print(
        f"activation offload, Llama-style fwd+bwd+AdamW, {args.device}, dim {args.dim}, "
        f"{args.layers} layers, vocab {args.vocab}, batch {args.batch}x{args.seq}, {dtype}, "
        f"torch {torch.__version__}; median of {args.repeats} x {args.iters}"
    )
    head = ["ms/step", "time x", "peak GiB", "act GiB", "act x"]
    print(f"{'mode':12s} " + " ".join(f"{h:>9s}" for h in head))
    t0 = statistics.median(times[args.modes[0]])
    for m in args.modes:
        t = statistics.median(times[m])
        row = f"{m:12s} {t * 1e3:9.1f} {t / t0:9.3f}"
        if cuda:
            row += f" {peak[m]:9.2f} {act[m]:9.2f} {act[m] / act[args.modes[0]]:9.3f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
