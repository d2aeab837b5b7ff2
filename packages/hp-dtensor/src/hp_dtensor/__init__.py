"""hp_dtensor: HyperParallel's foundation.

Backend seam and process groups, ``DeviceMesh``, placements, ``Layout``, ``DTensor`` with
redistribution and sharding-rule dispatch, distributed random numbers and deferred
initialisation. See the package README for an example.
"""

from ._backend import (
    Platform,
    available_platforms,
    framework_of,
    get_platform,
    platform_class,
    register_platform,
)
from ._dtensor import DTensor, distribute_module, distribute_tensor
from ._groups import (
    destroy_process_group,
    get_backend,
    get_group_local_rank,
    get_process_group_ranks,
    init_process_group,
    mark_created_groups,
    new_group,
    register_cleanup,
    split_group,
)
from ._init import init_empty_weights, init_on_device, init_parameters
from ._json_comm import all_gather_json, broadcast_json
from ._layout import Layout
from ._mesh import DeviceMesh, init_device_mesh, mesh_from_layout
from ._placement import Partial, Placement, Replicate, Shard
from ._plan import RedistributePlan, Step, plan_redistribute
from ._random import manual_seed
from ._rope import rotary_position_embedding
from ._rules import Call, Strategy, TensorMeta, register_sharding_rule, registered_ops
from ._shard_api import DFunction, SkipDTensorDispatch, custom_shard, shard_module
from ._shard_math import chunk_size_and_offset, local_shape_and_offset
from ._spec import DTensorSpec
from ._transfer import Transfer, TransferPlan, plan_transfer
from ._transfer_run import TransferHandle, transfer_state_dict
from .errors import (
    BackendError,
    ContextParallelError,
    HPDTensorError,
    HPDTensorTypeError,
    LayoutError,
    MeshError,
    PlacementError,
    ShardingError,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    """``hp_dtensor.ms_ops``: ops on MindSpore DTensors (``mint`` names; imported on first use,
    so MindSpore is needed only by code that asks for it)."""
    if name == "ms_ops":
        import importlib

        try:
            return importlib.import_module("hp_dtensor._backend._ms_ops")
        except ImportError as e:
            from ._backend import _INSTALL

            raise BackendError(
                f"hp_dtensor.ms_ops needs MindSpore, which could not be imported ({e}): "
                f"{_INSTALL['mindspore']}"
            ) from e
    raise AttributeError(f"module 'hp_dtensor' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "Call",
    "ContextParallelError",
    "DFunction",
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "HPDTensorError",
    "HPDTensorTypeError",
    "Layout",
    "LayoutError",
    "MeshError",
    "Partial",
    "Placement",
    "PlacementError",
    "Platform",
    "RedistributePlan",
    "Replicate",
    "Shard",
    "ShardingError",
    "SkipDTensorDispatch",
    "Step",
    "Strategy",
    "TensorMeta",
    "Transfer",
    "TransferHandle",
    "TransferPlan",
    "all_gather_json",
    "available_platforms",
    "broadcast_json",
    "chunk_size_and_offset",
    "custom_shard",
    "destroy_process_group",
    "register_cleanup",
    "distribute_module",
    "distribute_tensor",
    "framework_of",
    "get_backend",
    "get_group_local_rank",
    "get_platform",
    "get_process_group_ranks",
    "init_device_mesh",
    "init_empty_weights",
    "init_on_device",
    "init_parameters",
    "init_process_group",
    "local_shape_and_offset",
    "manual_seed",
    "mark_created_groups",
    "mesh_from_layout",
    "new_group",
    "plan_redistribute",
    "plan_transfer",
    "platform_class",
    "register_platform",
    "register_sharding_rule",
    "registered_ops",
    "rotary_position_embedding",
    "shard_module",
    "split_group",
    "transfer_state_dict",
]
