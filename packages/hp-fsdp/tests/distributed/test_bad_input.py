"""Bad input to hp_fsdp's public functions (issue 26), on 2 gloo ranks.

Each row is (id, call, error class, regex): the call must raise the error class (an
``FSDPError``; ``FSDPTypeError`` for a wrong type), with a message matching the regex (which
names the argument), on both ranks alike and before any collective. Every row failed before its
fix: an AttributeError/TypeError from deep inside, or a value silently accepted.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh as init_torch_mesh

import hp_dtensor as hp
from hp_dtensor._backend import COMMUNICATING_METHODS
from hp_fsdp import (
    CPUOffloadPolicy,
    FSDPError,
    FSDPTypeError,
    MixedPrecisionPolicy,
    fully_shard,
    get_full_state_dict,
    load_full_state_dict,
)
from hp_testing.bad_input import Case, by_id, check, run_case
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=60)


def _fs(c, **kw):
    return fully_shard(nn.Linear(4, 4), **kw)


T = FSDPTypeError
CASES = [
    # -- fully_shard ---------------------------------------------------------------------
    Case("fully_shard/mesh_str", lambda c: _fs(c, mesh="dp"), T, r"mesh='dp' .*DeviceMesh"),
    Case("fully_shard/mesh_list", lambda c: _fs(c, mesh=[0, 1]), T, r"mesh=\[0, 1\]"),
    Case(
        "fully_shard/torch_mesh",
        lambda c: _fs(c, mesh=c.torch_mesh),
        T,
        r"mesh=.* is a torch\.distributed\.device_mesh\.DeviceMesh, not an hp_dtensor",
    ),
    Case(
        "fully_shard/module_none",
        lambda c: fully_shard(None, mesh=c.mesh),
        T,
        r"module is a NoneType",
    ),
    Case(
        "fully_shard/module_str",
        lambda c: fully_shard("m", mesh=c.mesh),
        T,
        r"module is a str",
    ),
    Case(
        "fully_shard/module_tensor",
        lambda c: fully_shard(torch.ones(2), mesh=c.mesh),
        T,
        r"module is a Tensor",
    ),
    Case(
        "fully_shard/module_class",
        lambda c: fully_shard(nn.Linear, mesh=c.mesh),
        T,
        r"module is the class Linear",
    ),
    Case(
        "fully_shard/mp_policy_str",
        lambda c: _fs(c, mesh=c.mesh, mp_policy="bf16"),
        T,
        r"mp_policy='bf16'",
    ),
    Case(
        "fully_shard/mp_policy_dtype",
        lambda c: _fs(c, mesh=c.mesh, mp_policy=torch.bfloat16),
        T,
        r"mp_policy=torch\.bfloat16",
    ),
    Case(
        "fully_shard/offload_policy_str",
        lambda c: _fs(c, mesh=c.mesh, offload_policy="cpu"),
        T,
        r"offload_policy='cpu'",
    ),
    Case(
        "fully_shard/ignored_params_int",
        lambda c: _fs(c, mesh=c.mesh, ignored_params=1),
        T,
        r"ignored_params is a int",
    ),
    Case(
        "fully_shard/ignored_params_tensor",
        lambda c: _fs(c, mesh=c.mesh, ignored_params=torch.ones(2)),
        T,
        r"ignored_params is a Tensor",
    ),
    Case(
        "fully_shard/ignored_params_names",
        lambda c: _fs(c, mesh=c.mesh, ignored_params=["weight"]),
        T,
        r"ignored_params holds 'weight'",
    ),
    Case(
        "fully_shard/shard_placement_fn_int",
        lambda c: _fs(c, mesh=c.mesh, shard_placement_fn=1),
        T,
        r"shard_placement_fn=1",
    ),
    # -- the policies ---------------------------------------------------------------------
    Case(
        "MixedPrecisionPolicy/param_dtype_str",
        lambda c: MixedPrecisionPolicy(param_dtype="bf16"),
        T,
        r"param_dtype='bf16'",
    ),
    Case(
        "MixedPrecisionPolicy/reduce_dtype_int",
        lambda c: MixedPrecisionPolicy(reduce_dtype=torch.int32),
        FSDPError,
        r"reduce_dtype=torch\.int32 is not a floating-point dtype",
    ),
    Case(
        "MixedPrecisionPolicy/output_dtype_str",
        lambda c: MixedPrecisionPolicy(output_dtype="float"),
        T,
        r"output_dtype='float'",
    ),
    Case(
        "MixedPrecisionPolicy/cast_forward_inputs_str",
        lambda c: MixedPrecisionPolicy(cast_forward_inputs="yes"),
        T,
        r"cast_forward_inputs='yes'",
    ),
    Case(
        "CPUOffloadPolicy/pin_memory_str",
        lambda c: CPUOffloadPolicy(pin_memory="no"),
        T,
        r"pin_memory='no'",
    ),
    # -- HSDPModule methods ---------------------------------------------------------------
    Case("unshard/async_op_str", lambda c: c.m.unshard(async_op="x"), T, r"async_op='x'"),
    Case(
        "set_requires_gradient_sync/str",
        lambda c: c.m.set_requires_gradient_sync("no"),
        T,
        r"requires_gradient_sync='no'",
    ),
    Case(
        "set_requires_gradient_sync/recurse_str",
        lambda c: c.m.set_requires_gradient_sync(False, recurse="x"),
        T,
        r"recurse='x'",
    ),
    Case(
        "set_reshard_after_forward/str",
        lambda c: c.m.set_reshard_after_forward("no"),
        T,
        r"reshard_after_forward='no'",
    ),
    Case(
        "set_reshard_after_forward/int",  # bool(2) was taken as True, not as k=2
        lambda c: c.m.set_reshard_after_forward(2),
        T,
        r"reshard_after_forward=2 .*fully_shard\(reshard_after_forward=k\)",
    ),
    Case(
        "set_reshard_after_backward/str",
        lambda c: c.m.set_reshard_after_backward("no"),
        T,
        r"reshard_after_backward='no'",
    ),
    Case(
        "set_gradient_scaling_factor/str",
        lambda c: c.m.set_gradient_scaling_factor("x"),
        T,
        r"factor='x'",
    ),
    Case(
        "set_gradient_scaling_factor/none",
        lambda c: c.m.set_gradient_scaling_factor(None),
        T,
        r"factor=None",
    ),
    Case(
        "set_gradient_scaling_factor/nan",
        lambda c: c.m.set_gradient_scaling_factor(float("nan")),
        FSDPError,
        r"factor=nan must be finite",
    ),
    Case(
        "set_modules_to_forward_prefetch/one_module",
        lambda c: c.m.set_modules_to_forward_prefetch(c.m2),
        T,
        r"modules=HSDPLinear: give a list",
    ),
    Case(
        "set_modules_to_backward_prefetch/str",
        lambda c: c.m.set_modules_to_backward_prefetch("abc"),
        T,
        r"modules=str: give a list",
    ),
    Case(
        "set_is_last_backward/str",
        lambda c: c.m.set_is_last_backward("no"),
        T,
        r"is_last_backward='no'",
    ),
    # -- full state dicts ---------------------------------------------------------------
    Case(
        "get_full_state_dict/module_int",
        lambda c: get_full_state_dict(1),
        T,
        r"module is a int",
    ),
    Case(
        "get_full_state_dict/rank0_only_str",
        lambda c: get_full_state_dict(c.m, rank0_only="no"),
        T,
        r"rank0_only='no'",
    ),
    Case(
        "load_full_state_dict/missing_keys",
        lambda c: load_full_state_dict(c.m, {}),
        FSDPError,
        r"state_dict lacks \['weight', 'bias'\]",
    ),
    Case(
        "load_full_state_dict/not_a_dict",
        lambda c: load_full_state_dict(c.m, 1),
        T,
        r"state_dict is a int",
    ),
    Case(
        "load_full_state_dict/wrong_shape",
        lambda c: load_full_state_dict(c.m, {"weight": torch.ones(3, 3), "bias": torch.ones(4)}),
        FSDPError,
        r"state_dict\['weight'\] has shape \(3, 3\) .*\(4, 4\)",
    ),
    Case(
        "load_full_state_dict/not_a_tensor",
        lambda c: load_full_state_dict(c.m, {"weight": [1], "bias": torch.ones(4)}),
        T,
        r"state_dict\['weight'\] is a list",
    ),
]
_BY_ID = by_id(CASES)

_COLLECTIVES = COMMUNICATING_METHODS  # a row must raise before any of them


@functools.cache
def _ctx():
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    return types.SimpleNamespace(
        mesh=mesh,
        m=fully_shard(nn.Linear(4, 4), mesh=mesh),
        m2=fully_shard(nn.Linear(4, 4), mesh=mesh),
        torch_mesh=init_torch_mesh("cpu", (2,)),
    )


def _run_case(case_id: str) -> dict:
    """On each rank: run the call, counting collectives; then check the group is still alive."""
    return run_case(_BY_ID[case_id].call, _ctx(), count=(hp.get_platform("cpu"), _COLLECTIVES))


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error_on_every_rank(pool, case_id):
    check(_BY_ID[case_id], pool.run(_run_case, case_id), FSDPError)


def _good_input_still_works():
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    params = iter([model[1].bias])  # an iterator is read once, not consumed by the checks
    fully_shard(model[0], mesh=mesh, mp_policy=None)
    fully_shard(model, mesh=mesh, ignored_params=params)
    model.set_gradient_scaling_factor(1)
    model.set_modules_to_forward_prefetch((model[0],))
    return isinstance(model[1].bias, hp.DTensor), isinstance(model[1].weight, hp.DTensor)


def test_good_input_is_still_accepted(pool):
    # the ignored bias stays a plain parameter; the weight is sharded
    assert pool.run(_good_input_still_works) == [(False, True)] * 2
