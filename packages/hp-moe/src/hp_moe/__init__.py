"""hp_moe: mixture-of-experts layers and expert parallelism for HyperParallel.

Single-device building blocks (``MoE``, ``TokenChoiceTopKRouter``, ``GroupedExperts``,
``FeedForward``), load balancing (auxiliary loss, auxiliary-loss-free expert bias, capacity
drops), token dispatchers with a per-microbatch ``DispatchContext`` (local, all-to-all,
hp-kernels' one-sided), and the styles ``ExpertParallel``, ``TensorParallel`` and
``ExpertTensorParallel`` for ``hp_dtensor.parallel.parallelize_module``. See the README.
"""

from ._balance import (
    MoEAuxLossAutoScaler,
    moe_statistics,
    register_expert_bias_update,
    reset_statistics,
    set_aux_loss_scale,
    set_load_balance_group,
    update_expert_bias,
)
from ._dispatch import (
    AllToAllDispatcher,
    CombineHandle,
    DispatchContext,
    DispatchHandle,
    LocalDispatcher,
    OneSidedDispatcher,
    TokenDispatcher,
)
from ._experts import FeedForward, GroupedExperts, grouped_mm, grouped_mm_supported
from ._moe import MoE, hoist_recompute_check
from ._router import TokenChoiceTopKRouter
from ._styles import ExpertParallel, ExpertTensorParallel, TensorParallel
from .errors import DispatchError, MoEConfigError, MoEError, MoEMeshError, MoETypeError

__version__ = "0.1.0"

__all__ = [
    "AllToAllDispatcher",
    "CombineHandle",
    "DispatchContext",
    "DispatchError",
    "DispatchHandle",
    "ExpertParallel",
    "ExpertTensorParallel",
    "FeedForward",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "MoEAuxLossAutoScaler",
    "MoEConfigError",
    "MoEError",
    "MoEMeshError",
    "MoETypeError",
    "OneSidedDispatcher",
    "TensorParallel",
    "TokenChoiceTopKRouter",
    "TokenDispatcher",
    "grouped_mm",
    "grouped_mm_supported",
    "hoist_recompute_check",
    "moe_statistics",
    "register_expert_bias_update",
    "set_aux_loss_scale",
    "set_load_balance_group",
    "reset_statistics",
    "update_expert_bias",
]
