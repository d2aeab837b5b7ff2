"""hp_trainer: models in single-device code, ``ParallelDims``, parallelize functions,
``LLMTrainer`` and the ``hp-train`` CLI. See the package README."""

from . import models
from ._parallel_dims import ParallelDims
from ._parallelize import ParallelizeConfig, apply_context_parallel, dp_mesh, parallelize_llama
from ._pipeline import StageSet, pipeline_llama
from ._trainer import Callback, LLMTrainer, preflight
from .callbacks import LoggingCallback, MoeMonitorCallback
from .config import JobConfig, load_config
from .errors import ConfigError, NonFiniteError, PeerFailure, TrainerTypeError, TrainingError

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "ConfigError",
    "JobConfig",
    "LLMTrainer",
    "LoggingCallback",
    "MoeMonitorCallback",
    "NonFiniteError",
    "PeerFailure",
    "ParallelDims",
    "ParallelizeConfig",
    "StageSet",
    "TrainerTypeError",
    "TrainingError",
    "dp_mesh",
    "load_config",
    "models",
    "apply_context_parallel",
    "parallelize_llama",
    "pipeline_llama",
    "preflight",
]
