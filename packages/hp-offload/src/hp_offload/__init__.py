"""hp_offload: activation memory. Selective activation checkpointing (``checkpoint``,
``checkpoint_wrapper``, ``CheckpointPolicy``), activation swap to host memory with prefetch
(``swap``, ``swap_wrapper``, ``SwapManager``), and both configured per layer (``OffloadPlan``).
The same calls take MindSpore cells (``hp_offload._backend._mindspore``).
"""

from ._checkpoint import CheckpointPolicy, checkpoint, checkpoint_wrapper
from ._plan import OffloadPlan, apply_offload_plan
from ._swap import (
    SwapManager,
    SwapPolicy,
    SwapStats,
    default_manager,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)
from .errors import OffloadError, OffloadTypeError, OffloadUnsupportedError

__version__ = "0.1.0"

__all__ = [
    "CheckpointPolicy",
    "OffloadError",
    "OffloadPlan",
    "OffloadTypeError",
    "OffloadUnsupportedError",
    "SwapManager",
    "SwapPolicy",
    "SwapStats",
    "apply_offload_plan",
    "checkpoint",
    "checkpoint_wrapper",
    "default_manager",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
