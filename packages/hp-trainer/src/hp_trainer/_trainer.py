"""``LLMTrainer``: the training loop over a parallelized model, with gradient accumulation,
clipping, the LR schedule, checkpoint save/resume through hp-dcp and callbacks."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hp_dcp
from hp_optim import AdamW, clip_grad_norm_, get_hyper_lr_scheduler

from ._data import ByteTokenizer, TokenData, load_corpus, load_tokenizer
from ._parallel_dims import ParallelDims
from ._parallelize import ParallelizeConfig, check_parallelize_config, parallelize_llama
from ._pipeline import SCHEDULES, pipeline_llama
from .config import JobConfig, parse_activation_plan
from .errors import ConfigError, NonFiniteError, PeerFailure, TrainingError
from .models import Transformer, TransformerConfig, from_pretrained, get_config

__all__ = ["Callback", "LLMTrainer", "preflight"]


class Callback:
    """Hooks into the loop; override what you need. ``metrics`` holds ``loss``, ``grad_norm``,
    ``lr``, ``tokens_per_s``, ``mfu`` (None where the peak is unknown), ``memory_gib``,
    ``step_time_s``; for MoE models ``moe`` (``LLMTrainer.moe_statistics``: one dict per MoE
    layer) and with multi-token prediction ``mtp_loss`` (weighted, as added to the loss)."""

    def on_train_begin(self, trainer: LLMTrainer) -> None: ...

    def on_step_end(self, trainer: LLMTrainer, step: int, metrics: dict) -> None: ...

    def on_checkpoint(self, trainer: LLMTrainer, step: int, path: Path) -> None: ...

    def on_train_end(self, trainer: LLMTrainer) -> None: ...


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 per GPU


def _model_config(cfg: JobConfig) -> TransformerConfig:
    if cfg.model.hf_path:
        import json

        hf = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
        mc = TransformerConfig.from_hf(hf, max_seq_len=cfg.training.seq_len)
    else:
        mc = get_config(cfg.model.name, max_seq_len=cfg.training.seq_len)
    if cfg.model.mtp_layers >= 0 and cfg.model.mtp_layers != mc.mtp_layers:
        try:
            mc = mc.replace(mtp_layers=cfg.model.mtp_layers)
        except ConfigError as e:
            raise ConfigError(f"model.mtp_layers={cfg.model.mtp_layers}: {e}") from None
    return _moe_overrides(mc, cfg)


def _moe_overrides(mc: TransformerConfig, cfg: JobConfig) -> TransformerConfig:
    """The ``[moe]`` section applied to the model's MoE configuration."""
    m = cfg.moe
    changes = {}
    if m.aux_loss_coeff >= 0:
        changes["aux_loss_coeff"] = m.aux_loss_coeff
    if m.aux_loss_type:
        changes["aux_loss_type"] = m.aux_loss_type
    if m.load_balance_coeff >= 0:
        # 0 keeps a bias the model routes with (a fine-tuned checkpoint's) fixed; a model
        # without one gets none
        has_bias = mc.moe is not None and mc.moe.load_balance_coeff is not None
        changes["load_balance_coeff"] = (
            m.load_balance_coeff if m.load_balance_coeff or has_bias else None
        )
    if m.capacity_factor > 0:
        changes["capacity_factor"] = m.capacity_factor
    if not changes:
        return mc
    if mc.moe is None:
        model = cfg.model.hf_path or cfg.model.name
        raise ConfigError(
            f"moe.{next(iter(changes))}: model {model!r} has no MoE layers; drop the [moe] section"
        )
    moe = mc.moe.replace(**changes)
    if m.aux_loss_type and not moe.aux_loss_coeff:
        raise ConfigError(
            f"moe.aux_loss_type={m.aux_loss_type!r} has no effect without a balance loss: set "
            "moe.aux_loss_coeff > 0, or drop moe.aux_loss_type"
        )
    return mc.replace(moe=moe)


def parallelize_config(cfg: JobConfig) -> ParallelizeConfig:
    """The :class:`ParallelizeConfig` a job's configuration asks for."""
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    return ParallelizeConfig(
        sequence_parallel=p.sequence_parallel,
        activation_checkpoint=ac.mode,
        activation_plan=parse_activation_plan(ac.plan) or None,
        param_dtype=None
        if t.mixed_precision_param == "float32"
        else _DTYPES[t.mixed_precision_param],
        reduce_dtype=_DTYPES[t.mixed_precision_reduce],
        cp_method=p.context_parallel_method,
        cp_load_balance=p.context_parallel_load_balance,
        seq_len=t.seq_len,
        compile=t.compile,
        compile_mode=t.compile_mode,
        cpu_offload=p.fsdp_cpu_offload,
        async_tp=p.async_tp,
    )


def preflight(cfg: JobConfig, world_size: int) -> tuple[ParallelDims, TransformerConfig]:
    """Every check that needs no process: the degrees against ``world_size`` and against the
    model, batch and sequence sizes. Returns the degrees and the model configuration; raises
    :class:`ConfigError` listing every problem."""
    p, t = cfg.parallelism, cfg.training
    pd = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=world_size,
    )
    mc = _model_config(cfg)
    moe = mc.moe
    pd.check_model(
        n_heads=mc.n_heads,
        n_kv_heads=mc.n_kv_heads,
        n_layers=mc.n_layers,
        ffn_hidden=mc.ffn_hidden,
        num_experts=moe.num_experts if moe is not None else None,
        expert_hidden=moe.hidden_dim if moe is not None else None,
        linear_heads=_linear_heads(mc),
        global_batch_size=t.global_batch_size,
        seq_len=t.seq_len,
        stages_per_rank=SCHEDULES.get(p.pipeline_schedule, 1) if pd.pp > 1 else 1,
        mtp_layers=mc.mtp_layers,
        cp_load_balance=p.context_parallel_load_balance,
        conv_kernel=mc.linear_conv_kernel if mc.architecture == "qwen3_5" else None,
    )
    check_parallelize_config(pd, parallelize_config(cfg))
    if t.fused_loss:
        wrong = [
            f"{k}={v}"
            for k, v in (
                ("tensor_parallel_degree", pd.tp),
                ("pipeline_parallel_degree", pd.pp),
                ("context_parallel_degree", pd.cp),
            )
            if v > 1
        ]
        if wrong or mc.mtp_layers:
            what = ", ".join(
                wrong + ([f"model.mtp_layers={mc.mtp_layers}"] if mc.mtp_layers else [])
            )
            raise ConfigError(
                f"training.fused_loss=true fuses the output projection and the loss on one "
                f"process or under FSDP; not with {what} (a vocabulary-split head, a pipeline's "
                "loss function, sequence shards or the MTP loss on the logits): set them to 1 "
                "(model.mtp_layers=0), or leave fused_loss false"
            )
    if p.pipeline_cuda_graphs:
        if pd.pp == 1:
            raise ConfigError(
                "parallelism.pipeline_cuda_graphs=true graphs pipeline stages: set "
                "pipeline_parallel_degree > 1, or leave it false"
            )
        other = {
            "data_parallel_replicate_degree": pd.dp_replicate,
            "data_parallel_shard_degree": pd.dp_shard,
            "tensor_parallel_degree": pd.tp,
            "context_parallel_degree": pd.cp,
            "expert_parallel_degree": pd.ep,
        }
        wrong = [f"{k}={v}" for k, v in other.items() if v > 1]
        if wrong:
            raise ConfigError(
                "parallelism.pipeline_cuda_graphs=true needs unsharded stages without "
                f"communication inside them; got {', '.join(wrong)}: set them to 1 (with "
                f"pipeline_parallel_degree = the world size, {pd.world_size}), or leave it false"
            )
        ac = cfg.activation_checkpoint
        if ac.mode == "swap" or "swap" in parse_activation_plan(ac.plan).values():
            raise ConfigError(
                "parallelism.pipeline_cuda_graphs=true cannot replay activation swap (its "
                "copies to host memory run outside the graph): use full or selective "
                "recomputation, or leave pipeline_cuda_graphs false"
            )
        if not torch.cuda.is_available():
            raise ConfigError(
                "parallelism.pipeline_cuda_graphs=true needs CUDA devices; this host has none: "
                "leave it false"
            )
    return pd, mc


def _layer_key(stat: dict) -> tuple:
    """Sort MoE layers by their position: ``layers.10`` after ``layers.9``, MTP last."""
    parts = stat["layer"].split(".")
    return (parts[0] != "layers", *(int(p) if p.isdigit() else 0 for p in parts[1:2]))


def _linear_heads(mc) -> tuple[int, int] | None:
    """Qwen3.5's Gated DeltaNet (key, value) head counts, which tensor parallelism splits."""
    if mc.architecture != "qwen3_5":
        return None
    return mc.linear_num_key_heads, mc.linear_num_value_heads


_COMM_ERROR = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|timed out|timeout|socket|broken pipe|"
    r"peer|store",
    re.IGNORECASE,
)


def _is_communication_error(exc: BaseException) -> bool:
    """A failed or timed-out collective or store call (torch's DistError family, or gloo's
    plain RuntimeErrors), not an out-of-memory or another error of the step itself."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and bool(_COMM_ERROR.search(str(exc)))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class LLMTrainer:
    """Train a decoder LM as ``config`` says. Everything that can be checked (degrees against
    the world size and the model, batch sizes, files) is checked before the process group is
    created; under ``torchrun`` the group is created here."""

    def __init__(self, config: JobConfig, *, callbacks: list[Callback] | None = None) -> None:
        from .errors import check_instance

        check_instance(config, JobConfig, "config", "LLMTrainer", "build it with load_config")
        if callbacks is not None:
            check_instance(callbacks, (list, tuple), "callbacks", "LLMTrainer", "give a list")
            for i, cb in enumerate(callbacks):
                check_instance(
                    cb, Callback, f"callbacks[{i}]", "LLMTrainer", "subclass hp_trainer.Callback"
                )
        self.config = cfg = config
        t, p = cfg.training, cfg.parallelism
        world = (
            dist.get_world_size()
            if dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "1"))
        )
        self.parallel_dims, self.model_config = preflight(cfg, world)
        pd, mc = self.parallel_dims, self.model_config
        per_rank = t.global_batch_size // pd.dp
        local = t.local_batch_size or per_rank
        if per_rank % local:
            raise ConfigError(
                f"training.local_batch_size={local} does not divide the {per_rank} sequences "
                f"per data-parallel rank (global_batch_size {t.global_batch_size} / dp {pd.dp})"
            )
        self.micro_batches = per_rank // local
        if pd.pp > 1:
            n_mb = p.pipeline_microbatches or pd.pp
            if self.micro_batches != 1:
                raise ConfigError(
                    "training.local_batch_size: gradient accumulation with pipeline parallelism "
                    "is not supported; use parallelism.pipeline_microbatches to split the batch"
                )
            if per_rank % n_mb:
                raise ConfigError(
                    f"parallelism.pipeline_microbatches={n_mb} does not divide the {per_rank} "
                    "sequences per data-parallel rank"
                )
            self.pipeline_microbatches = n_mb
        self.callbacks = list(callbacks or [])
        if p.collectives == "hp_kernels":  # before any mesh: CPU meshes pick the platform up
            from . import kernels_backend

            kernels_backend.enable()
        # -- processes ------------------------------------------------------------------------
        cuda = torch.cuda.is_available()
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(
                "cuda:nccl,cpu:gloo" if cuda else "gloo",
                timeout=datetime.timedelta(seconds=cfg.comm.init_timeout_s),
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # each rank's last started step, in the rendezvous store: a rank whose collective fails
        # names the peers that never reported (see _peer_failure)
        self._store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self._preempted = False  # set by SIGTERM; acted on at the end of a step
        self._stop_requested = False  # some rank got SIGTERM (agreed in the step's flags)
        self._saved_step = -1  # the step of the last checkpoint written or loaded
        self._timeout_s = cfg.comm.init_timeout_s
        self.device = torch.device(
            f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
        )
        if cuda:
            torch.cuda.set_device(self.device)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)
        # -- model ----------------------------------------------------------------------------
        if cfg.model.hf_path:
            model = from_pretrained(
                cfg.model.hf_path, device=self.device, max_seq_len=t.seq_len, config=mc
            )
        else:
            with torch.device(self.device):
                model = Transformer(mc)
        single = world == 1 and not dist.is_initialized()
        self.mesh = None if single else pd.build_mesh(self.device.type)
        self.expert_mesh = None if single else pd.build_expert_mesh(self.device.type)
        pconf = parallelize_config(cfg)
        self.schedule = None
        if pd.pp > 1:
            self.schedule, self.model = pipeline_llama(
                model,
                parallel_dims=pd,
                mesh=self.mesh,
                expert_mesh=self.expert_mesh,
                schedule=p.pipeline_schedule,
                n_microbatches=self.pipeline_microbatches,
                loss_fn=_loss,
                config=pconf,
                device=self.device,
                cuda_graphs=p.pipeline_cuda_graphs,
            )
            n_stages = len(self.schedule.placement)
            self.has_first = "0" in self.model.stages
            self.has_last = str(n_stages - 1) in self.model.stages
        else:
            self.model = parallelize_llama(
                model, parallel_dims=pd, mesh=self.mesh, expert_mesh=self.expert_mesh, config=pconf
            )
        self._swap_managers = [  # activation swap (activation_checkpoint "swap"), per stage
            m.swap_manager for m in self.model.modules() if hasattr(m, "swap_manager")
        ]
        self._set_timeouts(cfg.comm.init_timeout_s)  # the meshes' groups too
        self.dp_rank = 0
        if self.mesh is not None:
            names, coord = self.mesh.mesh_dim_names, self.mesh.get_coordinate()
            rep = coord[names.index("dp_replicate")] if "dp_replicate" in names else 0
            shard = coord[names.index("dp_shard")] if "dp_shard" in names else 0
            self.dp_rank = rep * pd.dp_shard + shard
        self.optimizer = AdamW(
            self.model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay
        )
        self.moe_group = None  # the ranks whose MoE layers saw different tokens
        if mc.moe is not None:
            self._setup_moe()
        # the MTP loss's gradient divided over the microbatches, as the main loss is
        n_micro = self.pipeline_microbatches if self.schedule is not None else self.micro_batches
        for m in self.model.modules():
            if isinstance(m, Transformer):
                m.mtp_loss_scale = 1.0 / n_micro
        self.scheduler = get_hyper_lr_scheduler(
            self.optimizer,
            {
                "warmup_steps": min(t.warmup_steps, t.steps),
                "total_steps": t.steps,
                "decay_style": "cosine",
                "min_lr_ratio": t.min_lr_ratio,
            },
        )
        # -- data -----------------------------------------------------------------------------
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > mc.vocab_size:
            raise ConfigError(
                f"data.tokenizer has {self.tokenizer.vocab_size} tokens, the model's vocabulary "
                f"{mc.vocab_size}"
            )
        text = load_corpus(cfg.data.path)
        if isinstance(self.tokenizer, ByteTokenizer):
            tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        else:
            tokens = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        self.data = TokenData(tokens, t.seq_len, t.global_batch_size, t.seed)
        # -- outputs and resume ---------------------------------------------------------------
        self.dump = Path(cfg.job.dump_folder)
        self.ckpt_dir = self.dump / cfg.checkpoint.folder
        self.step = 0
        self.losses: list[float] = []
        if cfg.checkpoint.enable and cfg.checkpoint.resume:
            latest = self.latest_checkpoint()
            if latest is not None:
                self.load_checkpoint(latest)
        self._pending = None

    def _setup_moe(self) -> None:
        """Balance statistics over the data-parallel ranks of this stage, summed over the whole
        step (the expert bias moves in an optimizer pre-step hook); the balance losses'
        gradients scaled as the main loss is (divided over the microbatches)."""
        import hp_moe

        pd = self.parallel_dims
        if self.mesh is not None and pd.dp * pd.cp > 1:  # the ranks that see different tokens
            names = self.mesh.mesh_dim_names
            present = [n for n in ("dp_replicate", "dp_shard", "cp") if n in names]
            if len(present) == 1:
                sub = self.mesh[present[0]]
            else:
                sub = self.mesh["dp_cp" if "cp" in present else "dp"]
            self.moe_group = sub.get_group()
        n = self.pipeline_microbatches if self.schedule is not None else self.micro_batches
        # a pipeline stage of dense blocks only (DeepSeek's first ones) has no MoE to balance;
        # its data-parallel peers hold the same blocks, so they skip the same collectives
        if any(isinstance(m, hp_moe.MoE) for m in self.model.modules()):
            hp_moe.register_expert_bias_update(self.optimizer, self.model, group=self.moe_group)
            hp_moe.set_aux_loss_scale(self.model, 1.0 / n)
            if pd.cp > 1:  # the context-parallel ranks hold parts of the same sequences
                hp_moe.set_load_balance_group(
                    self.model, self.moe_group, sequence_group=self.mesh["cp"].get_group()
                )

    def moe_statistics(self) -> list[dict]:
        """Every MoE layer's statistics of the step so far (``hp_moe.moe_statistics``; the
        balance loss as the mean over the step's microbatches), by full layer name. Collective
        over the data-parallel ranks and the pipeline stages: every rank gets every layer's."""
        import hp_moe

        stats = hp_moe.moe_statistics(self.model, group=self.moe_group)
        n = self.pipeline_microbatches if self.schedule is not None else self.micro_batches
        for st in stats:  # a pipeline stage's modules are "stages.<s>.layers...."
            st["layer"] = re.sub(r"^stages\.\d+\.", "", st["layer"]).removesuffix(".moe")
            st["aux_loss"] /= n  # the step's sum over its forwards: their mean
        if self.schedule is not None:
            parts: list = [None] * self.parallel_dims.pp
            dist.all_gather_object(parts, stats, group=self.mesh.get_group("pp"))
            stats = sorted((s for part in parts for s in part), key=lambda s: _layer_key(s))
        return stats

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint holds."""
        return {
            "model": hp_dcp.ModelState(self.model),
            "optimizer": hp_dcp.OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler,
            "train": {"step": self.step, "losses": list(self.losses)},
            "rng": hp_dcp.RNGState(),
        }

    def latest_checkpoint(self) -> Path | None:
        """The committed ``step-N`` folder with the largest N, if any."""
        if not self.ckpt_dir.exists():
            return None
        steps = [
            (int(m.group(1)), d)
            for d in self.ckpt_dir.iterdir()
            if (m := re.fullmatch(r"step-(\d+)", d.name)) and (d / "metadata.json").exists()
        ]
        return max(steps)[1] if steps else None

    def load_checkpoint(self, path: Path) -> None:
        state = self.state()
        hp_dcp.load(state, checkpoint_id=path)
        self.step = self._saved_step = state["train"]["step"]
        self.losses = list(state["train"]["losses"])
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def save_checkpoint(self) -> Path:
        """Write (or, with ``checkpoint.async_mode``, start writing) ``step-<step>``; its
        collectives wait up to ``comm.checkpoint_timeout_s``."""
        path = self.ckpt_dir / f"step-{self.step}"
        self._saved_step = self.step
        if self.config.checkpoint.async_mode:
            self._pending = hp_dcp.async_save(self.state(), checkpoint_id=path)
        else:
            hp_dcp.save(self.state(), checkpoint_id=path)
        self._prune()
        for cb in self.callbacks:
            cb.on_checkpoint(self, self.step, path)
        return path

    def _prune(self) -> None:
        keep = self.config.checkpoint.keep_latest_k
        if self.rank != 0 or keep <= 0 or not self.ckpt_dir.exists():
            return
        found = sorted(
            (int(m.group(1)), d)
            for d in self.ckpt_dir.iterdir()
            if (m := re.fullmatch(r"step-(\d+)", d.name))
        )
        for _, d in found[: max(len(found) - keep, 0)]:
            shutil.rmtree(d, ignore_errors=True)

    # -- the loop -----------------------------------------------------------------------------
    def _reduce_mean(self, x: torch.Tensor) -> float:
        if dist.is_initialized():
            x = x.clone()
            dist.all_reduce(x)  # tensor-parallel ranks hold the same value; with a pipeline
            # only the last stage's ranks hold one
            return x.item() * self.parallel_dims.pp / dist.get_world_size()
        return x.item()

    def _clip(self, params, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) by the norm over the whole model: each
        pipeline stage's norm (exact over its DTensor shards) is combined over the stages."""
        if self.parallel_dims.pp == 1:
            return clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        norm = clip_grad_norm_(params, float("inf"))
        sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach().float() ** 2
        dist.all_reduce(sq, group=self.mesh.get_group("pp"))
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(coef.to(p.grad.device))
        return norm

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Step ``step``'s forward and backward passes over this rank's batch (the pipeline
        schedule, or the gradient-accumulation micro-steps); returns the summed loss tensor,
        not read back."""
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:  # one pipelined step over the rank's batch
            ((x, y),) = self.data.local_batches(step, self.dp_rank, self.parallel_dims.dp, 1)
            x, y = self._local(x), self._local(y)
            losses: list = []
            args = (x,) if self.has_first else ()
            kw = {"target": y, "losses": losses} if self.has_last else {}
            self.schedule.step(*args, **kw)
            if losses:
                total += torch.stack([v.detach().float() for v in losses]).mean()
        else:
            for x, y in self.data.local_batches(
                step, self.dp_rank, self.parallel_dims.dp, self.micro_batches
            ):
                x, y = self._local(x), self._local(y)
                if self.config.training.fused_loss:
                    loss = self.model(x, targets=y) / self.micro_batches
                else:
                    loss = _loss(self.model(x), y) / self.micro_batches
                loss.backward()
                total += loss.detach()
        return total

    def first_stage_outputs(self) -> list[tuple[torch.Size, torch.dtype]]:
        """Shapes and dtypes of what the first pipeline stage sends on for one microbatch of
        the next step: the stage run on it without gradients. Only on a rank that holds the
        first stage. ``hp-plan dry-run`` declares these as every stage's inputs
        (``PipelineSchedule.declare_input_shapes``): a fake process group delivers no
        header."""
        if self.schedule is None or not self.has_first:
            raise ConfigError(
                "first_stage_outputs: this rank holds no first pipeline stage "
                f"(pipeline_parallel_degree={self.parallel_dims.pp})"
            )
        from hp_pipeline import split_microbatches

        ((x, _),) = self.data.local_batches(self.step + 1, self.dp_rank, self.parallel_dims.dp, 1)
        ((args, _), *_) = split_microbatches((self._local(x),), {}, self.pipeline_microbatches)
        with torch.no_grad():
            out = self.model.stages["0"](*args)
        return [(o.shape, o.dtype) for o in (out if isinstance(out, tuple) else (out,))]

    def dry_step(self) -> None:
        """One training step's tensor work and nothing else: forward, backward, the swap
        managers' release, gradient clipping, the optimizer and scheduler steps, the gradients'
        release. No value is read back (no loss or norm, no finiteness check, no MoE or MTP
        statistics, no metrics, callbacks or checkpoints), so it runs under fake tensors and a
        fake process group: this is what ``hp-plan dry-run`` measures. ``train_step`` does the
        same work and the rest."""
        step = self.step + 1
        self._forward_backward(step)
        for m in self._swap_managers:
            m.step()
        params = [p for p in self.model.parameters() if p.grad is not None]
        self._clip(params, self.config.training.max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step

    def train_step(self) -> dict:
        """One optimizer step (with gradient accumulation); returns its metrics."""
        t = self.config.training
        t0 = time.perf_counter()
        step = self.step + 1
        # the RNG as the step found it: a "stop" checkpoint of the previous step restores it
        self._rng_at_start = (
            torch.get_rng_state(),
            (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None),
        )
        total = self._forward_backward(step)
        swapped = [m.step() for m in self._swap_managers]  # host buffers back to the pool
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self._clip(params, t.max_norm)
        moe = self.moe_statistics() if self.model_config.moe is not None else None
        mtp = self._mtp_loss() if self.model_config.mtp_layers else None
        lr = self.optimizer.param_groups[0]["lr"]
        loss_v = self._reduce_mean(total)
        norm_v = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # one all-reduce (MAX) of this rank's flags: every rank takes the same branches, even
        # where a value was only local (a replicated gradient's norm) or SIGTERM came late
        bad, self._stop_requested = self._agree(
            not (math.isfinite(loss_v) and math.isfinite(norm_v)), self._preempted
        )
        finite = not bad
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self._nonfinite(step, loss_v, norm_v)  # raises for "stop"
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self.losses.append(loss_v)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = t.global_batch_size * t.seq_len
        out = {
            "loss": loss_v,
            "grad_norm": norm_v,
            "lr": float(lr),
            "tokens_per_s": tokens / dt,
            "mfu": self._mfu(tokens / dt),
            "memory_gib": self._memory_gib(),
            "step_time_s": dt,
        }
        if moe is not None:
            out["moe"] = moe
        if mtp is not None:
            out["mtp_loss"] = mtp
        if swapped:  # activations this rank sent to host memory in the step
            out["swapped_gib"] = sum(st.bytes_out for st in swapped) / 2**30
        if not finite:
            out["skipped"] = True
        return out

    def _nonfinite(self, step: int, loss: float, norm: float) -> None:
        """A step whose loss or gradient norm is not finite changes nothing: no optimizer or
        LR step, the MoE counts of the step dropped. ``on_nonfinite = "stop"`` then writes a
        checkpoint of the last good step (the state is still that step's) and raises
        :class:`NonFiniteError`; ``"skip"`` goes on with the next batch."""
        what = f"step {step}: loss {loss}, grad_norm {norm}"
        if self.model_config.moe is not None:
            import hp_moe

            hp_moe.reset_statistics(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.training.on_nonfinite == "skip":
            if self.rank == 0:
                print(
                    f"{what}: not finite, step skipped (training.on_nonfinite='skip')", flush=True
                )
            return
        saved = ""
        c = self.config.checkpoint
        if c.enable and self.step > 0:
            self._finish_pending()
            path = self.ckpt_dir / f"step-{self.step}"
            # decided from memory (the same on every rank), not from the file system
            if self._saved_step != self.step:
                cpu, cuda = self._rng_at_start  # the RNG as step self.step left it
                torch.set_rng_state(cpu)
                if cuda is not None:
                    torch.cuda.set_rng_state(cuda, self.device)
                path = self.save_checkpoint()
                self._finish_pending()
            saved = f"; the last good step's checkpoint is {path}"
        raise NonFiniteError(
            f"{what}: not finite, training stopped (training.on_nonfinite='stop'){saved}. Lower "
            "training.lr, check the data, or set training.on_nonfinite='skip'"
        )

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """A batch of token ids on this rank's device and, under context parallelism, this
        rank's part of each sequence (its losses are then over those tokens: the mean over the
        context- and data-parallel ranks is the whole batch's, every rank holding as many)."""
        t = t.to(self.device)
        if self.parallel_dims.cp > 1:
            from hp_dtensor.parallel import context_parallel_shard

            lb = self.config.parallelism.context_parallel_load_balance
            t = context_parallel_shard(t, self.mesh["cp"], 1, load_balance=lb)
        return t

    def _mtp_loss(self) -> float:
        """The step's multi-token prediction loss (weighted, mean over its microbatches and
        the data-parallel ranks); the model's running sum restarts."""
        (model,) = [m for m in self.model.modules() if isinstance(m, Transformer)]
        total = model.mtp_loss.detach().clone() / self.micro_batches
        model.mtp_loss.zero_()
        return self._reduce_mean(total)

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        peak = next((v for k, v in _PEAK_FLOPS.items() if k in name), None)
        if peak is None:
            return None
        flops_per_token = self.model_config.flops_per_token(self.config.training.seq_len)
        world = dist.get_world_size() if dist.is_initialized() else 1
        return tokens_per_s * flops_per_token / (peak * world)

    def _memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def train(self) -> list[float]:
        """Run from the current step to ``training.steps``; returns every step's loss so far.

        SIGTERM (a scheduler's preemption) lets the current step finish, writes a checkpoint
        and returns: the ranks agree on it at the end of each step, so they stop at the same
        one, and a resumed run continues exactly as if it had never stopped. A collective that
        fails or times out (``comm.train_timeout_s`` from the first step's end on) raises
        :class:`PeerFailure` naming the ranks that did not report."""
        cfg = self.config
        for cb in self.callbacks:
            cb.on_train_begin(self)
        start = self.step
        self._preempted = self._stop_requested = False
        with self._on_sigterm():
            while self.step < cfg.training.steps:
                metrics = self._guarded(self.train_step, beat=True)
                if self.step == start + 1:  # set up and compiled: the training timeout now
                    self._set_timeouts(cfg.comm.train_timeout_s)
                for cb in self.callbacks:
                    cb.on_step_end(self, self.step, metrics)
                c = cfg.checkpoint
                done = self.step == cfg.training.steps
                if self._stop_requested:  # agreed in the step's flag all-reduce
                    if self.rank == 0:
                        print(f"SIGTERM: stopping after step {self.step}", flush=True)
                    if c.enable:
                        self._guarded(self._checkpoint)
                    break
                if c.enable and (self.step % c.interval == 0 or done):
                    self._guarded(self._checkpoint)
            self._guarded(self._finish_pending)  # still under the handler: a late SIGTERM
            # must not kill the commit of the last checkpoint
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self.losses

    # -- faults -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_sigterm(self):
        """Note SIGTERM instead of dying from it (main thread only; elsewhere, as before)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self._preempted = True

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:  # None: a handler not installed from Python; the default is what it did
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def _agree(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over all ranks (one all-reduce; as given on one process)."""
        if not dist.is_initialized():
            return list(flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def _checkpoint(self) -> None:
        """``save_checkpoint`` with the collectives' timeout at ``comm.checkpoint_timeout_s``
        (ranks wait there for the slowest writer and the commit), then back."""
        before = self._timeout_s
        self._set_timeouts(max(before, self.config.comm.checkpoint_timeout_s))
        try:
            self.save_checkpoint()
        finally:
            self._set_timeouts(before)

    def _set_timeouts(self, seconds: float) -> None:
        """Every existing process group's collective timeout (the default group's and the
        meshes'); groups created later keep the timeout they are created with."""
        self._timeout_s = seconds
        if not dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=seconds)
        for group in list(dist.distributed_c10d._world.pg_map):
            if not dist.distributed_c10d._rank_not_in_group(group):
                dist.distributed_c10d._set_pg_timeout(timeout, group)

    def _guarded(self, fn, *, beat: bool = False):
        """``fn()`` (with ``beat``, this rank's next step noted in the store first); a failed
        collective becomes a :class:`PeerFailure` that names the silent ranks."""
        if self._store is None:
            return fn()
        try:
            if beat:
                self._store.set(f"hp_trainer/started/{self.rank}", str(self.step + 1))
            return fn()
        except (TrainingError, ConfigError):
            raise
        except RuntimeError as exc:
            if not _is_communication_error(exc):  # out of memory, a full disk, a bug: as is
                raise
            raise self._peer_failure(exc) from exc

    def _peer_failure(self, exc: BaseException) -> PeerFailure:
        """Report this rank's failure in the store, wait a few seconds for the others' reports,
        and name the ranks that sent none (dead, or hung inside the step they last started)."""
        world = dist.get_world_size()
        step = self.step + 1
        head = f"rank {self.rank}: a collective failed or timed out in step {step}"
        store = self._store
        try:
            store.set_timeout(datetime.timedelta(seconds=5))
            store.set(f"hp_trainer/failed/{self.rank}", str(step))
            grace = min(30.0, max(5.0, self.config.comm.train_timeout_s / 2))
            deadline = time.monotonic() + grace
            keys = {r: f"hp_trainer/failed/{r}" for r in range(world)}
            while time.monotonic() < deadline:
                silent = [r for r in range(world) if not store.check([keys[r]])]
                if not silent:
                    break
                time.sleep(0.2)
            last = {}
            for r in silent:
                key = f"hp_trainer/started/{r}"
                last[r] = int(store.get(key)) if store.check([key]) else None
            # a silent rank behind this one never reached the step: dead or hung before it; one
            # at the same step may only still be waiting for its own timeout
            behind = [r for r in silent if last[r] is None or last[r] < step]
            waiting = [r for r in silent if r not in behind]
            if behind:
                where = ", ".join(
                    f"rank {r} (last started step {last[r]})"
                    if last[r] is not None
                    else f"rank {r} (started no step)"
                    for r in behind
                )
                head += f"; did not report, dead or hung: {where}"
            if waiting:
                head += (
                    f"; in step {step} too but not reported within {grace:.0f} s (dead, hung "
                    f"inside the step, or still waiting): ranks {waiting}"
                )
            if not silent:
                head += "; every rank reported the failure (no rank is silent)"
        except Exception:  # the store is gone with its host
            head += "; the rendezvous store (hosted by rank 0) is unreachable: rank 0 died or hung"
        msg = f"{head}\n{type(exc).__name__}: {exc}"
        print(msg, file=sys.stderr, flush=True)
        return PeerFailure(msg)
