import dataclasses

import pytest
import torch
import torch.nn as nn

from hp_dtensor import DeviceMesh
from hp_fsdp import CPUOffloadPolicy, FSDPError, MixedPrecisionPolicy, fully_shard


def test_policies_are_frozen_values():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mp == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert hash(mp) == hash(MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = torch.float16
    assert CPUOffloadPolicy().pin_memory is True


def _fake_mesh(shape):
    """A DeviceMesh of ``shape`` without process groups: enough for checks that read its shape."""
    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh._shape = tuple(shape)
    return mesh


def test_bad_arguments_fail_before_any_communication():
    fake3d = _fake_mesh((1, 2, 2))
    with pytest.raises(FSDPError, match="3 dims"):
        fully_shard(nn.Linear(2, 2), mesh=fake3d)
    fake1d = _fake_mesh((4,))
    with pytest.raises(FSDPError, match="reshard_after_forward=3"):
        fully_shard(nn.Linear(2, 2), mesh=fake1d, reshard_after_forward=3)
    with pytest.raises(FSDPError, match="offload_policy"):
        fully_shard(nn.Linear(2, 2), mesh=fake1d, offload_policy="cpu")
