"""Job configuration: a TOML file plus command-line overrides (``--training.steps 50``), checked
key by key before anything starts. Pure Python."""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Data",
    "Job",
    "JobConfig",
    "Metrics",
    "MoE",
    "Model",
    "Parallelism",
    "Training",
    "load_config",
]


@dataclass
class Job:
    name: str = "hp-run"
    dump_folder: str = "./outputs"  # logs, TensorBoard events, plot, checkpoints go below it


@dataclass
class Model:
    name: str = "llama3-tiny"  # a key of hp_trainer.models.CONFIGS
    hf_path: str = ""  # a local HuggingFace folder to start from instead of random weights
    mtp_layers: int = -1  # DeepSeek-V3's multi-token prediction depths; < 0: the model's


@dataclass
class Training:
    steps: int = 100
    seq_len: int = 128
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    local_batch_size: int = 0  # per rank and micro-step; 0: global / dp (no accumulation)
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    max_norm: float = 1.0  # gradient clipping; 0 disables it
    mixed_precision_param: str = "float32"  # or "bfloat16"
    mixed_precision_reduce: str = "float32"
    seed: int = 0
    deterministic: bool = False
    compile: bool = False  # torch.compile each transformer block (one process or FSDP)
    # torch.compile's mode for the blocks: "default", "max-autotune-no-cudagraphs", or, on one
    # process without activation checkpointing, "reduce-overhead" / "max-autotune" (CUDA
    # graphs: the host's launch time goes)
    compile_mode: str = "default"
    # the output projection and the loss fused over token chunks (models.linear_cross_entropy):
    # no [tokens, vocabulary] logits; one process or FSDP, without multi-token prediction
    fused_loss: bool = False
    # a step whose loss or gradient norm is not finite: "stop" (write a checkpoint of the last
    # good step and stop) or "skip" (leave the parameters as they were and go on)
    on_nonfinite: str = "stop"


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    context_parallel_degree: int = 1
    context_parallel_method: str = "ring"  # "ring", "allgather" or "ulysses"
    context_parallel_load_balance: bool = True  # head-tail chunks: even causal work
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
    sequence_parallel: bool = True
    pipeline_schedule: str = "1f1b"  # "gpipe", "1f1b", "interleaved_1f1b" or "zbv"
    pipeline_microbatches: int = 0  # per step and data-parallel rank; 0: the pipeline degree
    # replay each stage's forward and backward from CUDA graphs (hp_pipeline's cuda_graphs):
    # for host-bound steps (small microbatches); unsharded stages on CUDA only
    pipeline_cuda_graphs: bool = False
    collectives: str = "torch"  # "hp_kernels": CPU collectives through shared memory
    # FSDP keeps sharded parameters, gradients and optimizer states in host memory
    fsdp_cpu_offload: bool = False
    # fuse sequence parallelism's all-gather / reduce-scatter into the matmuls (hp-kernels'
    # MC2): the row-parallel projections and the output head
    async_tp: bool = False


@dataclass
class MoE:
    """Load balancing of the model's MoE layers (``hp_moe.MoE``). Each field left at its
    default keeps the model configuration's own value."""

    aux_loss_coeff: float = -1.0  # -1: the model's; 0: no auxiliary loss
    aux_loss_type: str = ""  # "": the model's; "sequence", "batch" or "global"
    load_balance_coeff: float = -1.0  # -1: the model's; 0: the expert bias (if any) kept fixed
    capacity_factor: float = 0.0  # 0: the model's (dropless unless it caps); > 0: capacity


#: what activation memory a block (or a plan's module) gets
ACTIVATION_ACTIONS = ("none", "full", "selective", "swap")
#: torch.compile's modes, and those of them that capture CUDA graphs
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class ActivationCheckpoint:
    """``mode`` for every transformer block: "none", "full" or "selective" recomputation, or
    "swap" (saved activations to host memory, prefetched back in backward). ``plan``
    overrides it per module: ``"layers.0-7=swap,layers.8-15=selective"`` (hp_offload's
    patterns; each ``pattern=action`` with an action of ``mode``'s)."""

    mode: str = "none"
    plan: str = ""


def parse_activation_plan(text: str) -> dict[str, str]:
    """``"layers.0-7=swap, layers.8-15=full"`` -> ``{"layers.0-7": "swap", ...}``; raises
    :class:`ConfigError` naming ``activation_checkpoint.plan`` for a malformed entry."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        pattern, eq, action = (x.strip() for x in item.partition("="))
        if not eq or not pattern or action not in ACTIVATION_ACTIONS:
            raise ConfigError(
                f"activation_checkpoint.plan: entry {item!r}: write pattern=action with an "
                f"action of {list(ACTIVATION_ACTIONS)} (e.g. 'layers.0-7=swap')"
            )
        if pattern in out:
            raise ConfigError(f"activation_checkpoint.plan: pattern {pattern!r} appears twice")
        out[pattern] = action
    return out


@dataclass
class Checkpoint:
    enable: bool = True
    folder: str = "checkpoint"  # below job.dump_folder
    interval: int = 50
    async_mode: bool = False
    keep_latest_k: int = 2
    resume: bool = True  # continue from the latest committed checkpoint in the folder


@dataclass
class Data:
    path: str = ""  # a .txt or .jsonl file ("text" field); empty: the embedded corpus
    tokenizer: str = "byte"  # "byte" or a local HuggingFace tokenizer folder


@dataclass
class Metrics:
    log_freq: int = 10
    tensorboard: bool = True
    plot: bool = True


@dataclass
class Comm:
    """Collective timeouts: a rank waiting longer than this for a peer fails, naming the ranks
    that did not arrive, instead of hanging (on gloo; NCCL's watchdog aborts the process at
    the same timeout instead of raising)."""

    init_timeout_s: float = 300.0  # process-group setup and everything before the first step
    train_timeout_s: float = 300.0  # every collective from the first step's end on
    checkpoint_timeout_s: float = 1800.0  # while a checkpoint is written (slow file systems)


@dataclass
class JobConfig:
    """All sections; ``load_config`` builds one from TOML and overrides."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def _suggest(name: str, options) -> str:
    hint = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _convert(key: str, value, typ):
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected an integer") from None
        if f != int(f):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    return str(value)


def _set(cfg: JobConfig, dotted: str, value) -> None:
    section, _, name = dotted.partition(".")
    sections = _sections()
    if section not in sections or not name:
        raise ConfigError(
            f"unknown config key {dotted!r}{_suggest(section, sections)}: sections are "
            f"{sorted(sections)}"
        )
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if name not in hints:
        raise ConfigError(
            f"unknown config key {dotted!r}{_suggest(dotted, [f'{section}.{h}' for h in hints])}"
        )
    setattr(obj, name, _convert(dotted, value, hints[name]))


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``["--training.steps", "50", "--metrics.plot=false"]`` -> pairs."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"override {arg!r}: write --section.key value (e.g. --training.steps 50)"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            value = argv[i + 1]
            i += 1
        out.append((key, value))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then ``--section.key value`` overrides. Unknown sections or
    keys, values of the wrong type and a missing data file raise :class:`ConfigError` naming
    the key."""
    from .errors import check_instance

    if path is not None:
        check_instance(path, (str, Path), "path", "load_config", "give the TOML file's path")
    if overrides is not None:
        check_instance(
            overrides,
            (list, tuple),
            "overrides",
            "load_config",
            "give a list such as ['--training.steps', '50']",
        )
        for i, o in enumerate(overrides):
            check_instance(o, str, f"overrides[{i}]", "load_config", "give strings")
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {str(path)!r}: not valid TOML ({e})") from None
        for section, values in doc.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config key {section!r} must be a [section]")
            for k, v in values.items():
                _set(cfg, f"{section}.{k}", v)
    for key, value in parse_overrides(overrides or []):
        _set(cfg, key, value)
    _check(cfg)
    return cfg


def _check(cfg: JobConfig) -> None:
    from .models import CONFIGS

    t = cfg.training
    problems = []
    if cfg.model.name not in CONFIGS and not cfg.model.hf_path:
        problems.append(
            f"model.name={cfg.model.name!r}{_suggest(cfg.model.name, CONFIGS)}: use one of "
            f"{sorted(CONFIGS)}"
        )
    if cfg.data.path and not Path(cfg.data.path).exists():
        problems.append(f"data.path={cfg.data.path!r}: no such file")
    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").exists():
        problems.append(f"model.hf_path={cfg.model.hf_path!r}: no config.json there")
    for key in ("steps", "seq_len", "global_batch_size"):
        if getattr(t, key) < 1:
            problems.append(f"training.{key}={getattr(t, key)}: must be at least 1")
    for key in ("mixed_precision_param", "mixed_precision_reduce"):
        if getattr(t, key) not in ("float32", "bfloat16", "float16"):
            problems.append(f"training.{key}={getattr(t, key)!r}: use float32, bfloat16 or float16")
    if t.compile_mode not in COMPILE_MODES:
        problems.append(
            f"training.compile_mode={t.compile_mode!r}{_suggest(t.compile_mode, COMPILE_MODES)}: "
            f"use one of {list(COMPILE_MODES)}"
        )
    elif t.compile_mode != "default" and not t.compile:
        problems.append(
            f"training.compile_mode={t.compile_mode!r} sets torch.compile's mode: it needs "
            "training.compile=true"
        )
    if t.on_nonfinite not in ("stop", "skip"):
        problems.append(f"training.on_nonfinite={t.on_nonfinite!r}: use 'stop' or 'skip'")
    for key in ("init_timeout_s", "train_timeout_s", "checkpoint_timeout_s"):
        if not getattr(cfg.comm, key) > 0:
            problems.append(f"comm.{key}={getattr(cfg.comm, key)}: must be > 0 seconds")
    schedules = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
    if cfg.parallelism.pipeline_schedule not in schedules:
        problems.append(
            f"parallelism.pipeline_schedule={cfg.parallelism.pipeline_schedule!r}"
            f"{_suggest(cfg.parallelism.pipeline_schedule, schedules)}: use one of "
            f"{list(schedules)}"
        )
    cp_methods = ("ring", "allgather", "ulysses")
    if cfg.parallelism.context_parallel_method not in cp_methods:
        problems.append(
            f"parallelism.context_parallel_method={cfg.parallelism.context_parallel_method!r}"
            f"{_suggest(cfg.parallelism.context_parallel_method, cp_methods)}: use one of "
            f"{list(cp_methods)}"
        )
    if cfg.parallelism.collectives not in ("torch", "hp_kernels"):
        problems.append(
            f"parallelism.collectives={cfg.parallelism.collectives!r}: use 'torch' or 'hp_kernels'"
        )
    if cfg.activation_checkpoint.mode not in ACTIVATION_ACTIONS:
        problems.append(
            f"activation_checkpoint.mode={cfg.activation_checkpoint.mode!r}: use one of "
            f"{list(ACTIVATION_ACTIONS)}"
        )
    try:
        parse_activation_plan(cfg.activation_checkpoint.plan)
    except ConfigError as e:
        problems.append(str(e))
    m = cfg.moe
    if m.aux_loss_type not in ("", "sequence", "batch", "global"):
        problems.append(
            f"moe.aux_loss_type={m.aux_loss_type!r}: use sequence, batch or global (or leave "
            "it out for the model's)"
        )
    if cfg.model.mtp_layers < -1:
        problems.append(
            f"model.mtp_layers={cfg.model.mtp_layers}: must be >= 0, or -1 (the model's)"
        )
    for key in ("aux_loss_coeff", "load_balance_coeff"):
        v = getattr(m, key)
        if v < 0 and v != -1:
            problems.append(f"moe.{key}={v}: must be >= 0, or -1 (the model's value)")
    if m.capacity_factor < 0:
        problems.append(f"moe.capacity_factor={m.capacity_factor}: must be 0 (dropless) or > 0")
    if problems:
        raise ConfigError("\n".join(problems))
