"""Composed parallelism on a Llama-3-8B-shaped model: ours against PyTorch's own stack.

One configuration per launch; in it, each stack (``--stacks``) builds the same model from the
same seed, parallelizes it, trains ``--warmup + --steps`` steps of AdamW on the same batches,
and is torn down before the next one starts:

- **hp**: hp_trainer's ``parallelize_llama`` / ``pipeline_llama`` (hp_dtensor tensor
  parallelism, hp_fsdp, hp_pipeline);
- **torch**: the same plan written with ``torch.distributed.tensor.parallel``,
  ``torch.distributed.fsdp.fully_shard`` (FSDP2) and ``torch.distributed.pipelining``, as
  torchtitan applies them, on the same stage split.

Configurations (``--config``; the data-parallel shard degree takes what the others leave):
``fsdp``, ``hsdp`` (2 replicas), ``fsdp_tp`` (TP 2), ``pp_fsdp`` (PP 2, ``--schedule``),
``pp_tp_fsdp`` (PP 2 x TP 2). bf16 parameters with fp32 gradient reduction
(``--bf16``; without data parallelism, where FSDP's mixed precision does not apply, fp32
parameters under bf16 autocast instead), full activation checkpointing per block with
``--ac full``. ``--verbose`` prints every step, ``--watchdog S`` dumps every thread's stack
after S seconds (a hung collective shows where each rank waits).

Printed per stack: tokens/s per GPU (median step), MFU against the H200's 989.4 TFLOP/s
(FLOPs per token = 6 N + 12 L H d S, N the parameters without the input embedding), peak
allocated memory (max over ranks), the loss of every step, and the largest loss difference
between the stacks with the bound it is checked against.

    # 8 x H200 (the issue's runs)
    torchrun --standalone --nproc_per_node=8 benchmarks/scaling/llama.py --device cuda \\
        --model llama3-8b --config fsdp --seq 8192 --batch 1 --bf16 --ac full
    # pipelines: 8 microbatches of one sequence
    torchrun ... --config pp_fsdp --schedule zbv --batch 8 --microbatches 8 ...
    # CPU check of every configuration on the tiny model (4 gloo ranks; 8 for pp_tp_fsdp)
    python benchmarks/scaling/llama.py --config fsdp_tp --world 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402

#: name -> degrees (dp_shard fills the world)
CONFIGS = {
    "fsdp": {},
    "hsdp": {"dp_replicate": 2},
    "fsdp_tp": {"tp": 2},
    "pp_fsdp": {"pp": 2},
    "pp_tp_fsdp": {"pp": 2, "tp": 2},
}
H200_PEAK = 989.4e12  # bf16 dense, datasheet (GPU-ANCHORS.md)
#: largest |loss difference| between the stacks accepted as bf16 noise: a bf16 logit carries
#: ~3 significant digits, and two stacks reduce in different orders (relative to the loss)
LOSS_BOUND = {"bf16": 2e-2, "fp32": 1e-4}


def _dims(args, world):
    from hp_trainer._parallel_dims import ParallelDims

    return ParallelDims(world_size=world, **CONFIGS[args.config])


def _model_config(args):
    from hp_trainer.models import get_config

    cfg = get_config(args.model)
    changes = {"max_seq_len": max(args.seq, 16)}
    if args.layers:
        changes["n_layers"] = args.layers
    return cfg.replace(**changes)


def _build(args, device):
    """The single-device model, initialised from seed 0 on ``device`` (fp32)."""
    from hp_trainer.models import Transformer

    torch.manual_seed(0)
    with torch.device(device):
        return Transformer(_model_config(args))


def _batch(args, step, dp_index, vocab, device):
    """Learnable sequences (each token a fixed affine step from the previous one, random start
    and step per sample), the same for every stack; ``(inputs, labels)``."""
    g = torch.Generator().manual_seed(1_000_003 * step + dp_index)
    b, s = args.batch, args.seq
    start = torch.randint(0, vocab, (b, 1), generator=g)
    stride = torch.randint(1, 17, (b, 1), generator=g)
    tokens = (start + stride * torch.arange(s + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _loss_fn(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


# -- PyTorch's stack ------------------------------------------------------------------------
def _torch_tp(model, tp_mesh):
    """torchtitan's Llama plan with sequence parallelism, on our model's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def _torch_checkpoint(model):
    from torch.utils.checkpoint import checkpoint

    for block in model.layers.values():
        inner = block.forward

        def forward(*a, _inner=inner, **k):
            return checkpoint(_inner, *a, use_reentrant=False, **k)

        block.forward = forward


def _torch_parallelize(model, dims, mesh, args):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dims.tp > 1:
        _torch_tp(model, mesh["tp"])
    if args.ac == "full":
        _torch_checkpoint(model)
    names = mesh.mesh_dim_names
    fsdp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    if not fsdp_names:
        return model
    fsdp_mesh = mesh[fsdp_names]
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32
    )
    for block in model.layers.values():
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _torch_mesh(dims, device):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = dims.mesh_shape()
    return init_device_mesh(device, shape, mesh_dim_names=names)


def _torch_pipeline(model, dims, mesh, args, device):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    from hp_pipeline import build_schedule
    from hp_trainer._pipeline import SCHEDULES, layer_ranges, split_stage

    v = SCHEDULES[args.schedule]
    n_stages = dims.pp * v
    placement = build_schedule(args.schedule, dims.pp, args.microbatches)[1]
    rank = mesh.get_local_rank("pp")
    ranges = layer_ranges(model.config, n_stages)
    stages, mods = [], []
    for s in range(n_stages):
        if placement[s] == rank:
            lo, hi = ranges[s]
            mod = split_stage(model, lo, hi, s == 0, s == n_stages - 1)
            mod = _torch_parallelize(mod, dims, mesh, args)
            mods.append(mod)
            stages.append(
                PipelineStage(mod, s, n_stages, torch.device(device), group=mesh.get_group("pp"))
            )
    cls = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zbv": ScheduleZBVZeroBubble,
    }[args.schedule]
    sched = cls(stages if v > 1 else stages[0], args.microbatches, loss_fn=_loss_fn)
    return sched, mods


# -- ours -----------------------------------------------------------------------------------
def _hp_parallelize(model, dims, args, device):
    from hp_trainer._parallelize import ParallelizeConfig, parallelize_llama
    from hp_trainer._pipeline import pipeline_llama

    mesh = dims.build_mesh(device)
    config = ParallelizeConfig(
        sequence_parallel=True,
        activation_checkpoint=args.ac,
        param_dtype=torch.bfloat16 if args.bf16 else None,
        reduce_dtype=torch.float32,
    )
    if dims.pp > 1:
        sched, stages = pipeline_llama(
            model,
            parallel_dims=dims,
            mesh=mesh,
            schedule=args.schedule,
            n_microbatches=args.microbatches,
            loss_fn=_loss_fn,
            config=config,
            device=torch.device(device),
        )
        return sched, list(stages.stages.values()), mesh
    return None, [parallelize_llama(model, parallel_dims=dims, mesh=mesh, config=config)], mesh


# -- one stack ------------------------------------------------------------------------------
def _pp_coords(rank, dims):
    """(pp index, dp index) of a global rank in the (pp, dp_replicate, dp_shard, tp) order."""
    per_pp = dims.dp * dims.tp
    return rank // per_pp, (rank % per_pp) // dims.tp


def _run_stack(stack, rank, world, args):
    device = args.device
    dims = _dims(args, world)
    cfg = _model_config(args)
    pp_index, dp_index = _pp_coords(rank, dims)
    full = _build(args, device)
    if stack == "hp":
        sched, mods, _ = _hp_parallelize(full, dims, args, device)
    else:
        mesh = _torch_mesh(dims, device)
        if dims.pp > 1:
            sched, mods = _torch_pipeline(full, dims, mesh, args, device)
        else:
            sched, mods = None, [_torch_parallelize(full, dims, mesh, args)]
    if dims.pp > 1:
        del full  # each stage is a copy of its part
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=True)
    losses, times = [], []
    # bf16 compute: FSDP's mixed precision where there is FSDP, autocast where there is none
    # (fp32 parameters then), the same for both stacks
    cast = args.bf16 and dims.dp == 1
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        x, y = _batch(args, step, dp_index, cfg.vocab_size, device)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        ctx = torch.autocast(device, dtype=torch.bfloat16) if cast else contextlib.nullcontext()
        with ctx:
            mine = _one_step(sched, mods, x, y, args, dims, pp_index, device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        # the step's loss: averaged over data-parallel replicas, from the last stage
        count = torch.tensor(
            [1.0 if (sched is None or _holds_last_stage(args, dims, pp_index)) else 0.0],
            device=device,
        )
        pair = torch.stack([mine.reshape(()) * count[0], count[0]])
        dist.all_reduce(pair)
        t = torch.tensor([dt], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        losses.append(float(pair[0] / pair[1]))
        if step >= args.warmup:
            times.append(float(t))
        if args.verbose and rank == 0:
            print(f"[{stack}] step {step}: {float(t):.3f} s, loss {losses[-1]:.4f}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    peak_t = torch.tensor([peak], device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    del opt, mods, params, sched
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    step_s = statistics.median(times) if times else float("nan")
    tokens = dims.dp * args.batch * args.seq
    flops_tok = _flops_per_token(cfg, args.seq)
    return {
        "losses": losses,
        "step_s": step_s,
        "tokens_per_s_gpu": tokens / step_s / world,
        "mfu": tokens / step_s / world * flops_tok / H200_PEAK,
        "peak_gib": float(peak_t),
    }


def _one_step(sched, mods, x, y, args, dims, pp_index, device):
    """Forward and backward of one step; this rank's loss (zero off the last stage)."""
    if sched is None:
        loss = _loss_fn(mods[0](x), y)
        loss.backward()
        return loss.detach().float()
    mb_losses: list = []
    holds_last = _holds_last_stage(args, dims, pp_index)
    kwargs = {"target": y, "losses": mb_losses} if holds_last else {}
    if pp_index == 0:  # stage 0 sits on pipeline rank 0 in every schedule
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
    if not holds_last:
        return torch.zeros((), device=device)
    return torch.stack([m.detach().float() for m in mb_losses]).mean()


def _holds_last_stage(args, dims, pp_index):
    if dims.pp == 1:
        return True
    if args.schedule == "zbv":  # V shape: rank 0 holds the first and the last stage
        return pp_index == 0
    return pp_index == dims.pp - 1


def _flops_per_token(cfg, seq):
    n = cfg.num_params(embeddings=False) + cfg.vocab_size * cfg.dim
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.hd * seq


def run(rank, world, args, path, queue):
    init_rank(rank, world, path)
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    result = {}
    for stack in args.stacks:
        r = result[stack] = _run_stack(stack, rank, world, args)
        if rank == 0:  # as it comes, so that a run cut short still tells something
            print(
                f"[{stack}] step {r['step_s']:.3f} s, {r['tokens_per_s_gpu']:.0f} tokens/s/GPU, "
                f"peak {r['peak_gib']:.2f} GiB, losses "
                + " ".join(f"{v:.4f}" for v in r["losses"]),
                flush=True,
            )
    finish(rank, world, args, result, queue, report)


def _precision(args, dims) -> str:
    if not args.bf16:
        return "fp32"
    return "bf16 params / fp32 reduce" if dims.dp > 1 else "fp32 params + bf16 autocast"


def report(args, world, results):
    res = results[0]
    dims = _dims(args, world)
    cfg = _model_config(args)
    print(
        f"config {args.config}: {world} ranks, dp_replicate {dims.dp_replicate} x dp_shard "
        f"{dims.dp_shard} x tp {dims.tp} x pp {dims.pp}"
        + (f" ({args.schedule}, {args.microbatches} microbatches)" if dims.pp > 1 else "")
        + f"; model {args.model} ({cfg.n_layers} layers, {cfg.num_params() / 1e9:.2f} B "
        f"params), seq {args.seq}, local batch {args.batch}, "
        f"{_precision(args, dims)}, AC {args.ac}; "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'stack':<7}{'step s':>9}{'tok/s/GPU':>12}{'MFU':>8}{'peak GiB':>10}")
    for stack, r in res.items():
        print(
            f"{stack:<7}{r['step_s']:>9.3f}{r['tokens_per_s_gpu']:>12.0f}"
            f"{100 * r['mfu']:>7.1f}%{r['peak_gib']:>10.2f}"
        )
    for stack, r in res.items():
        print(f"losses {stack}: " + " ".join(f"{v:.4f}" for v in r["losses"]))
    if {"hp", "torch"} <= set(res):
        a, b = res["hp"], res["torch"]
        print(f"hp / torch tokens/s: {a['tokens_per_s_gpu'] / b['tokens_per_s_gpu']:.3f}x")
        n = min(20, len(a["losses"]), len(b["losses"]))
        diff = max(abs(u - v) / max(abs(v), 1e-6) for u, v in zip(a["losses"][:n], b["losses"][:n]))
        bound = LOSS_BOUND["bf16" if args.bf16 else "fp32"]
        ok = "within" if diff <= bound else "OUTSIDE"
        print(f"first {n} losses: max relative difference {diff:.2e} ({ok} the bound {bound:g})")


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=sorted(CONFIGS), default="fsdp")
    ap.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
    )
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--model", default="llama3-tiny", help="a key of hp_trainer.models.CONFIGS")
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--ac", choices=["none", "full"], default="none")
    ap.add_argument("--stacks", nargs="+", default=["hp", "torch"], choices=["hp", "torch"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--verbose", action="store_true", help="print every step as it ends")
    ap.add_argument(
        "--watchdog", type=float, default=0, help="dump every thread's stack after this many s"
    )
    args = ap.parse_args()
    if args.config in ("pp_fsdp", "pp_tp_fsdp") and args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be divisible by --microbatches {args.microbatches}")
    return launch(run, report, args, world=args.world)


if __name__ == "__main__":
    sys.exit(main())
