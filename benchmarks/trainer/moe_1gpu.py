"""A DeepSeek-V3-style MoE model trained on one device: ours (``hp_trainer.models``: MLA,
grouped experts with the fused SwiGLU, gather-only dispatch) against the same model, the same
weights and data, from transformers' ``DeepseekV3ForCausalLM`` in a plain training loop, in one
launch. bf16 parameters and AdamW (fused on CUDA) for both; losses compared step by step.

transformers runs its best form: ``experts_implementation="grouped_mm"`` (its default) and
SDPA attention; ``--hf-experts eager`` runs its per-expert loop instead. Target on one H200:
>= 2x transformers' tokens/s with ``deepseek-v3-1b`` (about 1B active parameters).

    python benchmarks/trainer/moe_1gpu.py --device cuda --model deepseek-v3-1b --batch 4 \\
        --seq 2048 --steps 30
    python benchmarks/trainer/moe_1gpu.py ... --compile  # both compiled per block
    python benchmarks/trainer/moe_1gpu.py ... --profile  # kernels by device time, each model
    python benchmarks/trainer/moe_1gpu.py              # a tiny CPU run (nox -s bench)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from hp_trainer.models import Transformer, get_config

PEAK = {"H200": 989e12, "H100": 989e12}  # dense bf16 per GPU


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _step(model, x, y, opt, forward, fused):
    if fused:  # the output projection and the loss fused over token chunks
        loss = model(x, targets=y)
    else:
        logits = forward(model, x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _profile(name, model, batches, opt, forward, fused, dev):
    """Two more steps under torch.profiler: the kernels by device time, and the device's busy
    time per step against the step's wall time (the difference: the device waiting on the
    host)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _sync(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for x, y in batches[-2:]:
            _step(model, x, y, opt, forward, fused)
        _sync(dev)
    wall = (time.perf_counter() - t0) / 2 * 1e3
    events = prof.key_averages()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    busy = (
        sum(
            getattr(e, key)
            for e in events
            if e.device_type.name == dev.type.upper() and not getattr(e, "is_user_annotation", 0)
        )
        / 2e3
    )
    print(f"# profile of {name}: {wall:.1f} ms per step (profiled), device busy {busy:.1f} ms")
    print(events.table(sort_by=key, row_limit=30, max_name_column_width=60))


def _train(name, model, batches, dev, lr, forward, fused=False, profile=False):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=dev.type == "cuda")
    losses, times = [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    for x, y in batches:
        _sync(dev)
        t0 = time.perf_counter()
        loss = _step(model, x, y, opt, forward, fused)
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = (
        (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else float("nan")
    )
    if profile:
        _profile(name, model, batches, opt, forward, fused, dev)
    del opt
    return losses, times, peak


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="deepseek-v3-tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--hf-experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile both models' blocks (torch.compile per block, MoE layers left eager: "
        "hp_trainer's training.compile, and the same regional compile of transformers' layers)",
    )
    ap.add_argument(
        "--fused-loss",
        action="store_true",
        help="ours computes the output projection and the loss fused over token chunks "
        "(training.fused_loss); transformers keeps its logits",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile two more of each implementation and print the "
        "kernels by device time",
    )
    ap.add_argument(
        "--compile-mode",
        default="default",
        help="torch.compile's mode for both models' blocks (e.g. reduce-overhead: CUDA graphs)",
    )
    ap.add_argument(
        "--hf-compile-moe",
        action="store_true",
        help="with --compile, compile transformers' MoE modules with its layers too (by default "
        "they are left eager, as ours were before they became shape-stable)",
    )
    args = ap.parse_args()
    if not args.compile and (args.compile_mode != "default" or args.hf_compile_moe):
        ap.error("--compile-mode and --hf-compile-moe set how --compile compiles: add --compile")
    import transformers

    dev = torch.device(args.device)
    dtype = torch.bfloat16
    # the model transformers implements: no multi-token prediction, the expert bias held fixed
    cfg = get_config(args.model, max_seq_len=args.seq, mtp_layers=0)
    cfg = cfg.replace(moe=cfg.moe.replace(load_balance_coeff=0.0, aux_loss_coeff=0.0))
    torch.manual_seed(0)
    ours = Transformer(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp,
            torch_dtype=dtype,
            attn_implementation="sdpa",
            experts_implementation=args.hf_experts,
        )
    ours = ours.to(dev, dtype)
    ours.init_buffers(dev)  # rotary tables in float32
    hf = hf.to(dev)
    ours.train()
    hf.train()
    if args.compile:
        from hp_trainer._parallelize import apply_compile

        apply_compile(ours, args.compile_mode)
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "experts") and not args.hf_compile_moe:
                layer.mlp.forward = torch.compiler.disable(layer.mlp.forward)
            layer.forward = torch.compile(layer.forward, mode=args.compile_mode)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        t = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append((t[:, :-1].to(dev), t[:, 1:].to(dev)))
    results = {}
    # alternate which runs first, so clocks and caches favour neither
    runs = [
        ("ours", ours, lambda m, x: m(x)),
        # use_cache=False: in training transformers would otherwise fill a key/value cache
        ("transformers", hf, lambda m, x: m(input_ids=x, use_cache=False).logits),
    ]
    for name, model, fwd in runs:
        fused = args.fused_loss and name == "ours"
        results[name] = _train(name, model, batches, dev, args.lr, fwd, fused, args.profile)
    tokens = args.batch * args.seq
    fpt = cfg.flops_per_token(args.seq)
    peak_flops = None
    if dev.type == "cuda":
        peak_flops = next((v for k, v in PEAK.items() if k in torch.cuda.get_device_name()), None)
    print(
        f"# {args.model}: {cfg.num_params() / 1e9:.2f}B parameters, "
        f"{cfg.num_params(active=True) / 1e9:.2f}B active; batch {args.batch} x {args.seq}, bf16, "
        f"{dev}, torch {torch.__version__}, transformers {transformers.__version__} "
        f"(experts_implementation={args.hf_experts})"
        + (", blocks compiled" if args.compile else "")
        + (", ours with the fused loss" if args.fused_loss else "")
        + (f", {torch.cuda.get_device_name()}" if dev.type == "cuda" else "")
    )
    print("| impl | ms/step (median) | tokens/s | MFU | peak GiB | first loss | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    tps = {}
    for name, (losses, times, peak) in results.items():
        ms = statistics.median(times[args.warmup :]) * 1e3
        tps[name] = tokens / ms * 1e3
        mfu = f"{tps[name] * fpt / peak_flops * 100:.1f}%" if peak_flops else "-"
        print(
            f"| {name} | {ms:.1f} | {tps[name]:,.0f} | {mfu} | {peak:.2f} | {losses[0]:.4f} | "
            f"{losses[-1]:.4f} |"
        )
    a, b = results["ours"][0], results["transformers"][0]
    print(f"# loss difference, first step {abs(a[0] - b[0]):.2e}, last {abs(a[-1] - b[-1]):.2e}")
    print(
        f"tokens/s ratio ours/transformers: {tps['ours'] / tps['transformers']:.3f} (target >= 2)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
