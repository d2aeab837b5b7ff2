"""hp_fsdp: ``fully_shard`` (FSDP and HSDP) on hp-dtensor."""

from ._api import (
    CPUOffloadPolicy,
    HSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    get_full_state_dict,
    hsdp_sync_stream,
    load_full_state_dict,
    parallelize_value_and_grad,
)
from .errors import FSDPError, FSDPTypeError

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "FSDPError",
    "FSDPTypeError",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "fully_shard",
    "get_full_state_dict",
    "hsdp_sync_stream",
    "load_full_state_dict",
    "parallelize_value_and_grad",
]
