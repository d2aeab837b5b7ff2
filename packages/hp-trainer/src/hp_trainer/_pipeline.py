"""Pipeline parallelism for the Llama/Qwen3 :class:`~hp_trainer.models.Transformer`: cut it into
stages that keep their parameter names, parallelize each stage (TP, checkpointing, FSDP over the
data-parallel part of the mesh) and drive them with an hp_pipeline schedule."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from ._parallel_dims import ParallelDims
from ._parallelize import ParallelizeConfig, parallelize_llama, resolve_activation_plan
from .errors import ConfigError, check_instance

__all__ = ["SCHEDULES", "StageSet", "layer_ranges", "pipeline_llama", "split_stage"]

#: schedule name -> stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}


def layer_ranges(cfg, n_stages: int, seq_len: int | None = None) -> list[tuple[int, int]]:
    """Blocks ``[lo, hi)`` per stage, balanced by ``hp_pipeline.balance_stages`` on the cost per
    token of each block (``6 x`` its parameters plus attention over ``seq_len``; a MoE block's
    active experts only) with the output projection's cost on the last block: with a large
    vocabulary the last stage gets fewer blocks. The blocks' parameter memory (all experts)
    goes into the plan too, but no memory limit is imposed: the split balances time."""
    from hp_pipeline import balance_stages

    n = cfg.n_layers
    if n_stages > n:
        raise ConfigError(f"{n_stages} pipeline stages for {n} layers: use fewer stages")
    seq = seq_len or cfg.max_seq_len
    block = (cfg.num_params(embeddings=False) - cfg.dim) / n
    costs = [6 * block + 12 * cfg.dim * seq] * n
    memory = [block] * n
    if cfg.moe is not None:  # a MoE block computes with its active experts, holds them all
        moe = cfg.moe
        dense = cfg.replace(moe=None, mtp_layers=0)
        dense_block = (dense.num_params(embeddings=False) - cfg.dim) / n
        swap = moe.num_params(cfg.dim, active=True) - 3 * cfg.dim * cfg.ffn_hidden
        total = moe.num_params(cfg.dim) - 3 * cfg.dim * cfg.ffn_hidden
        for i in range(n):
            active = dense_block + (swap if moe.is_moe(i) else 0)
            costs[i] = 6 * active + 12 * cfg.dim * seq
            memory[i] = dense_block + (total if moe.is_moe(i) else 0)
    costs[-1] += 6 * cfg.vocab_size * cfg.dim  # the output projection
    memory[0] += cfg.vocab_size * cfg.dim
    memory[-1] += cfg.vocab_size * cfg.dim
    return [tuple(b) for b in balance_stages(costs, memory, n_stages).boundaries]


def split_stage(model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` keeping blocks ``lo..hi-1`` (under their own names), the embedding
    when ``first``, the final norm and output when ``last``."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if not lo <= int(name) < hi:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


class StageSet(nn.Module):
    """This rank's stage modules seen as one model: ``named_parameters`` and ``state_dict``
    with the full model's names (the stages' blocks keep theirs), so checkpoints and the
    optimizer state are interchangeable with an unpipelined run."""

    def __init__(self, stages: dict[int, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(k): v for k, v in stages.items()})

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator:
        for mod in self.stages.values():
            yield from mod.named_parameters(prefix=prefix, recurse=recurse)

    def state_dict(self, *args, **kwargs) -> dict:
        out = {}
        for mod in self.stages.values():
            out.update(mod.state_dict())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        for mod in self.stages.values():
            own = mod.state_dict().keys()
            mine = {k: v for k, v in state_dict.items() if k in own}
            mod.load_state_dict(mine, strict=False, assign=assign)


def pipeline_llama(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    mesh,
    expert_mesh=None,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable,
    config: ParallelizeConfig | None = None,
    device: torch.device | None = None,
    cuda_graphs: bool = False,
):
    """Cut ``model`` into ``pp x v`` stages (``v`` = stages per rank of the schedule), keep this
    rank's, parallelize each with :func:`parallelize_llama` and build the schedule.

    Returns ``(schedule, stages)``: an hp_pipeline schedule and a :class:`StageSet` of this
    rank's stage modules. Tied embeddings cannot be split across stages (raises).
    ``cuda_graphs`` makes every stage replay its microbatches from CUDA graphs
    (``PipelineStage(cuda_graphs=True)``)."""
    from hp_pipeline import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBV,
        build_schedule,
    )

    from .models import Transformer

    check_instance(
        model, Transformer, "model", "pipeline_llama", "pass an hp_trainer.models.Transformer"
    )
    check_instance(
        parallel_dims, ParallelDims, "parallel_dims", "pipeline_llama", "build a ParallelDims"
    )
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"parallelism.pipeline_schedule={schedule!r}: use one of {sorted(SCHEDULES)}"
        )
    if model.config.tie_word_embeddings:
        raise ConfigError(
            "a model with tied embeddings cannot be pipelined (the embedding and the output "
            "would sit on different stages): untie them or set pipeline_parallel_degree = 1"
        )
    pp, v = parallel_dims.pp, SCHEDULES[schedule]
    n_stages = pp * v
    placement = build_schedule(schedule, pp, n_microbatches)[1]
    rank = mesh.get_local_rank("pp")
    ranges = layer_ranges(model.config, n_stages)
    config = config or ParallelizeConfig()
    if config.activation_plan:  # checked on the whole model, as every rank has it
        resolve_activation_plan(model, config.activation_plan)
    config = dataclasses.replace(config, _stage=True)
    mods = {}
    for s in range(n_stages):
        if placement[s] == rank:
            lo, hi = ranges[s]
            mod = split_stage(model, lo, hi, s == 0, s == n_stages - 1)
            mods[s] = parallelize_llama(
                mod, parallel_dims=parallel_dims, mesh=mesh, expert_mesh=expert_mesh, config=config
            )
    group = mesh.get_group("pp")
    stages = [
        PipelineStage(mods[s], s, n_stages, device=device, group=group, cuda_graphs=cuda_graphs)
        for s in sorted(mods)
    ]
    cls = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zbv": ScheduleZBV,
    }[schedule]
    sched = cls(stages if v > 1 else stages[0], n_microbatches, loss_fn=loss_fn)
    return sched, StageSet(mods)
