"""Activation memory on a Llama-style model: no offload, full checkpoint, selective checkpoint,
our swap, and ``torch.autograd.graph.save_on_cpu`` in one launch.

Per mode: median step time (forward + backward + AdamW), peak memory of the step, activation
memory (the forward + backward peak minus what is allocated before the forward) and ratios to no
offload. ``swap_half`` swaps the first half of the layers (whose tensors backward needs last, so
their transfers have the most time to hide). Targets: our swap
within 10% of no offload's step time, >= 50% less activation memory, faster than save_on_cpu.

``policy@F`` (with ``--budgets F ...``, fractions of no offload's activation memory): the
per-layer keep / recompute / swap actions ``hp_autoparallel.offload_policy`` chooses for that
budget, from one layer's costs measured here (its saved bytes, forward and backward times,
gradient and backward temporaries), the host link's measured bandwidth and what no offload's
run holds beside the layers. Each policy row prints its actions, the simulated activation
peak and time beside the measured ones, and whether it beats the fastest fixed mode (full /
selective checkpoint, swap all, swap half, save_on_cpu) that fits the same budget.

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
FIXED = ["checkpoint", "selective", "swap", "swap_half", "save_on_cpu"]  # a policy's rivals


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, dev, n=5):
    out = []
    for _ in range(n):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure_layer(model, ids, dev, body):
    """One layer's costs on this device (``hp_autoparallel.LayerCost``) and the head's time
    (final norm, output projection, loss; forward and backward). What a layer saves is
    measured in the model, not alone: the device bytes after the layers' forward with every
    layer kept, less those with every layer recomputed (which keep their inputs), per layer,
    plus the input (``body(mode)`` runs the layers' forward in ``mode``)."""
    from hp_autoparallel import LayerCost

    cuda = dev.type == "cuda"
    layer, n = model.layers[0], len(model.layers)
    with torch.no_grad():
        x0 = model.tok(ids)
    input_bytes = x0.numel() * x0.element_size()
    held = {}
    for mode in ("none", "checkpoint"):
        _sync(dev)
        before = torch.cuda.memory_allocated() if cuda else 0
        y = body(mode)
        _sync(dev)
        held[mode] = (torch.cuda.memory_allocated() if cuda else 0) - before
        del y
    saved = max(0, (held["none"] - held["checkpoint"]) // n) + input_bytes
    if not cuda:  # no allocator to ask: count what autograd saves, as one layer alone
        seen: dict[int, int] = {}

        def pack(t):
            if not (t.requires_grad and t.is_leaf):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x0, model.cos, model.sin)
        saved = sum(seen.values()) + input_bytes
    x = x0.detach().requires_grad_(True)
    y = layer(x, model.cos, model.sin)
    gy = torch.randn_like(y)
    if cuda:
        _sync(dev)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    y.backward(gy)
    grad_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    extra = 0
    if cuda:
        extra = max(0, torch.cuda.max_memory_allocated() - before - grad_bytes)
    layer.zero_grad(set_to_none=True)
    del y

    def fwd():  # with the graph built, as in a step (and in a recompute)
        layer(x0.detach().requires_grad_(True), model.cos, model.sin)

    def fwd_bwd():  # fresh gradients, as after zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
        xx = x0.detach().requires_grad_(True)
        layer(xx, model.cos, model.sin).backward(gy)

    f = _median_s(fwd, dev)
    b = max(0.0, _median_s(fwd_bwd, dev) - f)
    layer.zero_grad(set_to_none=True)

    def head():
        model.zero_grad(set_to_none=True)
        xh = x0.detach().requires_grad_(True)
        logits = model.out(model.norm(xh))
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()

    head_s = _median_s(head, dev)
    model.zero_grad(set_to_none=True)
    cost = LayerCost(
        saved_bytes=saved,
        input_bytes=input_bytes,
        forward_s=f,
        backward_s=b,
        grad_bytes=grad_bytes,
        backward_extra_bytes=extra,
    )
    return cost, head_s, held["none"]


def link_bytes_per_s(dev, nbytes=1 << 28):
    """Measured device-to-host and host-to-device bandwidth of pinned copies (bytes/s)."""
    if dev.type != "cuda":
        return 10e9, 10e9
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = _median_s(lambda: h.copy_(d, non_blocking=True), dev)
    back = _median_s(lambda: d.copy_(h, non_blocking=True), dev)
    return nbytes / out, nbytes / back


def main(argv=None) -> int:
    from hp_offload import CheckpointPolicy, SwapManager, checkpoint
    from hp_testing.models import TinyLlama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, seq=256, kv_heads=4)
    ap.add_argument("--batch", type=int, default=2)
    add_timing_args(ap, repeats=3)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument(
        "--budgets",
        nargs="*",
        type=float,
        default=[],
        help="per-layer offload policies for these activation budgets, as fractions of no "
        "offload's activation memory (e.g. 0.4 0.55 0.7; needs mode none)",
    )
    args = ap.parse_args(argv)
    if args.budgets and "none" not in args.modes:
        ap.error("--budgets needs mode none in --modes (the budgets are fractions of its memory)")
    for b in args.budgets:
        if not 0 < b <= 1:
            ap.error(f"--budgets {b}: give fractions in (0, 1]")
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
    policies: dict[str, object] = {}  # "policy@F" -> hp_autoparallel.OffloadPolicy
    frac_of: dict[str, float] = {}  # "policy@F" -> F

    def body(mode):  # the layers' forward
        x = model.tok(ids)
        acts = policies[mode].actions if mode in policies else None
        for i, layer in enumerate(model.layers):
            if acts is not None:
                if acts[i] == "recompute":
                    x = checkpoint(layer, x, model.cos, model.sin, policy=full)
                elif acts[i] == "swap":
                    with mgr.region():
                        x = layer(x, model.cos, model.sin)
                else:
                    x = layer(x, model.cos, model.sin)
            elif mode == "checkpoint":
                x = checkpoint(layer, x, model.cos, model.sin, policy=full)
            elif mode == "selective":
                x = checkpoint(layer, x, model.cos, model.sin, policy=selective)
            elif mode == "swap" or (mode == "swap_half" and i < len(model.layers) // 2):
                with mgr.region():
                    x = layer(x, model.cos, model.sin)
            else:
                x = layer(x, model.cos, model.sin)
        return x

    def forward(mode):
        return model.out(model.norm(body(mode)))

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
        if mode.startswith(("swap", "policy")):
            mgr.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def grads(mode):
        forward_backward(mode)
        out = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        if mode.startswith(("swap", "policy")):
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
    modes = list(args.modes)
    warm = {m: [] for m in modes}  # warm-up step times (what the swap host time is fitted on)
    for m in modes:
        for _ in range(args.warmup + 2):
            sync()
            t0 = time.perf_counter()
            step(m)
            sync()
            warm[m].append(time.perf_counter() - t0)
    if args.budgets:
        from hp_autoparallel import offload_policy, simulate

        cost, head_s, held_all = measure_layer(model, ids, dev, body)
        layers = [cost] * args.layers
        d2h, h2d = link_bytes_per_s(dev)
        # held beside the layers through backward: the other parameters' gradients
        other = sum(
            p.numel() * p.element_size()
            for m in (model.tok, model.norm, model.out)
            for p in m.parameters()
        )
        # what the head and the loss add at their peak: no offload's measured activation peak
        # over what its layers hold at the end of their forward
        head_bytes = max(0, int(act["none"] * 2**30) - held_all - other) if cuda else 0
        kw = dict(
            d2h_bytes_per_s=d2h,
            h2d_bytes_per_s=h2d,
            other_bytes=other,
            head_bytes=head_bytes,
            head_s=head_s,
            max_inflight_bytes=mgr.max_inflight_bytes,
        )
        if cuda and "swap" in modes:  # host time per swapped layer the timelines do not see
            _, sim_swap = simulate(layers, ["swap"] * args.layers, **kw)
            meas = statistics.median(warm["swap"]) - statistics.median(warm["none"])
            kw["swap_overhead_s"] = max(0.0, (meas - sim_swap) / args.layers)
        print(
            f"one layer: saves {cost.saved_bytes / 2**20:.1f} MiB (input "
            f"{cost.input_bytes / 2**20:.1f} MiB), forward {cost.forward_s * 1e3:.2f} ms, "
            f"backward {cost.backward_s * 1e3:.2f} ms, gradients {cost.grad_bytes / 2**20:.1f} "
            f"MiB, backward temporaries {cost.backward_extra_bytes / 2**20:.1f} MiB; head "
            f"{head_s * 1e3:.2f} ms and {head_bytes / 2**30:.2f} GiB at its peak; link "
            f"{d2h / 1e9:.1f} / {h2d / 1e9:.1f} GB/s out / in; swap host time "
            f"{kw.get('swap_overhead_s', 0.0) * 1e3:.2f} ms per layer"
        )
        half = args.layers // 2
        fixed_acts = {
            "none": ["keep"] * args.layers,
            "checkpoint": ["recompute"] * args.layers,
            "swap": ["swap"] * args.layers,
            "swap_half": ["swap"] * half + ["keep"] * (args.layers - half),
        }
        predicted = {m: simulate(layers, a, **kw) for m, a in fixed_acts.items()}
        # the budgets' base: no offload's measured activation peak (simulated on CPU)
        base = act["none"] if cuda else predicted["none"][0] / 2**30
        # the simulation's shortfall on full checkpointing, measured: held back from each
        # budget so that a policy the simulation fits also fits when measured
        margin = (
            max(0, int(act["checkpoint"] * 2**30) - predicted["checkpoint"][0])
            if (cuda and "checkpoint" in modes)
            else 0
        )
        print(f"budget margin (simulated short on full checkpointing): {margin / 2**30:.2f} GiB")
        for frac in args.budgets:
            name = f"policy@{frac:.2f}"
            pol = offload_policy(layers, int(frac * base * 2**30) - margin, **kw)
            policies[name] = pol
            frac_of[name] = frac
            predicted[name] = (pol.peak_bytes, pol.extra_s)
            print(f"{name}: {pol.counts()} -> {pol.trainer_plan()}")
            got = grads(name)
            same = all(torch.equal(r, g) for r, g in zip(grads("none"), got))
            print(f"{name}: gradients bitwise equal to no offload: {same}")
            del got
            modes.append(name)
            for _ in range(args.warmup):
                step(name)
    times = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
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
    head = ["ms/step", "time x"] + (["peak GiB", "act GiB", "act x"] if cuda else [])
    if args.budgets:
        head += ["sim act", "sim ms+"]
    print(f"{'mode':12s} " + " ".join(f"{h:>9s}" for h in head))
    t0 = statistics.median(times[modes[0]])
    for m in modes:
        t = statistics.median(times[m])
        row = f"{m:12s} {t * 1e3:9.1f} {t / t0:9.3f}"
        if cuda:
            row += f" {peak[m]:9.2f} {act[m]:9.2f} {act[m] / act[modes[0]]:9.3f}"
        if m in predicted:
            row += f" {predicted[m][0] / 2**30:9.2f} {predicted[m][1] * 1e3:9.1f}"
        print(row)
    if cuda:
        for name in policies:
            t = statistics.median(times[name])
            budget = frac_of[name] * act["none"]
            fits = "within" if act[name] <= budget else "OVER"
            print(f"{name}: budget {budget:.2f} GiB, measured {act[name]:.2f} GiB: {fits}")
            # rivals: every fixed mode that fits the same budget
            rivals = [m for m in FIXED if m in modes and act[m] <= budget]
            if not rivals:
                print(f"{name}: no fixed mode fits {budget:.2f} GiB")
                continue
            best = min(rivals, key=lambda m: statistics.median(times[m]))
            tb = statistics.median(times[best])
            verdict = "beats" if t < tb else "does NOT beat"
            print(
                f"{name}: {t * 1e3:.1f} ms at {act[name]:.2f} GiB {verdict} the fastest fixed mode "
                f"within the budget, {best} ({tb * 1e3:.1f} ms at {act[best]:.2f} GiB): "
                f"{tb / t:.3f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
