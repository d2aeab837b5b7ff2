"""The chunked gated delta rule (Qwen3.5's Gated DeltaNet core), forward + backward: hp-trainer's
``chunk_gated_delta_rule`` against transformers' ``torch_chunk_gated_delta_rule`` (the torch
path its Qwen3.5 model runs where flash-linear-attention's kernels are not installed), in one
process on the same inputs. Both take ``[b, s, h, d]`` queries and keys (L2-normalised here
and repeated to the value heads beforehand), values, the log decay and the write strength;
gradients flow to all five.

Prints, per sequence length: ms per forward + backward (median of the repeats), the ratio
(transformers / ours: above 1 is ours faster), peak memory on CUDA (the inputs included), and
the largest difference between the two outputs and between their gradients of the five
inputs (the two compute the same thing).

    python benchmarks/trainer/gated_deltanet.py                  # CPU, small (nox -s bench)
    python benchmarks/trainer/gated_deltanet.py --device cuda --heads 32 --dim 128 \\
        --seqs 4096,16384 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hp_trainer.models._qwen3_5 import chunk_gated_delta_rule

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _anchor():
    """transformers' torch chunked rule (Qwen3.5's, else Qwen3-Next's, the same function), or
    None where transformers has neither."""
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError:
        try:
            from transformers.models.qwen3_next.modeling_qwen3_next import (
                torch_chunk_gated_delta_rule,
            )
        except ImportError:
            return None

    def rule(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)[0]

    return rule


def ours(q, k, v, g, beta):
    """hp-trainer's rule (it scales the queries by ``dk ** -0.5`` itself, as transformers')."""
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk=64)


def inputs(b, s, h, d, dtype, device, seed=0):
    """Normalised queries and keys, values, log decay (<= 0) and write strength, as leaves."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(b, s, h, d, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, s, h, d, generator=gen)
    g = -torch.rand(b, s, h, generator=gen) * 0.5
    beta = torch.rand(b, s, h, generator=gen)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, g, beta)]


def step_ms(rule, xs, grad, args) -> tuple[float, float]:
    """Median ms of forward + backward and the peak memory (MiB, CUDA) of one."""
    device = xs[0].device

    def once():
        for x in xs:
            x.grad = None
        rule(*xs).backward(grad)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        once()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        once()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4, help="value heads (queries/keys repeated)")
    ap.add_argument("--dim", type=int, default=32, help="key and value head size")
    ap.add_argument("--seqs", default="256,1024,2048")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    anchor = _anchor()
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    print(
        f"gated delta rule fwd+bwd, {args.device} {args.dtype}, batch {args.batch}, "
        f"{args.heads} heads of {args.dim}, chunk 64, torch {torch.__version__}"
    )
    print(f"{'seq':>6} {'ours ms':>9} {'hf ms':>9} {'hf/ours':>8} {'peak MiB':>15} {'max |d|':>18}")
    for s in (int(x) for x in args.seqs.split(",")):
        xs = inputs(args.batch, s, args.heads, args.dim, dtype, device)
        grad = torch.randn(args.batch, s, args.heads, args.dim, generator=torch.Generator())
        grad = grad.to(device, dtype)
        mine, mine_mem = step_ms(ours, xs, grad, args)
        if anchor is None:
            print(f"{s:>6} {mine:>9.2f} {'-':>9} (transformers without Qwen3.5)")
            continue
        theirs, theirs_mem = step_ms(anchor, xs, grad, args)
        # the same outputs and gradients of all five inputs (float32 rules inside both)
        for x in xs:
            x.grad = None
        out = ours(*xs)
        out.backward(grad)
        grads = [x.grad for x in xs]
        for x in xs:
            x.grad = None
        ref = anchor(*xs)
        ref.backward(grad)
        d_out = (out - ref).abs().max().item()
        d_grad = max((a - x.grad).abs().max().item() for a, x in zip(grads, xs))
        print(
            f"{s:>6} {mine:>9.2f} {theirs:>9.2f} {theirs / mine:>8.2f} "
            f"{mine_mem:>7.0f} /{theirs_mem:>6.0f} {d_out:>8.1e} /{d_grad:>8.1e}"
        )
        del xs, grad, out, ref, grads  # nothing of this length left in the next one's peak


if __name__ == "__main__":
    main()
