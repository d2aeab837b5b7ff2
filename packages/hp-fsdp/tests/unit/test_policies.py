import dataclasses
import types

import pytest
import torch
import torch.nn as nn

from hp_fsdp import CPUOffloadPolicy, FSDPError, MixedPrecisionPolicy, fully_shard


def test_policies_are_frozen_values():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mp == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert hash(mp) == hash(MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = torch.float16
    assert CPUOffloadPolicy().pin_memory is True


def test_bad_arguments_fail_before_any_communication():
    fake3d = types.SimpleNamespace(ndim=3)
    with pytest.raises(FSDPError, match="3 dims"):
        fully_shard(nn.Linear(2, 2), mesh=fake3d)
    fake1d = types.SimpleNamespace(ndim=1, shape=(4,))
    with pytest.raises(FSDPError, match="reshard_after_forward=3"):
        fully_shard(nn.Linear(2, 2), mesh=fake1d, reshard_after_forward=3)
    with pytest.raises(FSDPError, match="offload_policy"):
        fully_shard(nn.Linear(2, 2), mesh=fake1d, offload_policy="cpu")
