"""hp_optim: optimizers, LR schedules and gradient clipping for sharded (DTensor) parameters."""

from ._clip import clip_grad_norm_
from ._muon import Muon, orthogonalize, zeropower_via_newtonschulz5
from ._optim import AdamW, ChainedOptimizer, get_hyper_optimizer
from ._schedule import HyperLRScheduler, LRScheduleConfig, get_hyper_lr_scheduler, lr_factor
from .errors import OptimError, OptimTypeError

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "ChainedOptimizer",
    "HyperLRScheduler",
    "LRScheduleConfig",
    "Muon",
    "OptimError",
    "OptimTypeError",
    "clip_grad_norm_",
    "get_hyper_lr_scheduler",
    "get_hyper_optimizer",
    "lr_factor",
    "orthogonalize",
    "zeropower_via_newtonschulz5",
]
