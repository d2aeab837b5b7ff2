"""``hp-plan calibrate``: measure a GPU kind's calibration file on this machine.

Imported only by the ``calibrate`` subcommand (it imports torch, hp-trainer, hp-optim and
hp-moe; the planning core does not). On CUDA (else the CPU) it measures, each as the median of
timed repeats after warm-up calls, with ``torch.cuda.synchronize`` around every timed region:

- the dense matmul rate at the GEMM shapes of the models the planner is checked on (the 1.3B
  anchor and Llama-3.2-1B at 8192 tokens: projections, feed-forward, output heads);
- causal SDPA forward + backward (heads of 128, sequences of 2048 and 4096), counted as the
  planner counts it (``3.5 x tokens x seq x heads x (qk + v)``, NOTE [Where time goes]);
- the grouped GEMM forward + backward through ``hp_moe.grouped_mm`` (``torch``'s grouped
  matmul where it has one for the operands, else hp-moe's loop of matmuls, as hp-moe runs it);
- device memory bandwidth (a large device-to-device copy, bytes read + written);
- the element-wise kernels' bandwidth (SwiGLU's ``silu(a) * b`` in the compute dtype and an
  fp32 add, bytes read + written as NOTE [Element-wise traffic] counts them);
- pinned host <-> device copies (the slower direction);
- the optimizer hp-train runs (``hp_optim.AdamW`` and ``clip_grad_norm_``), as the bytes per
  second the planner's 32 bytes per parameter take;
- the caching allocator's fragmentation (reserved / allocated peak over real training steps of
  a small model built by ``hp_trainer.LLMTrainer``) and the runtime reserve (device memory
  used outside the caching allocator: CUDA context, cuBLAS / cuDNN workspaces);
- device and host memory;
- on CUDA, the host time each swapped block adds: a small model swapping every block against
  keeping every activation, less what the planner gives for the copies (the SwapManager
  timeline).

- on the CPU, the host time per aten op of hp-trainer's own model (``overheads.host_us_per_op``,
  NOTE [Host ops] in ``_layers``): the forward, loss and backward of ``llama3-tiny`` on 16
  tokens over the ops a ``TorchDispatchMode`` counts in it (the op's kernel is in it too, a few
  percent of a tiny GEMM's time, which the rates also count).

With ``--cluster-out`` (``_calibrate_ranks``) the rates are measured by the ``--ranks`` ranks all
at once, and their collectives and overlap go to a cluster file.

Selective recomputation's host time and the context-parallel constants are not measured by
this version (nor, off CUDA, swap's): they are copied from the shipped file of the
same kind (or the nearest), and the written file says so field by field. The file is TOML that
:meth:`GpuCalibration.from_toml` reads.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ._hardware import GIB, GpuCalibration, load_gpu, shipped_gpus
from .errors import CalibrationError, PlanTypeError

__all__ = ["Measured", "calibrate", "render"]

#: datasheet dense bf16 rates (TFLOP/s) of GPU kinds the planner knows, for MFU
DATASHEET_TFLOPS = {"h200": 989.4, "h100": 989.4, "a100": 312.0}


@dataclass
class Measured:
    """One field of the calibration file: its value and where it comes from."""

    value: float
    how: str


@dataclass
class Calibration:
    """What :func:`calibrate` measured, by ``(section, key)``, and the machine it ran on."""

    name: str
    compute_dtype: str
    device: str
    fields: dict[tuple[str, str], Measured] = field(default_factory=dict)
    rms_norm: str = "fused"  # what F.rms_norm runs here (GpuCalibration.rms_norm)

    def set(self, section: str, key: str, value: float, how: str) -> None:
        """Record ``section.key = value`` with its provenance ``how``."""
        self.fields[(section, key)] = Measured(float(value), how)


# -- timing ---------------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    """``nbytes`` in MiB, or KiB below one MiB (the provenance comments)."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(
    fn: Callable[[], object],
    device,
    *,
    warmup: int,
    repeats: int,
    min_s: float = 0.0,
    before: Callable[[], object] | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` samples after ``warmup`` calls, synchronised.
    A sample calls ``fn`` until ``min_s`` seconds have passed (once at least) and counts the
    mean: ranks that share cores are measured over many of the scheduler's time slices, not
    inside one (where a short call runs as if alone). ``before`` runs ahead of each sample,
    untimed (the ranks' barrier, so every rank times the same collective)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        if before is not None:
            before()
        t0 = time.perf_counter()
        calls = 0
        while True:
            fn()
            calls += 1
            if min_s <= 0 or time.perf_counter() - t0 >= min_s:
                break
        _sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


@dataclass(frozen=True)
class _Sizes:
    """The shapes and repeat counts of one calibration run."""

    matmuls: tuple[tuple[int, ...], ...]  # (m, n, k) or (m, n, k, times a step runs it)
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq, head_dim)
    grouped: tuple[int, int, int, int]  # (rows, experts, in, out)
    copy_bytes: int
    host_bytes: int
    optimizer: tuple[int, int, int]  # (tensors, rows, cols)
    trainer: tuple[str, dict, int, int] | None  # (model, config overrides, batch, seq)
    warmup: int
    repeats: int
    #: the shortest timed sample (``_median_time``'s ``min_s``): 0 alone, longer on shared ranks
    min_sample_s: float = 0.0


# the 1.3B anchor (dim 2048, ffn 5632, vocab 32000) and Llama-3.2-1B (dim 2048, 8 key/value
# heads of 64, ffn 8192, vocab 128256) at 4 x 2048 tokens: (m, n, k) of y[m, n] = x[m, k] w^T
# (m, n, k, times per step): the GEMMs of one training step of the 1.3B model (24 blocks) and
# of llama3.2-1b (16 blocks) at 8192 tokens, each counted as often as the step runs it, so the
# rate is the one those steps see (the large output GEMM, once a step, does not set it)
_GPU_MATMULS = (
    (8192, 2048, 2048, 4 * 24 + 2 * 16),  # wq / wk / wv / wo (1.3B), wq / wo (1B)
    (8192, 512, 2048, 2 * 16),  # wk / wv (1B)
    (8192, 5632, 2048, 2 * 24),  # w1 / w3 (1.3B)
    (8192, 2048, 5632, 24),  # w2 (1.3B)
    (8192, 8192, 2048, 2 * 16),  # w1 / w3 (1B)
    (8192, 2048, 8192, 16),  # w2 (1B)
    (8192, 32000, 2048, 1),  # output (1.3B)
    (8192, 128256, 2048, 1),  # output (1B)
)
# (m, n, k, times per step) of llama3-tiny's and qwen3-tiny's GEMMs at 512 tokens (2 blocks each)
_CPU_MATMULS = (
    (512, 64, 64, 2 * 2 + 2 * 2),  # wq / wo (llama3-tiny), wk / wv (qwen3-tiny)
    (512, 32, 64, 2 * 2),  # wk / wv (llama3-tiny)
    (512, 128, 64, 2),  # wq (qwen3-tiny)
    (512, 64, 128, 2),  # wo (qwen3-tiny)
    (512, 160, 64, 2 * 2 * 2),  # w1 / w3
    (512, 64, 160, 2 * 2),  # w2
    (512, 256, 64, 2),  # output
)
# the trainer model of the fragmentation measurement: RESULTS.md's mid-size shape
_FRAG_MODEL = dict(
    architecture="llama",
    vocab_size=32000,
    dim=1024,
    n_layers=8,
    n_heads=8,
    n_kv_heads=8,
    ffn_hidden=2816,
)

_SIZES = {
    ("cuda", False): _Sizes(
        matmuls=_GPU_MATMULS,
        attention=((4, 16, 2048, 128), (2, 16, 4096, 128)),
        grouped=(16384 * 8, 64, 2048, 1408),
        copy_bytes=1 << 30,
        host_bytes=256 << 20,
        optimizer=(24, 2048, 5632),
        trainer=("hp-calibrate-mid", _FRAG_MODEL, 4, 1024),
        warmup=3,
        repeats=10,
    ),
    ("cuda", True): _Sizes(
        matmuls=((4096, 2048, 2048), (4096, 5632, 2048)),
        attention=((1, 16, 2048, 128),),
        grouped=(8192, 8, 1024, 512),
        copy_bytes=64 << 20,
        host_bytes=32 << 20,
        optimizer=(4, 1024, 1024),
        trainer=("llama3-tiny", {}, 4, 256),
        warmup=2,
        repeats=3,
    ),
    # the models the planner is checked on with CPU ranks (hp-trainer's llama3-tiny, qwen3-tiny,
    # qwen3-moe-tiny: width 64, 512 tokens per rank), whose kernels are short enough that each
    # call's dispatch is part of its rate, as it is of theirs
    ("cpu", False): _Sizes(
        matmuls=_CPU_MATMULS,
        attention=((2, 4, 256, 16), (2, 4, 256, 32)),
        grouped=(1024, 8, 64, 32),
        copy_bytes=512 << 10,
        host_bytes=512 << 10,
        optimizer=(24, 64, 160),
        trainer=None,
        warmup=2,
        repeats=5,
    ),
    ("cpu", True): _Sizes(
        matmuls=((64, 64, 64), (64, 128, 64)),
        attention=((1, 2, 64, 128),),
        grouped=(128, 4, 32, 32),
        copy_bytes=1 << 20,
        host_bytes=1 << 20,
        optimizer=(2, 64, 64),
        trainer=None,
        warmup=1,
        repeats=3,
    ),
}


# -- the measurements -----------------------------------------------------------------------------


def _matmul(cal: Calibration, s: _Sizes, device, dtype) -> None:
    import torch

    flops = secs = 0.0
    parts = []
    for m, n, k, *times in s.matmuls:
        count = times[0] if times else 1
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        t = _median_time(
            lambda x=x, w=w: x @ w.t(),
            device,
            warmup=s.warmup,
            repeats=s.repeats,
            min_s=s.min_sample_s,
        )
        f = 2.0 * m * n * k
        flops, secs = flops + count * f, secs + count * t
        parts.append(f"{m}x{n}x{k} (x{count}) {f / t / 1e12:.3g}")
    cal.set(
        "rates",
        "matmul_tflops",
        flops / secs / 1e12,
        f"measured: {cal.compute_dtype} x @ w.T, FLOPs / time with each (m, n, k) counted as often "
        f"as a step runs it: {'; '.join(parts)} TFLOP/s",
    )


def _attention(cal: Calibration, s: _Sizes, device, dtype) -> None:
    import torch
    import torch.nn.functional as F

    flops = secs = 0.0
    parts = []
    for b, h, seq, hd in s.attention:
        q, k, v = (
            torch.randn(b, h, seq, hd, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        g = torch.randn(b, h, seq, hd, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, g=g):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), g)
            return dq

        t = _median_time(step, device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s)
        f = 3.5 * (b * seq) * seq * h * (2 * hd)  # forward t x seq x h x (qk + v), x 3.5
        flops, secs = flops + f, secs + t
        parts.append(f"{b}x{seq} tokens {h} heads of {hd} {f / t / 1e12:.3g}")
    cal.set(
        "rates",
        "attention_tflops",
        flops / secs / 1e12,
        "measured: causal scaled_dot_product_attention forward + backward, "
        f"{cal.compute_dtype}, 3.5 x tokens x seq x heads x (qk + v) FLOPs: "
        f"{'; '.join(parts)} TFLOP/s",
    )


def _grouped(cal: Calibration, s: _Sizes, device, dtype) -> None:
    import torch

    from hp_moe import grouped_mm, grouped_mm_supported

    rows, experts, d_in, d_out = s.grouped
    x = torch.randn(rows, d_in, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(experts, d_out, d_in, device=device, dtype=dtype, requires_grad=True)
    per = rows // experts
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per
    g = torch.randn(rows, d_out, device=device, dtype=dtype)
    path = "torch's grouped matmul" if grouped_mm_supported(x, w) else "hp_moe's loop of matmuls"

    def step():
        out = grouped_mm(x, w, offsets)
        return torch.autograd.grad(out, (x, w), g)

    t = _median_time(step, device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s)
    f = 3 * 2.0 * per * experts * d_in * d_out
    cal.set(
        "rates",
        "grouped_gemm_tflops",
        f / t / 1e12,
        f"measured: hp_moe.grouped_mm ({path}) forward + backward, {cal.compute_dtype}, "
        f"{rows} rows over {experts} experts (balanced), {d_in} -> {d_out}",
    )


def _bandwidth(cal: Calibration, s: _Sizes, device) -> None:
    import torch

    n = s.copy_bytes // 4
    src = torch.empty(n, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = _median_time(
        lambda: dst.copy_(src), device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s
    )
    bw = 2 * s.copy_bytes / t
    cal.set(
        "rates",
        "memory_gbps",
        bw / 1e9,
        f"measured: a {_size(s.copy_bytes)} device copy, bytes read + written",
    )
    if device.type != "cuda":
        cal.set(
            "rates",
            "host_link_gbps",
            bw / 1e9,
            "measured: 'host' memory is the same memory here, a swap is a copy (memory_gbps)",
        )
        return
    n = s.host_bytes // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True).uniform_()
    dev = torch.empty(n, device=device, dtype=torch.float32)
    t_in = _median_time(
        lambda: dev.copy_(host, non_blocking=True),
        device,
        warmup=s.warmup,
        repeats=s.repeats,
        min_s=s.min_sample_s,
    )
    t_out = _median_time(
        lambda: host.copy_(dev, non_blocking=True),
        device,
        warmup=s.warmup,
        repeats=s.repeats,
        min_s=s.min_sample_s,
    )
    cal.set(
        "rates",
        "host_link_gbps",
        s.host_bytes / max(t_in, t_out) / 1e9,
        f"measured: pinned {_size(s.host_bytes)} copies, the slower direction: "
        f"host-to-device {s.host_bytes / t_in / 1e9:.1f}, device-to-host "
        f"{s.host_bytes / t_out / 1e9:.1f} GB/s",
    )


def _elementwise(cal: Calibration, s: _Sizes, device, dtype) -> None:
    """The memory-bound kernels' bandwidth as the planner counts their bytes (NOTE [Element-wise
    traffic] in ``_layers``): SwiGLU's ``silu(a) * b`` in the compute dtype (silu reads and
    writes one tensor, the product reads two and writes one: 5) and an fp32 residual add (3),
    each over operands of half ``copy_bytes``; bytes moved over the two kernels' time."""
    import torch
    import torch.nn.functional as F

    size = torch.tensor([], dtype=dtype).element_size()
    n = s.copy_bytes // 2 // size
    a = torch.empty(n, device=device, dtype=dtype).uniform_()
    b = torch.empty_like(a).uniform_()
    t_swiglu = _median_time(
        lambda a=a, b=b: F.silu(a) * b,
        device,
        warmup=s.warmup,
        repeats=s.repeats,
        min_s=s.min_sample_s,
    )
    m = s.copy_bytes // 2 // 4
    x = torch.empty(m, device=device, dtype=torch.float32).uniform_()
    y = torch.empty_like(x).uniform_()
    t_add = _median_time(
        lambda x=x, y=y: x + y, device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s
    )
    swiglu, add = 5 * n * size, 3 * m * 4
    dname = str(dtype).replace("torch.", "")
    cal.set(
        "rates",
        "elementwise_gbps",
        (swiglu + add) / (t_swiglu + t_add) / 1e9,
        f"measured: {dname} silu(a) * b ({swiglu / t_swiglu / 1e9:.1f} GB/s) and a float32 "
        f"a + b ({add / t_add / 1e9:.1f} GB/s) over {_size(s.copy_bytes // 2)} operands, bytes "
        "read + written by each kernel as the planner counts them, over the two kernels' time",
    )


def _optimizer(cal: Calibration, s: _Sizes, device) -> None:
    import torch

    try:
        from hp_optim import AdamW, clip_grad_norm_

        what = "hp_optim.AdamW (hp-train's, foreach) step + clip_grad_norm_"
    except ImportError:  # pragma: no cover - hp-optim ships with hp-trainer
        from torch.nn.utils import clip_grad_norm_
        from torch.optim import AdamW

        what = "torch.optim.AdamW step + clip_grad_norm_"
    count, r, c = s.optimizer
    params = [torch.nn.Parameter(torch.randn(r, c, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        clip_grad_norm_(params, 1.0)
        opt.step()

    t = _median_time(step, device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s)
    n = count * r * c
    cal.set(
        "rates",
        "optimizer_gbps",
        32 * n / t / 1e9,
        f"measured: {what} over {count} fp32 tensors of {r}x{c} ({n / 1e6:.3g} M parameters), "
        "as the planner's 32 bytes per parameter per step",
    )


def _host_per_op(cal: Calibration, s: _Sizes, device) -> None:
    """Host seconds per aten op of hp-trainer's own code where the device is the host (NOTE
    [Host ops] in ``_layers``): the forward, loss and backward of ``llama3-tiny`` on 16 tokens
    (kernels of microseconds: the time is dispatch, autograd and the model's Python), over the
    aten ops a ``TorchDispatchMode`` counts in one such pass. Not on CUDA, where the host runs
    ahead of the kernels (not modelled)."""
    if device.type == "cuda":
        return
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from hp_trainer.models import Transformer, get_config

    torch.manual_seed(0)
    model = Transformer(get_config("llama3-tiny"))
    tokens = torch.randint(0, model.config.vocab_size, (1, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    step()
    counter = _Count()
    with counter:
        step()
    t = _median_time(step, device, warmup=s.warmup, repeats=s.repeats, min_s=s.min_sample_s)
    cal.set(
        "overheads",
        "host_us_per_op",
        t / counter.ops * 1e6,
        f"measured: hp_trainer's llama3-tiny forward, loss and backward on 16 tokens, "
        f"{1e3 * t:.2f} ms over the {counter.ops} aten ops a TorchDispatchMode counts in it",
    )


def rate_steps(cal: Calibration, s: _Sizes, device, dtype) -> tuple:
    """``(what, measure)`` pairs of the rate measurements, each ``measure()`` setting its fields
    of ``cal``: what one process measures alone, or each rank with the others
    (``_calibrate_ranks``)."""
    return (
        ("matmul", lambda: _matmul(cal, s, device, dtype)),
        ("attention", lambda: _attention(cal, s, device, dtype)),
        ("grouped GEMM", lambda: _grouped(cal, s, device, dtype)),
        ("bandwidths", lambda: _bandwidth(cal, s, device)),
        ("element-wise kernels", lambda: _elementwise(cal, s, device, dtype)),
        ("optimizer", lambda: _optimizer(cal, s, device)),
        ("host dispatch", lambda: _host_per_op(cal, s, device)),
    )


@contextlib.contextmanager
def _registered(name: str, values: dict):
    """``hp_trainer.models.CONFIGS[name]`` set to a configuration of ``values`` while inside
    (nothing when ``values`` is empty: a model of the registry)."""
    from hp_trainer.models import CONFIGS, TransformerConfig

    if not values:
        yield
        return
    CONFIGS[name] = TransformerConfig(**values)
    try:
        yield
    finally:
        CONFIGS.pop(name, None)


def _trainer_memory(cal: Calibration, s: _Sizes, device, base: GpuCalibration) -> None:
    import torch

    if device.type != "cuda" or s.trainer is None:
        cal.set(
            "memory",
            "fragmentation",
            base.fragmentation,
            f"not measured (no caching allocator on {device.type}): copied from the shipped "
            f"{base.name!r} file",
        )
        rss = _rss_bytes()
        cal.set(
            "memory",
            "runtime_reserve_gib",
            rss / GIB,
            "measured: this process's resident memory with torch and the packages imported",
        )
        return
    from hp_trainer import LLMTrainer, load_config

    name, values, batch, seq = s.trainer
    steps = 3
    with tempfile.TemporaryDirectory() as tmp, _registered(name, values):
        cfg = load_config(
            None,
            [
                f"--model.name={name}",
                f"--training.seq_len={seq}",
                f"--training.global_batch_size={batch}",
                f"--training.steps={steps}",
                "--training.mixed_precision_param=bfloat16",
                "--activation_checkpoint.mode=none",
                "--checkpoint.enable=false",
                "--metrics.tensorboard=false",
                "--metrics.plot=false",
                f"--job.dump_folder={tmp}",
            ],
        )
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        trainer = LLMTrainer(cfg)
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize(device)
        alloc = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        outside = total - free - torch.cuda.memory_reserved(device)
        del trainer
    gc.collect()
    torch.cuda.empty_cache()
    shape = values or {"model": name}
    desc = ", ".join(f"{k} {v}" for k, v in shape.items() if k != "architecture")
    cal.set(
        "memory",
        "fragmentation",
        max(1.0, reserved / alloc),
        f"measured: max_memory_reserved / max_memory_allocated = {reserved / GIB:.2f} / "
        f"{alloc / GIB:.2f} GiB over {steps} steps of hp_trainer.LLMTrainer ({desc}; batch "
        f"{batch} x {seq}, bf16 autocast, no checkpointing)",
    )
    cal.set(
        "memory",
        "runtime_reserve_gib",
        max(outside, 0) / GIB,
        "measured: device memory in use outside the caching allocator after those steps "
        "(total - free - reserved: CUDA context, cuBLAS / cuDNN workspaces; one process, so no "
        "NCCL communicators)",
    )


# Selective recomputation's host time is not measured this way: its selective-checkpoint
# context runs a Python dispatch mode over every op, host work that hides under a large
# model's kernels and shows in full on a small one (8.8 ms per block on the model below, about
# 2 ms on the 1.3B of benchmarks/RESULTS.md): the copied value stays until the planner models
# host time that overlaps device time.
_OVERHEADS = (("swap", "swap_ms_per_layer"),)


def _host_overheads(cal: Calibration, s: _Sizes, device) -> None:
    """The host time each swapped block adds, on CUDA: the same small model run by
    ``hp_trainer.LLMTrainer`` keeping every activation and swapping every block (median step
    times), the extra time over keeping less what the planner itself gives for it with no host
    time (the copies on hp_offload's SwapManager timeline, ``_offload.simulate``) at the rates
    measured above, over the blocks. Elsewhere the copied value stays."""
    if device.type != "cuda" or s.trainer is None:
        return
    import torch

    from hp_trainer import LLMTrainer, load_config

    from ._estimate import estimate
    from ._hardware import load_cluster
    from ._plan import Plan, Workload
    from ._spec import model_spec

    name, values, batch, seq = s.trainer
    modes = ("none", *(m for m, _ in _OVERHEADS))
    measured, planned = {}, {}
    with tempfile.TemporaryDirectory() as tmp, _registered(name, values):
        for mode in modes:
            cfg = load_config(
                None,
                [
                    f"--model.name={name}",
                    f"--training.seq_len={seq}",
                    f"--training.global_batch_size={batch}",
                    f"--training.steps={s.warmup + s.repeats}",
                    "--training.mixed_precision_param=bfloat16",
                    f"--activation_checkpoint.mode={mode}",
                    "--checkpoint.enable=false",
                    "--metrics.tensorboard=false",
                    "--metrics.plot=false",
                    f"--job.dump_folder={tmp}",
                ],
            )
            trainer = LLMTrainer(cfg)
            for _ in range(s.warmup):
                trainer.train_step()
            times = [trainer.train_step()["step_time_s"] for _ in range(s.repeats)]
            measured[mode] = statistics.median(times)
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
        for _, key in _OVERHEADS:
            cal.set("overheads", key, 0.0, "provisional: no host time")
        path = Path(tmp) / "provisional.toml"
        path.write_text(render(cal))
        gpu = GpuCalibration.from_toml(path)
        spec = model_spec(name)
        work = Workload(batch, seq)
        for mode in modes:
            plan = Plan(1, 1, recompute=mode)
            planned[mode] = estimate(spec, plan, work, gpu, load_cluster("h200")).time.total
    shape = values or {"model": name}
    desc = ", ".join(f"{k} {v}" for k, v in shape.items() if k != "architecture")
    for mode, key in _OVERHEADS:
        extra = measured[mode] - measured["none"]
        modelled = planned[mode] - planned["none"]
        per = max(0.0, (extra - modelled) / spec.n_layers)
        cal.set(
            "overheads",
            key,
            per * 1e3,
            f"measured: hp_trainer.LLMTrainer ({desc}; batch {batch} x {seq}, bf16 autocast) "
            f"with {mode} on every block takes {1e3 * extra:.1f} ms more per step than keeping "
            f"every activation ({1e3 * measured[mode]:.1f} against "
            f"{1e3 * measured['none']:.1f} ms); the planner at the rates above explains "
            f"{1e3 * modelled:.1f} ms; the rest over {spec.n_layers} blocks",
        )


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_ram() -> tuple[int, str]:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        return info["MemTotal"], "MemTotal"
    except (OSError, KeyError, ValueError):  # pragma: no cover - not Linux
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical pages"


def _device_memory(cal: Calibration, device, ranks: int) -> None:
    import torch

    ram, what = _host_ram()
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        cal.set(
            "gpu",
            "memory_gib",
            total / GIB,
            f"measured: torch.cuda.mem_get_info total of {torch.cuda.get_device_name(device)}",
        )
        cal.set(
            "memory",
            "host_memory_gib",
            ram / ranks / GIB,
            f"measured: host RAM ({what}, {ram / GIB:.0f} GiB) over the {ranks} GPU(s) of "
            "this host",
        )
    else:
        cal.set(
            "gpu",
            "memory_gib",
            ram / ranks / GIB,
            f"measured: host RAM ({what}, {ram / GIB:.1f} GiB) over {ranks} ranks",
        )
        cal.set(
            "memory",
            "host_memory_gib",
            ram / ranks / GIB,
            "measured: the same RAM as memory_gib (CPU ranks swap to the memory they use)",
        )


def _rms_norm_kind(device, dtype) -> str:
    """What ``F.rms_norm`` runs on ``device``: ``"fused"`` when autograd records one node for
    it (CUDA's kernel saves its input and rstd), ``"decomposed"`` when the last node is the
    composite's multiply (the CPU's, which also saves the normalised ``x * rstd``)."""
    import torch
    import torch.nn.functional as F

    x = torch.ones(2, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
    y = F.rms_norm(x, (8,), w, 1e-6)
    node = type(y.grad_fn).__name__ if y.grad_fn is not None else ""
    return "decomposed" if node.startswith(("Mul", "ToCopy")) else "fused"


def _kind(device) -> str:
    """The GPU kind's name: ``h200`` for an "NVIDIA H200", ``cpu`` on the CPU."""
    import torch

    if device.type != "cuda":
        return "cpu"
    full = torch.cuda.get_device_name(device).lower()
    for known in DATASHEET_TFLOPS:
        if known in full:
            return known
    words = [w for w in full.replace("nvidia", "").split() if w.isalnum()]
    return "-".join(words) or "gpu"


def calibrate(
    *,
    quick: bool = False,
    device: str | None = None,
    ranks: int | None = None,
    log: Callable[[str], None] | None = None,
    together=None,
) -> Calibration:
    """Measure this machine's calibration (module docstring). ``device`` is ``"cuda"`` or
    ``"cpu"`` (default: CUDA when available); ``quick`` uses tiny sizes and few repeats (a
    smoke test, seconds on a CPU); ``ranks`` is how many ranks share the host's memory (default:
    the GPUs of the host, or 4 CPU ranks). ``log`` gets a line per measurement. ``together``, a
    :class:`~hp_autoparallel._calibrate_ranks.RankMeasurements`, supplies the rates as the
    ranks measured them all at once (``hp-plan calibrate --cluster-out``) instead of this one
    process alone."""
    import torch

    if not isinstance(quick, bool):
        raise PlanTypeError(f"calibrate: quick={quick!r} is a {type(quick).__name__}: give a bool")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise CalibrationError(f"calibrate: device={device!r}: use 'cuda' or 'cpu'")
    if device == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("calibrate: device='cuda' but torch sees no CUDA device: use 'cpu'")
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    dev = dev or torch.device("cpu")
    if ranks is None:
        ranks = torch.cuda.device_count() if device == "cuda" else 4
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise CalibrationError(f"calibrate: ranks={ranks!r} must be an int >= 1")
    log = log or (lambda line: None)
    kind = _kind(dev)
    base_name = kind if kind in shipped_gpus() else ("h200" if device == "cuda" else "cpu")
    base = load_gpu(base_name)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cal = Calibration(
        name=kind,
        compute_dtype="bfloat16" if device == "cuda" else "float32",
        device=torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
        rms_norm=_rms_norm_kind(dev, dtype),
    )
    s = _SIZES[(device, quick)]
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # one thread per CPU rank, as the shipped cpu file
    try:
        rates = rate_steps(cal, s, dev, dtype)
        if together is not None:  # measured on the ranks at once: taken as they are
            for (section, key), (value, how) in together.rates.items():
                cal.set(section, key, value, how)
            rates = ()
        steps = (
            *rates,
            ("memory", lambda: _device_memory(cal, dev, ranks)),
            ("allocator", lambda: _trainer_memory(cal, s, dev, base)),
        )
        for what, fn in steps:
            t0 = time.perf_counter()
            fn()
            log(f"calibrate: {what} measured in {time.perf_counter() - t0:.1f} s")
    finally:
        torch.set_num_threads(threads)
    matmul = cal.fields[("rates", "matmul_tflops")].value
    if kind in DATASHEET_TFLOPS:
        cal.set(
            "gpu",
            "peak_tflops",
            DATASHEET_TFLOPS[kind],
            "datasheet dense bf16 rate (not measured: the MFU denominator, as hp-trainer's)",
        )
    else:
        cal.set(
            "gpu",
            "peak_tflops",
            matmul,
            "no datasheet figure for this device: the measured matmul rate above",
        )
    copied = (
        "not measured by this version of hp-plan calibrate: copied from the shipped "
        f"{base.name!r} file"
    )
    cal.set("overheads", "selective_ms_per_layer", base.selective_overhead * 1e3, copied)
    cal.set(
        "overheads",
        "swap_ms_per_layer",
        base.swap_overhead * 1e3,
        f"not measured off CUDA: copied from the shipped {base.name!r} file",
    )
    cal.set("overheads", "cp_step_us", base.cp_step_overhead * 1e6, copied)
    cal.set("overheads", "cp_merge_bytes_per_element", base.cp_merge_bytes, copied)
    t0 = time.perf_counter()
    _host_overheads(cal, s, dev)  # needs the rates above (the planner's own model)
    if dev.type == "cuda" and s.trainer is not None:
        log(f"calibrate: swap host time measured in {time.perf_counter() - t0:.1f} s")
    return cal


# -- the file ---------------------------------------------------------------------------------

_LAYOUT = (
    ("gpu", ("memory_gib", "peak_tflops")),
    (
        "rates",
        (
            "matmul_tflops",
            "attention_tflops",
            "grouped_gemm_tflops",
            "memory_gbps",
            "elementwise_gbps",
            "host_link_gbps",
            "optimizer_gbps",
        ),
    ),
    (
        "overheads",
        (
            "selective_ms_per_layer",
            "swap_ms_per_layer",
            "cp_step_us",
            "cp_merge_bytes_per_element",
            "host_us_per_op",
        ),
    ),
    ("memory", ("fragmentation", "runtime_reserve_gib", "host_memory_gib")),
)


#: fields a calibration may lack (``host_us_per_op``: not measured on CUDA)
_OPTIONAL = ("host_us_per_op",)


def _wrap(text: str, width: int = 96) -> list[str]:
    words, lines, line = text.split(), [], "#"
    for w in words:
        if len(line) + 1 + len(w) > width and line != "#":
            lines.append(line)
            line = "#"
        line += " " + w
    lines.append(line)
    return lines


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        raise CalibrationError(f"calibrate: a measured value is {v!r}: measure again")
    return f"{v:.6g}" if ("e" not in f"{v:.6g}") else repr(v)


def render(cal: Calibration) -> str:
    """The calibration file's text (the format of ``data/gpus/h200.toml``), each field with a
    comment saying how it was obtained."""
    import platform

    try:
        import torch

        tv = torch.__version__
    except ImportError:  # pragma: no cover
        tv = "?"
    head = (
        f"{cal.device}: written by `hp-plan calibrate` on {time.strftime('%Y-%m-%d %H:%M')} "
        f"with torch {tv}, Python {platform.python_version()}. Medians of timed repeats after "
        "warm-up, synchronised. Each field says whether it was measured (and at what shapes) or "
        "copied."
    )
    lines = _wrap(head) + [""]
    for section, keys in _LAYOUT:
        lines.append(f"[{section}]")
        if section == "gpu":
            lines.append(f'name = "{cal.name}"')
            lines.append(f'compute_dtype = "{cal.compute_dtype}"')
            lines += _wrap(
                "measured: the autograd node F.rms_norm records here (fused: one kernel saving "
                "its input and rstd; decomposed: torch's composite, which also saves x * rstd)"
            )
            lines.append(f'rms_norm = "{cal.rms_norm}"')
        for key in keys:
            m = cal.fields.get((section, key))
            if m is None and key in _OPTIONAL:
                continue
            if m is None:
                raise CalibrationError(f"calibrate: {section}.{key} was not measured")
            lines += _wrap(m.how)
            lines.append(f"{key} = {_fmt(m.value)}")
        lines.append("")
    return "\n".join(lines)


def _write(path: str, text: str) -> Path:
    """Write ``text`` to ``path``, making its folder; the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def main(argv: list[str]) -> int:
    """``hp-plan calibrate [--out FILE] [--quick] [--device cuda|cpu] [--ranks N]``."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="hp-plan calibrate",
        description="Measure this machine's rates, bandwidths and allocator overheads and "
        "write a GPU calibration file (pass it to hp-plan --gpu FILE).",
    )
    ap.add_argument("--out", help="the file to write (default: ./<kind>_calibrated.toml)")
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes and few repeats (a smoke test)"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: CUDA when available")
    ap.add_argument("--ranks", type=int, help="ranks sharing the host's memory")
    ap.add_argument(
        "--cluster-out",
        help="also launch the --ranks ranks (gloo on CPU, NCCL on CUDA), measure the rates on "
        "all of them at once and their collectives, and write this cluster file",
    )
    args = ap.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        together = None
        if args.cluster_out:
            import torch

            from ._calibrate_ranks import measure_ranks

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            if device == "cuda" and not torch.cuda.is_available():
                raise CalibrationError(
                    "calibrate: --device cuda but torch sees no CUDA device: use --device cpu"
                )
            ranks = args.ranks
            if ranks is None:
                ranks = torch.cuda.device_count() if device == "cuda" else 4
            # the host's GPUs per node, whichever of them were measured
            per_node = torch.cuda.device_count() if device == "cuda" else ranks
            t0 = time.perf_counter()
            together = measure_ranks(ranks, device=device, quick=args.quick)
            log(f"calibrate: {ranks} ranks measured together in {time.perf_counter() - t0:.1f} s")
        cal = calibrate(
            quick=args.quick,
            device=args.device,
            ranks=args.ranks,
            log=log,
            together=together,
        )
        out = _write(args.out or f"{cal.name}_calibrated.toml", render(cal))
        loaded = GpuCalibration.from_toml(out)  # the file reads back with the package's loader
        if together is not None:
            from ._calibrate_ranks import render_cluster
            from ._hardware import Cluster

            text = render_cluster(
                together, kind=cal.name, device_name=cal.device, gpus_per_node=per_node
            )
            cpath = _write(args.cluster_out, text)
            cl = Cluster.from_toml(cpath)  # reads back with the package's loader
            print(f"hp-plan calibrate: cluster {cl.describe()}, overlap {cl.overlap:.2f}")
            print(f"wrote {cpath}")
    except CalibrationError as e:
        print(f"hp-plan calibrate: {e}", file=sys.stderr)
        return 2
    print(
        f"hp-plan calibrate: {cal.device}: matmul {loaded.matmul_flops / 1e12:.4g}, attention "
        f"{loaded.attention_flops / 1e12:.4g}, grouped GEMM {loaded.grouped_gemm_flops / 1e12:.4g} "
        f"TFLOP/s; memory {loaded.memory_bandwidth / 1e9:.4g}, host link "
        f"{loaded.host_bandwidth / 1e9:.4g}, element-wise {loaded.elementwise_rate / 1e9:.4g}, "
        f"optimizer {loaded.optimizer_rate / 1e9:.4g} "
        f"GB/s; fragmentation {loaded.fragmentation:.3f}, reserve "
        f"{loaded.runtime_reserve / GIB:.2f} GiB\nwrote {out}"
    )
    return 0
