"""hyperparallel: one import for HyperParallel's public API.

The most used names sit at the top level (``hp.fully_shard``, ``hp.DTensor``,
``hp.init_device_mesh``, ``hp.parallelize_module``, ``hp.PipelineStage``, ...); each package is
also reachable whole: ``hp.dtensor``, ``hp.fsdp``, ``hp.optim``, ``hp.pipeline``, ``hp.offload``,
``hp.dcp``, ``hp.moe``, ``hp.trainer``, ``hp.kernels`` (its compiled module loads on first
use), ``hp.autoparallel`` (planning: ``hp.autoparallel.search``, the ``hp-plan`` CLI).
"""

import hp_autoparallel as autoparallel
import hp_dcp as dcp
import hp_dtensor as dtensor
import hp_fsdp as fsdp
import hp_kernels as kernels
import hp_moe as moe
import hp_offload as offload
import hp_optim as optim
import hp_pipeline as pipeline
import hp_trainer as trainer
from hp_dtensor import (
    DeviceMesh,
    DTensor,
    Layout,
    Partial,
    Replicate,
    Shard,
    destroy_process_group,
    distribute_module,
    distribute_tensor,
    get_backend,
    get_group_local_rank,
    get_process_group_ranks,
    init_device_mesh,
    init_process_group,
    mark_created_groups,
    split_group,
)
from hp_dtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from hp_moe import (
    ExpertParallel,
    ExpertTensorParallel,
    GroupedExperts,
    MoE,
    TokenChoiceTopKRouter,
    register_expert_bias_update,
    reset_statistics,
    update_expert_bias,
)
from hp_offload import OffloadPlan, checkpoint_wrapper, swap_wrapper
from hp_optim import AdamW, Muon, clip_grad_norm_
from hp_pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBV,
)
from hp_trainer import ParallelDims, parallelize_llama

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "CPUOffloadPolicy",
    "ColwiseParallel",
    "DTensor",
    "DeviceMesh",
    "ExpertParallel",
    "ExpertTensorParallel",
    "GroupedExperts",
    "Layout",
    "MixedPrecisionPolicy",
    "MoE",
    "Muon",
    "OffloadPlan",
    "ParallelDims",
    "Partial",
    "PipelineStage",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "Replicate",
    "RowwiseParallel",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZBV",
    "SequenceParallel",
    "Shard",
    "TokenChoiceTopKRouter",
    "autoparallel",
    "checkpoint_wrapper",
    "clip_grad_norm_",
    "dcp",
    "distribute_module",
    "distribute_tensor",
    "dtensor",
    "fsdp",
    "fully_shard",
    "kernels",
    "init_device_mesh",
    "loss_parallel",
    "moe",
    "offload",
    "optim",
    "parallelize_llama",
    "parallelize_module",
    "pipeline",
    "register_expert_bias_update",
    "swap_wrapper",
    "trainer",
    "reset_statistics",
    "update_expert_bias",
    "destroy_process_group",
    "get_backend",
    "get_group_local_rank",
    "get_process_group_ranks",
    "init_process_group",
    "mark_created_groups",
    "split_group",
]
