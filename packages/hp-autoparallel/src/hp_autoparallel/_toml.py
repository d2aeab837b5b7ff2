"""The ``hp-train`` configuration of a plan: a TOML file that ``hp_trainer.load_config`` reads
and ``hp_trainer.preflight`` accepts for the plan's world size (the tests check both)."""

from __future__ import annotations

from pathlib import Path

from ._estimate import Estimate
from ._hardware import GIB

__all__ = ["train_config", "write_train_config"]


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def train_config(
    est: Estimate,
    *,
    model: str,
    global_batch: int,
    seq_len: int,
    gpu: str,
    cluster: str = "",
    mtp_layers: int | None = None,
    compute_dtype: str = "bfloat16",
) -> str:
    """The text of an hp-train TOML for ``est.plan``: every ``[parallelism]`` degree explicit
    (``data_parallel_shard_degree`` resolved, so the degrees multiply to the world size), the
    schedule and its microbatches, the recompute mode, bf16 parameters with fp32 reduction
    (float32 for CPU calibrations), and a header comment with the prediction."""
    p = est.plan
    world = p.world
    per_rank = global_batch // p.dp
    training = {
        "seq_len": seq_len,
        "global_batch_size": global_batch,
        # with a pipeline the trainer splits the rank's batch into pipeline_microbatches and
        # refuses gradient accumulation on top
        "local_batch_size": per_rank // p.microbatches if p.pp == 1 else 0,
        "mixed_precision_param": compute_dtype if compute_dtype != "float16" else "bfloat16",
        "mixed_precision_reduce": "float32",
    }
    parallelism = {
        "data_parallel_replicate_degree": p.dp_replicate,
        "data_parallel_shard_degree": p.dp_shard,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        "context_parallel_degree": p.cp,
        "expert_parallel_degree": p.ep,
        "expert_tensor_parallel_degree": p.etp,
        "sequence_parallel": True,
        "pipeline_schedule": p.schedule if p.pp > 1 else "1f1b",
        "pipeline_microbatches": p.microbatches if p.pp > 1 else 0,
    }
    model_section = {"name": model}
    if mtp_layers is not None:
        model_section["mtp_layers"] = mtp_layers
    name, share = est.time.biggest_overhead()
    lines = [
        f"# hp-train configuration written by hp-plan for {model} on {world} x {gpu}"
        + (f" ({cluster})" if cluster else ""),
        f"# plan: {p}",
        f"# predicted: {est.time.total:.3f} s/step, {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"MFU {100 * est.mfu:.1f}%, peak {est.memory.peak / GIB:.1f} GiB/GPU; biggest cost "
        f"{name} ({100 * share:.0f}%)",
        f"# check: hp-train --config <this file> --nproc {world} runs hp-train's preflight (then"
        " torchrun on one host);",
        "# across nodes, start `python -m hp_trainer.train --config <this file>` on every rank "
        "with torchrun",
        "",
    ]
    sections = [
        ("job", {"name": f"{model}-{world}x{gpu}"}),
        ("model", model_section),
        ("training", training),
        ("parallelism", parallelism),
        ("activation_checkpoint", {"mode": p.recompute}),
    ]
    for title, values in sections:
        lines.append(f"[{title}]")
        lines += [f"{k} = {_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def write_train_config(text: str, out_dir: str | Path, *, model: str, gpus: int, gpu: str) -> Path:
    """Write ``text`` to ``<out_dir>/<model>-<gpus>x<gpu>.toml`` (the folder is created) and
    return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model}-{gpus}x{gpu}.toml"
    path.write_text(text)
    return path
