"""hp_trainer: models in single-device code, ``ParallelDims`` and (coming) the trainer and the
``hp-train`` CLI. See the package README."""

from . import models
from ._parallel_dims import ParallelDims
from ._parallelize import ParallelizeConfig, dp_mesh, parallelize_llama
from .errors import ConfigError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ParallelDims",
    "ParallelizeConfig",
    "dp_mesh",
    "models",
    "parallelize_llama",
]
