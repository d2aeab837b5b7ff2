"""hp_autoparallel: plan how to train a model on N GPUs.

Memory and step-time models of hp-train's configurations (``estimate``), an N-D search over
data / tensor / pipeline / context / expert parallelism, microbatches, schedules and
recomputation (``search``), a per-layer keep / recompute / swap policy for an activation
budget (``offload_policy``), the ``hp-plan`` CLI that ranks them and writes an hp-train
TOML for the best, and ``hp-plan dry-run`` (``dry_run``), which builds a configuration with
fake tensors and a fake process group and measures each rank's peak memory. The planning
core is pure Python (importing this package imports no torch; the dry run's names load torch
on first use); the search reads hp-trainer's model registry and degree checks and
hp-pipeline's schedules, simulator and stage balancing through their public APIs.
"""

from ._estimate import Estimate, Evaluator, MemoryEstimate, StepTime, estimate
from ._hardware import Cluster, GpuCalibration, Link, load_cluster, load_gpu, shipped_gpus
from ._offload import ACTIONS, LayerCost, OffloadPolicy, offload_policy, simulate
from ._plan import RECOMPUTE, SCHEDULES, Plan, StageLayout, Workload
from ._search import Rejection, SearchResult, nearest_gpu_count, search
from ._spec import LayerParams, ModelSpec, known_models, model_spec, spec_from_config
from ._toml import train_config, write_train_config
from .errors import (
    CalibrationError,
    ClusterFileError,
    NoPlanError,
    PlanError,
    PlanTypeError,
    UnknownGpuError,
    UnknownModelError,
)

__version__ = "0.1.0"

#: names of ``_dryrun`` (it imports torch and hp-trainer), loaded on first use
_DRY_RUN = ("DryRunReport", "RankPeak", "dry_run", "plan_of_config", "step_peak")


def __getattr__(name: str):
    if name in _DRY_RUN:
        from . import _dryrun

        return getattr(_dryrun, name)
    raise AttributeError(f"module 'hp_autoparallel' has no attribute {name!r}")


__all__ = [
    "ACTIONS",
    "RECOMPUTE",
    "SCHEDULES",
    "CalibrationError",
    "Cluster",
    "DryRunReport",
    "ClusterFileError",
    "Estimate",
    "Evaluator",
    "GpuCalibration",
    "LayerParams",
    "LayerCost",
    "Link",
    "MemoryEstimate",
    "ModelSpec",
    "NoPlanError",
    "OffloadPolicy",
    "Plan",
    "PlanError",
    "PlanTypeError",
    "RankPeak",
    "Rejection",
    "SearchResult",
    "StageLayout",
    "StepTime",
    "UnknownGpuError",
    "UnknownModelError",
    "Workload",
    "dry_run",
    "estimate",
    "known_models",
    "load_cluster",
    "load_gpu",
    "model_spec",
    "nearest_gpu_count",
    "offload_policy",
    "plan_of_config",
    "search",
    "shipped_gpus",
    "simulate",
    "spec_from_config",
    "step_peak",
    "train_config",
    "write_train_config",
]
