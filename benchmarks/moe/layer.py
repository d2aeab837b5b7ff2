"""The routed part of a MoE layer, forward + backward, on one device: hp-moe against a per-expert
loop (transformers' DeepseekV3/Qwen3-MoE experts), a torchtitan-style reference (argsort
permutation, ``torch._grouped_mm``, ``index_add``), and torchtitan's own ``RoutedExperts`` when
torchtitan imports. Every implementation gets the same tokens, routing (balanced or Zipf-skewed)
and weights; gradients flow to the tokens, the gate values and the expert weights.

Prints, per routing: ms per step (median), tokens/s, peak memory of the step, the ratios, and
the grouped GEMMs' TFLOP/s (the 9 GEMMs of a step alone, on the same grouped rows). Targets on
one H200 (hidden 2048, 64 experts, top-8, expert hidden 1408, 16384 tokens, bf16): >= 4x the
loop, >= 1.1x the torchtitan-style reference, >= 550 TFLOP/s in the grouped GEMMs (balanced).

    python benchmarks/moe/layer.py --device cuda --tokens 16384 --dim 2048 --hidden 1408 \\
        --experts 64 --top-k 8 --dtype bf16
    python benchmarks/moe/layer.py                       # a small CPU run (nox -s bench)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hp_moe import GroupedExperts, LocalDispatcher

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# -- routing ------------------------------------------------------------------------------------


def routing(kind: str, t: int, e: int, k: int, device, gen):
    """``(scores, indices)`` of shape ``(t, k)``: ``balanced`` gives every expert exactly
    ``t * k / e`` copies (distinct experts per token); ``zipf`` draws each token's experts
    without replacement with probability ~ 1 / rank."""
    if kind == "balanced":
        base = torch.randperm(t, generator=gen).unsqueeze(1) * k + torch.arange(k)
        idx = base % e
    else:
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float64)
        p = p[torch.randperm(e, generator=gen)]
        idx = torch.multinomial(p.expand(t, e), k, replacement=False, generator=gen)
    logits = torch.randn(t, k, generator=gen)
    scores = torch.softmax(logits, -1)
    return scores.to(device), idx.to(device)


# -- implementations ------------------------------------------------------------------------------


def loop_experts(x, scores, idx, w1, w2, w3):
    """transformers' experts: a mask per expert, gather, three matmuls, weighted index_add."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(idx, num_classes=w1.shape[0]).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        pos, tok = torch.where(mask[e])
        h = x[tok]
        y = (F.silu(h @ w1[e].T) * (h @ w3[e].T)) @ w2[e].T
        out.index_add_(0, tok, (y * scores[tok, pos, None]).to(out.dtype))
    return out


def titan_style(x, scores, idx, w1, w2, w3):
    """argsort permutation, one grouped GEMM per projection, gate multiply, index_add."""
    t, k = idx.shape
    order = torch.argsort(idx.view(-1), stable=True)
    gates = scores.view(-1)[order]
    tok = order // k
    counts = torch.bincount(idx.view(-1), minlength=w1.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[tok]
    h = F.silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    y = (y.float() * gates.unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)


class Ours:
    """hp-moe: the local dispatcher (gathers both ways, gates sent to the experts) and
    GroupedExperts (grouped GEMMs, fused SwiGLU with the gates)."""

    def __init__(self, experts: GroupedExperts) -> None:
        self.experts = experts
        self.dispatcher = LocalDispatcher(experts.num_experts)

    def __call__(self, x, scores, idx):
        tokens, counts, ctx = self.dispatcher.dispatch(x, scores, idx, gates_to_experts=True)
        y = self.experts(tokens, counts, row_weights=ctx.row_gates)
        return self.dispatcher.combine(y, ctx)


def torchtitan_routed(dim, hidden, e, k, w1, w2, w3):
    """torchtitan's own RoutedExperts (LocalTokenDispatcher + GroupedExperts), or None."""
    try:
        from torchtitan.models.common.moe import GroupedExperts as TTExperts
        from torchtitan.models.common.moe import RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except Exception as exc:  # not installed, or not for this torch
        print(f"# torchtitan not available: {type(exc).__name__}: {exc}")
        return None
    cfg = RoutedExperts.Config(
        inner_experts=TTExperts.Config(dim=dim, hidden_dim=hidden, num_experts=e),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k),
    )
    mod = cfg.build().to(w1.device)
    with torch.no_grad():
        inner = mod.inner_experts
        inner.w1_EFD.data = w1.detach().clone()
        inner.w2_EDF.data = w2.detach().clone()
        inner.w3_EFD.data = w3.detach().clone()

    def run(x, scores, idx):
        counts = torch.bincount(idx.view(-1), minlength=e)
        return mod(x.unsqueeze(0), scores.unsqueeze(0), idx.unsqueeze(0), counts).squeeze(0)

    return run, [mod.inner_experts.w1_EFD, mod.inner_experts.w2_EDF, mod.inner_experts.w3_EFD]


# -- timing ---------------------------------------------------------------------------------


class Clock:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3


def step(fn, x, scores, grad_out, params):
    xg = x.detach().requires_grad_(True)
    sg = scores.detach().requires_grad_(True)
    out = fn(xg, sg)
    out.backward(grad_out)
    for p in params:
        p.grad = None
    return out


def gemm_flops(rows, dim, hidden):
    return 18.0 * rows * dim * hidden  # 3 GEMMs forward, dgrad + wgrad each backward


def time_gemms(args, dev, dtype, counts, gen):
    """The 9 grouped GEMMs of one step alone, on the same grouped rows."""
    r, d, h, e = int(counts.sum()), args.dim, args.hidden, args.experts
    offs = torch.cumsum(counts.to(dev), 0, dtype=torch.int32)
    x = torch.randn(r, d, device=dev, dtype=dtype, requires_grad=True)
    hid = torch.randn(r, h, device=dev, dtype=dtype, requires_grad=True)
    w13 = [torch.randn(e, h, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(2)]
    w2 = torch.randn(e, d, h, device=dev, dtype=dtype, requires_grad=True)
    gh = torch.randn(r, h, device=dev, dtype=dtype)
    gd = torch.randn(r, d, device=dev, dtype=dtype)

    def once():
        outs = [torch._grouped_mm(x, w.transpose(-2, -1), offs=offs) for w in w13]
        y = torch._grouped_mm(hid, w2.transpose(-2, -1), offs=offs)
        torch.autograd.grad([*outs, y], [x, hid, *w13, w2], [gh, gh, gd])

    for _ in range(args.warmup):
        once()
    times = []
    for _ in range(args.repeats):
        with Clock(dev) as c:
            for _ in range(args.iters):
                once()
        times.append(c.ms / args.iters)
    ms = statistics.median(times)
    return gemm_flops(r, d, h) / (ms * 1e-3) / 1e12, ms


def gemm_kernel_ms(fn, x, scores, grad_out, params, dev, backward: bool) -> float:
    """Device time (ms) of the grouped GEMM kernels in one call of ``fn`` (forward, or forward
    + backward), from the profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with prof_ctx(activities=acts) as p:
        if backward:
            step(fn, x, scores, grad_out, params)
        else:
            with torch.no_grad():
                fn(x, scores)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if dev.type == "cuda" else "cpu_time_total"
    return sum(getattr(e, key) for e in p.key_averages() if e.key == "aten::_grouped_mm") / 1e3


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_routing(args, kind, dev, dtype):
    gen = torch.Generator().manual_seed(0)
    t, d, h, e, k = args.tokens, args.dim, args.hidden, args.experts, args.top_k
    scores, idx = routing(kind, t, e, k, dev, gen)
    torch.manual_seed(1)
    experts = GroupedExperts(d, h, e).to(device=dev, dtype=dtype)
    w1, w2, w3 = experts.w1, experts.w2, experts.w3
    x = torch.randn(t, d, generator=gen).to(dev, dtype)
    grad_out = torch.randn(t, d, generator=gen).to(dev, dtype)
    ours = Ours(experts)
    impls = {
        "ours": (lambda xx, ss: ours(xx, ss, idx), [w1, w2, w3]),
        "titan_style": (lambda xx, ss: titan_style(xx, ss, idx, w1, w2, w3), [w1, w2, w3]),
        "loop": (lambda xx, ss: loop_experts(xx, ss, idx, w1, w2, w3), [w1, w2, w3]),
    }
    tt = torchtitan_routed(d, h, e, k, w1, w2, w3) if args.torchtitan else None
    if tt is not None:
        run_tt, tt_params = tt
        impls["torchtitan"] = (lambda xx, ss: run_tt(xx, ss, idx), tt_params)
    if args.skip_loop:
        impls.pop("loop")

    # correctness: outputs and every gradient against the loop (or titan_style)
    ref_name = "loop" if "loop" in impls else "titan_style"
    grads = {}
    for name, (fn, params) in impls.items():
        xg = x.detach().requires_grad_(True)
        sg = scores.detach().requires_grad_(True)
        out = fn(xg, sg)
        out.backward(grad_out)
        grads[name] = [out.detach(), xg.grad, sg.grad] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
    for name, g in grads.items():
        errs = [relerr(a, b) for a, b in zip(g, grads[ref_name])]
        worst = max(errs)
        print(
            f"# {kind} {name}: max relative error vs {ref_name} {worst:.2e} (out, dx, dscores, dw)"
        )
        tol = max(args.tol, 2e-2) if name == "torchtitan" else args.tol  # it computes in bf16
        if worst > tol:
            raise SystemExit(f"{name} differs from {ref_name} by {worst:.2e} > {args.tol}")

    # timing: implementations alternate within each repeat
    for fn, params in impls.values():
        for _ in range(args.warmup):
            step(fn, x, scores, grad_out, params)
    times = {n: [] for n in impls}
    for _ in range(args.repeats):
        for name, (fn, params) in impls.items():
            iters = 1 if name == "loop" else args.iters
            with Clock(dev) as c:
                for _ in range(iters):
                    step(fn, x, scores, grad_out, params)
            times[name].append(c.ms / iters)
    peak = {}
    for name, (fn, params) in impls.items():
        if dev.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(fn, x, scores, grad_out, params)
            torch.cuda.synchronize()
            peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            peak[name] = float("nan")
    counts = torch.bincount(idx.view(-1).cpu(), minlength=e)
    gemm_tflops, gemm_ms = time_gemms(args, dev, dtype, counts, gen)
    med = {n: statistics.median(v) for n, v in times.items()}
    fn, params = impls["ours"]
    flops = gemm_flops(t * k, d, h)
    in_step = [gemm_kernel_ms(fn, x, scores, grad_out, params, dev, b) for b in (False, True)]
    kernels = {
        "forward GEMM kernels": (in_step[0], flops / 3 / (in_step[0] * 1e-3) / 1e12),
        "all 9 GEMM kernels": (in_step[1], flops / (in_step[1] * 1e-3) / 1e12),
        "9 GEMMs alone": (gemm_ms, gemm_tflops),
    }
    if args.profile:
        profile(impls, x, scores, grad_out, dev, kind)
    return med, {n: (min(v), max(v)) for n, v in times.items()}, peak, kernels, counts


def profile(impls, x, scores, grad_out, dev, kind):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name in ("ours", "titan_style"):
        fn, params = impls[name]
        with prof_ctx(activities=acts) as p:
            step(fn, x, scores, grad_out, params)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"# profile {kind} {name}")
        print(p.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument(
        "--routing", nargs="+", default=["balanced", "zipf"], choices=["balanced", "zipf"]
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tol", type=float, default=None, help="max relative error (default by dtype)")
    ap.add_argument("--torchtitan", action="store_true", help="also run torchtitan's RoutedExperts")
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument(
        "--profile", action="store_true", help="print the top kernels of ours and titan_style"
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.tol is None:
        args.tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        f"# MoE routed layer fwd+bwd: tokens {args.tokens}, dim {args.dim}, expert hidden "
        f"{args.hidden}, {args.experts} experts, top-{args.top_k}, {args.dtype}, {dev}, torch "
        f"{torch.__version__}" + (f", {torch.cuda.get_device_name()}" if dev.type == "cuda" else "")
    )
    rows = []
    for kind in args.routing:
        med, span, peak, kernels, counts = run_routing(args, kind, dev, dtype)
        flops = gemm_flops(args.tokens * args.top_k, args.dim, args.hidden)
        print(f"# {kind}: rows per expert min {int(counts.min())} max {int(counts.max())}")
        for name, ms in med.items():
            rows.append(
                (
                    kind,
                    name,
                    ms,
                    span[name],
                    args.tokens / ms * 1e3,
                    flops / (ms * 1e-3) / 1e12,
                    peak[name],
                    med.get("titan_style", float("nan")) / ms,
                    med.get("loop", float("nan")) / ms,
                )
            )
        nan = float("nan")
        for label, (ms, tflops) in kernels.items():
            rows.append((kind, f"ours: {label}", ms, (ms, ms), nan, tflops, nan, nan, nan))
    print(
        "| routing | impl | ms/step (min-max) | tokens/s | expert TFLOP/s | peak GiB "
        "| titan_style/impl | loop/impl |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, name, ms, (lo, hi), tps, tfl, pk, vs_tt, vs_loop in rows:
        print(
            f"| {kind} | {name} | {ms:.3f} ({lo:.3f}-{hi:.3f}) | {tps:,.0f} | {tfl:.1f} "
            f"| {pk:.2f} | {vs_tt:.3f} | {vs_loop:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
