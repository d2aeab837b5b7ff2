"""Bad meshes and style settings for hp_moe's expert styles and dispatchers (issue 26), on 2
gloo ranks.

Each row is (id, call, error class, regex): the call must raise the error class (an
``MoEError``: ``MoEMeshError`` for a mesh, also an ``hp_dtensor.MeshError``; ``MoETypeError``
for a wrong type), with a message matching the regex (which names the argument), on both ranks
alike and before any collective. Every row failed before its fix: hp_dtensor's MeshError or
HPDTensorTypeError (not an hp_moe error), a TypeError from ``%``, or a str flag silently
counted as True. Argument checks that need no mesh are in ``tests/unit/test_bad_input_args.py``.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh as init_torch_mesh

import hp_dtensor as hp
from hp_dtensor import MeshError
from hp_dtensor._backend import COMMUNICATING_METHODS
from hp_dtensor.parallel import parallelize_module
from hp_moe import (
    AllToAllDispatcher,
    ExpertParallel,
    ExpertTensorParallel,
    GroupedExperts,
    MoE,
    MoEConfigError,
    MoEError,
    MoEMeshError,
    MoETypeError,
    OneSidedDispatcher,
    TensorParallel,
)
from hp_testing.bad_input import Case, by_id, check, run_case
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=60)


def _experts():
    return GroupedExperts(8, 16, 4)


M, T = MoEMeshError, MoETypeError
CASES = [
    # -- ExpertParallel -------------------------------------------------------------------
    Case(
        "ExpertParallel/sync_free_str",
        lambda c: parallelize_module(
            MoE(8, 16, 4, 2), c.mesh, {"experts": ExpertParallel(sync_free="no")}
        ),
        T,
        r"sync_free='no' must be True or False",
    ),
    Case(
        "ExpertParallel/torch_mesh",
        lambda c: ExpertParallel().apply(_experts(), c.torch_mesh),
        M,
        r"ExpertParallel: mesh must be an hp_dtensor DeviceMesh, got torch\.distributed\."
        r"device_mesh\.DeviceMesh",
    ),
    Case(
        "ExpertParallel/mesh_2d",
        lambda c: ExpertParallel().apply(_experts(), c.mesh2d),
        M,
        r"expert-parallel mesh must be 1-D, .*mesh\['ep'\]",
    ),
    Case(
        "ExpertParallel/rows_per_peer_float",
        lambda c: ExpertParallel(sync_free=True, rows_per_peer=2.0).apply(_experts(), c.mesh),
        T,
        r"rows_per_peer=2\.0",
    ),
    # -- TensorParallel -------------------------------------------------------------------
    Case(
        "TensorParallel/torch_mesh",  # hp_dtensor's distribute_tensor raised, not hp_moe
        lambda c: TensorParallel().apply(_experts(), c.torch_mesh),
        M,
        r"TensorParallel: device_mesh=.* is a torch\.distributed\.device_mesh\.DeviceMesh",
    ),
    Case(
        "TensorParallel/mesh_2d",
        lambda c: TensorParallel().apply(_experts(), c.mesh2d),
        M,
        r"TensorParallel \(experts\) needs a 1-D mesh",
    ),
    # -- ExpertTensorParallel -------------------------------------------------------------
    Case(
        "ExpertTensorParallel/torch_mesh",
        lambda c: ExpertTensorParallel().apply(_experts(), c.torch_mesh),
        M,
        r"ExpertTensorParallel: device_mesh=.* not an hp_dtensor DeviceMesh",
    ),
    Case(
        "ExpertTensorParallel/unnamed_mesh",
        lambda c: ExpertTensorParallel().apply(_experts(), c.mesh2d_unnamed),
        M,
        r"needs a mesh with dimension names",
    ),
    Case(
        "ExpertTensorParallel/mesh_1d",
        lambda c: ExpertTensorParallel().apply(_experts(), c.mesh),
        M,
        r"needs a 2-D \[ep, tp\] mesh",
    ),
    Case(
        "ExpertTensorParallel/sync_free_int",
        lambda c: ExpertTensorParallel(sync_free=1).apply(_experts(), c.mesh2d),
        T,
        r"sync_free=1",
    ),
    # -- dispatchers ----------------------------------------------------------------------
    Case(
        "AllToAllDispatcher/num_experts_str",
        lambda c: AllToAllDispatcher("4", c.mesh),
        T,
        r"AllToAllDispatcher: num_experts='4'",
    ),
    Case(
        "AllToAllDispatcher/mesh_str",
        lambda c: AllToAllDispatcher(4, "ep"),
        M,
        r"AllToAllDispatcher: mesh must be an hp_dtensor DeviceMesh, got str",
    ),
    Case(
        "AllToAllDispatcher/mesh_2d",
        lambda c: AllToAllDispatcher(4, c.mesh2d),
        M,
        r"must be 1-D",
    ),
    Case(
        "AllToAllDispatcher/sync_free_str",
        lambda c: AllToAllDispatcher(4, c.mesh, sync_free="yes"),
        T,
        r"sync_free='yes'",
    ),
    Case(
        "AllToAllDispatcher/rows_per_peer_zero",
        lambda c: AllToAllDispatcher(4, c.mesh, sync_free=True, rows_per_peer=True),
        T,
        r"rows_per_peer=True",
    ),
    Case(
        "OneSidedDispatcher/torch_mesh",
        lambda c: OneSidedDispatcher(4, c.torch_mesh),
        M,
        r"OneSidedDispatcher: mesh must be an hp_dtensor DeviceMesh",
    ),
]
_BY_ID = by_id(CASES)

_COLLECTIVES = COMMUNICATING_METHODS  # a row must raise before any of them


@functools.cache
def _ctx():
    return types.SimpleNamespace(
        mesh=hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)),
        mesh2d=hp.init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp")),
        mesh2d_unnamed=hp.init_device_mesh("cpu", (2, 1)),
        torch_mesh=init_torch_mesh("cpu", (2,)),
    )


def _run_case(case_id: str) -> dict:
    """On each rank: run the call, counting collectives; then check the group is still alive."""
    ctx = _ctx()
    torch.manual_seed(0)
    return run_case(_BY_ID[case_id].call, ctx, count=(hp.get_platform("cpu"), _COLLECTIVES))


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error_on_every_rank(pool, case_id):
    check(_BY_ID[case_id], pool.run(_run_case, case_id), MoEError)


def test_mesh_errors_are_still_hp_dtensor_mesh_errors():
    assert issubclass(MoEMeshError, MeshError) and issubclass(MoEMeshError, MoEConfigError)


def _good_input_still_works():
    ctx = _ctx()
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2)
    parallelize_module(moe, ctx.mesh, {"experts": ExpertParallel(sync_free=True, rows_per_peer=8)})
    etp = ExpertTensorParallel().apply(_experts(), ctx.mesh2d)
    return moe(torch.randn(1, 3, 8)).shape[-1], etp.w1.to_local().shape[0]


def test_good_input_is_still_accepted(pool):
    assert pool.run(_good_input_still_works) == [(8, 2)] * 2
