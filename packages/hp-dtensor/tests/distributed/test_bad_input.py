"""Bad input to hp_dtensor's public functions (issue 26), on 2 gloo ranks.

Each row is (id, call, error class, regex): the call must raise the error class (a subclass of
hp_dtensor's own errors), with a message matching the regex (which names the argument), on both
ranks alike and, unless the row says otherwise, before any collective. Every row failed before
its fix: an AttributeError/TypeError from deep inside, an untyped error, a silently accepted
value, or an error on one rank only.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh as init_torch_mesh

import hp_dtensor as hp
from hp_dtensor import (
    BackendError,
    DTensor,
    HPDTensorError,
    HPDTensorTypeError,
    Layout,
    MeshError,
    PlacementError,
    Replicate,
    Shard,
    ShardingError,
)
from hp_dtensor._backend import COMMUNICATING_METHODS
from hp_dtensor.parallel import (
    ColwiseParallel,
    ContextParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceParallel,
    context_parallel_attention,
    context_parallel_loss,
    context_parallel_shard,
    parallelize_module,
)
from hp_testing.bad_input import Case, by_id, check, run_case
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=60)


def _q():
    return torch.randn(1, 2, 4, 8)


def _uneven(ctx):
    """Pieces of 1 and 3 rows: they tile 4 rows, but not as torch.chunk splits 4 over 2."""
    return torch.ones(1 if ctx.rank == 0 else 3, 4)


def _kernel(a):
    return a


T = HPDTensorTypeError
CASES = [
    # -- DTensor.from_local -----------------------------------------------------------------
    Case(
        "from_local/run_check_shape",
        lambda c: DTensor.from_local(
            torch.ones(2, 4), c.mesh, [Shard(0)], shape=(5, 4), run_check=True
        ),
        ShardingError,
        r"shape=\(5, 4\) does not match .* tile \(4, 4\)",
        collectives=True,
    ),
    Case(
        "from_local/run_check_not_chunked",
        lambda c: DTensor.from_local(_uneven(c), c.mesh, [Shard(0)], run_check=True),
        ShardingError,
        r"local_tensor .* torch\.chunk",
        collectives=True,
    ),
    Case(
        "from_local/stride_length",
        lambda c: DTensor.from_local(torch.ones(2, 4), c.mesh, [Shard(0)], stride=(1,)),
        PlacementError,
        r"stride=\(1,\)",
    ),
    Case(
        "from_local/stride_length_run_check",
        lambda c: DTensor.from_local(
            torch.ones(2, 4), c.mesh, [Shard(0)], shape=(4, 4), stride=(1,), run_check=True
        ),
        PlacementError,
        r"stride=\(1,\)",
    ),
    Case(
        "from_local/mesh_str",
        lambda c: DTensor.from_local(torch.ones(2), "dp", [Shard(0)]),
        T,
        r"device_mesh='dp' .*DeviceMesh",
    ),
    Case(
        "from_local/placements_int",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, 0),
        T,
        r"placements=0",
    ),
    Case(
        "from_local/placements_str",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, "S0"),
        T,
        r"placements='S0'",
    ),
    Case(
        "from_local/shape_negative",
        lambda c: DTensor.from_local(torch.ones(2, 4), c.mesh, [Shard(0)], shape=(-1, 4)),
        PlacementError,
        r"shape\[0\]=-1",
    ),
    Case(
        "from_local/shape_str",
        lambda c: DTensor.from_local(torch.ones(2, 4), c.mesh, [Shard(0)], shape="ab"),
        T,
        r"shape='ab'",
    ),
    Case(
        "from_local/shape_int",
        lambda c: DTensor.from_local(torch.ones(2, 4), c.mesh, [Shard(0)], shape=4),
        T,
        r"shape=4",
    ),
    Case(
        "from_torch/plain_tensor",
        lambda c: DTensor.from_torch(torch.ones(2)),
        T,
        r"\bt is a Tensor",
    ),
    # -- distribute_tensor ----------------------------------------------------------------
    Case(
        "distribute_tensor/list",
        lambda c: hp.distribute_tensor([1, 2, 3], c.mesh, [Shard(0)]),
        T,
        r"tensor is a list",
    ),
    Case(
        "distribute_tensor/ndarray",
        lambda c: hp.distribute_tensor(np.ones(4), c.mesh, [Shard(0)]),
        T,
        r"tensor is a ndarray",
    ),
    Case(
        "distribute_tensor/mesh_str",
        lambda c: hp.distribute_tensor(torch.ones(4), "dp", [Shard(0)]),
        T,
        r"device_mesh='dp'",
    ),
    Case(
        "distribute_tensor/mesh_none",
        lambda c: hp.distribute_tensor(torch.ones(4), None, [Shard(0)]),
        T,
        r"device_mesh=None",
    ),
    Case(
        "distribute_tensor/torch_mesh",
        lambda c: hp.distribute_tensor(torch.ones(4), c.torch_mesh, [Shard(0)]),
        T,
        r"device_mesh=.* is a torch\.distributed\.device_mesh\.DeviceMesh, not an hp_dtensor",
    ),
    Case(
        "distribute_tensor/placements_int",
        lambda c: hp.distribute_tensor(torch.ones(4), c.mesh, 1),
        T,
        r"placements=1",
    ),
    Case(
        "distribute_tensor/src_data_rank_str",
        lambda c: hp.distribute_tensor(torch.ones(4), c.mesh, [Shard(0)], src_data_rank="0"),
        T,
        r"src_data_rank='0'",
    ),
    Case(
        "distribute_tensor/src_data_rank_out_of_range",
        lambda c: hp.distribute_tensor(torch.ones(4), c.mesh, [Shard(0)], src_data_rank=5),
        MeshError,
        r"src_data_rank=5 .*\[0, 2\)",
    ),
    # -- DTensor methods --------------------------------------------------------------------
    Case(
        "redistribute/mesh_str",
        lambda c: c.x.redistribute("dp", [Replicate()]),
        T,
        r"device_mesh='dp'",
    ),
    Case(
        "redistribute/placements_str",
        lambda c: c.x.redistribute(c.mesh, "R"),
        T,
        r"placements='R'",
    ),
    Case(
        "redistribute/async_op_str",
        lambda c: c.x.redistribute(c.mesh, [Replicate()], async_op="no"),
        T,
        r"async_op='no'",
    ),
    Case(
        "to_local/grad_placements_str",
        lambda c: c.x.to_local(grad_placements="R"),
        T,
        r"grad_placements='R'",
    ),
    # -- meshes -------------------------------------------------------------------------------
    Case(
        "init_device_mesh/shape_int",
        lambda c: hp.init_device_mesh("cpu", 2),
        T,
        r"mesh_shape=2",
    ),
    Case(
        "init_device_mesh/shape_bool",
        lambda c: hp.init_device_mesh("cpu", (True, 2)),
        MeshError,
        r"mesh_shape=\(True, 2\)",
    ),
    Case(
        "init_device_mesh/device_type_int",
        lambda c: hp.init_device_mesh(0, (2,)),
        T,
        r"device_type=0",
    ),
    Case(
        "init_device_mesh/names_str",
        lambda c: hp.init_device_mesh("cpu", (2,), mesh_dim_names="dp"),
        T,
        r"mesh_dim_names='dp' is a str",
    ),
    Case(
        "init_device_mesh/names_int",
        lambda c: hp.init_device_mesh("cpu", (2,), mesh_dim_names=(1,)),
        T,
        r"mesh_dim_names=\(1,\)",
    ),
    Case(
        "DeviceMesh/rank_outside_world",  # raised on rank 1 too, which is not in the mesh
        lambda c: hp.DeviceMesh("cpu", [0, 5]),
        MeshError,
        r"mesh ranks \[5\] .*world size 2",
    ),
    Case(
        "DeviceMesh/ranks_str",
        lambda c: hp.DeviceMesh("cpu", ["a", "b"]),
        T,
        r"mesh=\['a', 'b'\] holds 'a'",
    ),
    Case(
        "DeviceMesh/ranks_float",
        lambda c: hp.DeviceMesh("cpu", [0.5, 1]),
        T,
        r"mesh=\[0\.5, 1\] holds 0\.5",
    ),
    Case("DeviceMesh/empty", lambda c: hp.DeviceMesh("cpu", []), MeshError, r"mesh=\[\]"),
    Case(
        "DeviceMesh/names_str",
        lambda c: hp.DeviceMesh("cpu", [0, 1], mesh_dim_names="d"),
        T,
        r"mesh_dim_names='d' is a str",
    ),
    Case("DeviceMesh/getitem_int", lambda c: c.mesh2[0], T, r"mesh\[0\]: .*by name"),
    Case("DeviceMesh/flatten_int", lambda c: c.mesh2.flatten(3), T, r"mesh_dim_name=3"),
    Case("mesh_from_layout/str", lambda c: hp.mesh_from_layout("x"), T, r"layout='x'"),
    # -- parallelize_module and the styles -------------------------------------------------
    Case(
        "parallelize_module/module_none",
        lambda c: parallelize_module(None, c.mesh, {"a": ColwiseParallel()}),
        T,
        r"module is a NoneType",
    ),
    Case(
        "parallelize_module/mesh_str",
        lambda c: parallelize_module(nn.Linear(4, 4), "tp", ColwiseParallel()),
        T,
        r"device_mesh='tp'",
    ),
    Case(
        "parallelize_module/key_int",
        lambda c: parallelize_module(
            nn.Sequential(nn.Linear(4, 4)), c.mesh, {0: ColwiseParallel()}
        ),
        T,
        r"parallelize_plan key 0",
    ),
    Case(
        "parallelize_module/plan_list",
        lambda c: parallelize_module(nn.Linear(4, 4), c.mesh, [ColwiseParallel()]),
        T,
        r"parallelize_plan must be",
    ),
    Case(
        "parallelize_module/style_class",
        lambda c: parallelize_module(nn.Linear(4, 4), c.mesh, ColwiseParallel),
        T,
        r"parallelize_plan .*instantiate",
    ),
    Case(
        "parallelize_module/colwise_on_conv",
        lambda c: parallelize_module(nn.Conv1d(4, 4, 1), c.mesh, ColwiseParallel()),
        T,
        r"ColwiseParallel applies to nn\.Linear .*Conv1d",
    ),
    Case(
        "ColwiseParallel/use_local_output_str",
        lambda c: ColwiseParallel(use_local_output="no"),
        T,
        r"use_local_output='no'",
    ),
    Case(
        "ColwiseParallel/input_layouts_str",
        lambda c: ColwiseParallel(input_layouts="R"),
        PlacementError,
        r"input_layouts='R'",
    ),
    Case(
        "SequenceParallel/sequence_dim_str",
        lambda c: SequenceParallel(sequence_dim="1"),
        T,
        r"sequence_dim='1'",
    ),
    Case(
        "PrepareModuleInput/input_layouts_str",
        lambda c: PrepareModuleInput(input_layouts="R"),
        PlacementError,
        r"input_layouts='R'",
    ),
    Case(
        "PrepareModuleInput/input_layouts_entry",
        lambda c: PrepareModuleInput(input_layouts=[1], desired_input_layouts=[Replicate()]),
        PlacementError,
        r"input_layouts\[0\]=1",
    ),
    Case(
        "PrepareModuleInput/kwarg_layouts_list",
        lambda c: PrepareModuleInput(input_kwarg_layouts=[1]),
        T,
        r"input_kwarg_layouts=\[1\]",
    ),
    Case(
        "PrepareModuleOutput/output_layouts_entry",
        lambda c: PrepareModuleOutput(output_layouts=[1], desired_output_layouts=[Replicate()]),
        PlacementError,
        r"output_layouts\[0\]=1",
    ),
    Case(
        "PrepareModuleInputOutput/use_local_input_str",
        lambda c: PrepareModuleInputOutput(use_local_input="x"),
        T,
        r"use_local_input='x'",
    ),
    Case(
        "ContextParallel/load_balance_str",
        lambda c: ContextParallel(load_balance="no"),
        T,
        r"load_balance='no'",
    ),
    # -- distribute_module ------------------------------------------------------------------
    Case(
        "distribute_module/module_none",
        lambda c: hp.distribute_module(None, c.mesh),
        T,
        r"module is a NoneType",
    ),
    Case(
        "distribute_module/mesh_str",
        lambda c: hp.distribute_module(nn.Linear(2, 2), "dp"),
        T,
        r"device_mesh='dp'",
    ),
    Case(
        "distribute_module/partition_fn_int",
        lambda c: hp.distribute_module(nn.Linear(2, 2), c.mesh, partition_fn=1),
        T,
        r"partition_fn=1",
    ),
    Case(
        "distribute_module/input_fn_int",
        lambda c: hp.distribute_module(nn.Linear(2, 2), c.mesh, input_fn=1),
        T,
        r"input_fn=1",
    ),
    Case(
        "distribute_module/output_fn_str",
        lambda c: hp.distribute_module(nn.Linear(2, 2), c.mesh, output_fn="x"),
        T,
        r"output_fn='x'",
    ),
    # -- shard API ----------------------------------------------------------------------------
    Case(
        "shard_module/module_none",
        lambda c: hp.shard_module(None, {}),
        T,
        r"module is a NoneType",
    ),
    Case(
        "shard_module/parameter_list",
        lambda c: hp.shard_module(nn.Linear(2, 2), {"parameter": [1]}),
        T,
        r"sharding_plan\['parameter'\]=\[1\]",
    ),
    Case(
        "shard_module/forward_input_str",
        lambda c: hp.shard_module(nn.Linear(2, 2), {"forward": {"input": "x"}}),
        T,
        r"sharding_plan\['forward'\]\['input'\]='x'",
    ),
    Case(
        "custom_shard/fn_int",
        lambda c: hp.custom_shard(1, in_layouts=(), out_layouts=()),
        T,
        r"fn=1",
    ),
    Case(
        "custom_shard/in_layouts_str",
        lambda c: hp.custom_shard(_kernel, in_layouts="x", out_layouts=()),
        T,
        r"in_layouts='x'",
    ),
    # -- context parallelism ------------------------------------------------------------
    Case(
        "context_parallel_shard/x_list",
        lambda c: context_parallel_shard([1, 2], c.mesh, 0),
        T,
        r"\bx is a list",
    ),
    Case(
        "context_parallel_shard/seq_dim_str",
        lambda c: context_parallel_shard(torch.randn(2, 8), c.mesh, "1"),
        T,
        r"seq_dim='1'",
    ),
    Case(
        "context_parallel_attention/q_list",
        lambda c: context_parallel_attention([1], _q(), _q(), c.mesh),
        T,
        r"\bq is a list",
    ),
    Case(
        "context_parallel_loss/loss_list",
        lambda c: context_parallel_loss([1.0], 3, c.mesh),
        T,
        r"loss_sum is a list",
    ),
    Case(
        "context_parallel_loss/count_str",
        lambda c: context_parallel_loss(torch.tensor(1.0), "3", c.mesh),
        T,
        r"count='3'",
    ),
    # -- everything else ------------------------------------------------------------------
    Case(
        "manual_seed/mesh_str",
        lambda c: hp.manual_seed(1, "dp"),
        T,
        r"device_mesh='dp'",
    ),
    Case(
        "plan_redistribute/dst_entry",
        lambda c: hp.plan_redistribute((2,), [Shard(0)], ["R"], (4,)),
        PlacementError,
        r"dst\[0\]='R'",
    ),
    Case(
        "local_shape_and_offset/placement_str",
        lambda c: hp.local_shape_and_offset((4,), (2,), (0,), ["S"]),
        PlacementError,
        r"placements holds 'S'",
    ),
    Case(
        "chunk_size_and_offset/zero_chunks",
        lambda c: hp.chunk_size_and_offset(4, 0, 0),
        PlacementError,
        r"num_chunks=0",
    ),
    Case(
        "chunk_size_and_offset/index_out_of_range",
        lambda c: hp.chunk_size_and_offset(4, 2, 5),
        PlacementError,
        r"index=5",
    ),
    Case("new_group/ranks_str", lambda c: hp.new_group("a"), T, r"ranks='a'"),
    Case(
        "split_group/split_ranks_str",
        lambda c: hp.split_group(None, "ab"),
        T,
        r"split_ranks='ab'",
    ),
    Case(
        "init_process_group/timeout_str",
        lambda c: hp.init_process_group(timeout="x"),
        T,
        r"timeout='x'",
    ),
    Case("init_parameters/module_int", lambda c: hp.init_parameters(1), T, r"module is a int"),
    Case(
        "rotary_position_embedding/q_list",
        lambda c: hp.rotary_position_embedding([1], [1], [1], [1]),
        T,
        r"\bq is a list",
    ),
    Case(
        "rotary_position_embedding/cos_shape",
        lambda c: hp.rotary_position_embedding(
            torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(3, 8), torch.randn(3, 8)
        ),
        ShardingError,
        r"\bq \(1, 4, 2, 8\) does not fit cos/sin \(3, 8\)",
    ),
    Case("Layout/mesh_shape_int", lambda c: Layout(2, ("a",)), T, r"mesh_shape=2"),
    Case("Layout/alias_names_str", lambda c: Layout((2,), "tp"), T, r"alias_names='tp'"),
    Case("Layout/bind_int", lambda c: Layout((2,), ("tp",))(0), T, r"tensor dim 0 is 0"),
    Case(
        "Layout/rank_list_str",
        lambda c: Layout((2,), ("tp",), rank_list="ab"),
        T,
        r"rank_list='ab'",
    ),
    Case(
        "Layout.from_placements/placement_str",
        lambda c: Layout.from_placements((2,), ("tp",), ["S"], 2),
        PlacementError,
        r"placements\[0\]='S'",
    ),
    Case(
        "register_sharding_rule/names_int",
        lambda c: hp.register_sharding_rule(1, _kernel),
        T,
        r"names=1",
    ),
    Case(
        "register_sharding_rule/rule_int",
        lambda c: hp.register_sharding_rule("hp_test_bad_input_op", 1),
        T,
        r"rule=1",
    ),
    Case(
        "register_platform/name_int",
        lambda c: hp.register_platform(1, "x:Y"),
        T,
        r"name=1",
    ),
    Case(
        "register_platform/target_no_colon",
        lambda c: hp.register_platform("hp_test_bad_input", "nocolon"),
        BackendError,
        r"target='nocolon'",
    ),
]
_BY_ID = by_id(CASES)

_COLLECTIVES = COMMUNICATING_METHODS  # a row must raise before any of them


@functools.cache
def _ctx():
    mesh = hp.init_device_mesh("cpu", (2,))
    return types.SimpleNamespace(
        rank=dist.get_rank(),
        mesh=mesh,
        mesh2=hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")),
        x=hp.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)]),
        torch_mesh=init_torch_mesh("cpu", (2,)),
    )


def _run_case(case_id: str) -> dict:
    """On each rank: run the call, counting collectives; then check the group is still alive."""
    return run_case(_BY_ID[case_id].call, _ctx(), count=(hp.get_platform("cpu"), _COLLECTIVES))


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error_on_every_rank(pool, case_id):
    check(_BY_ID[case_id], pool.run(_run_case, case_id), HPDTensorError)


def _src_data_rank():
    mesh = hp.init_device_mesh("cpu", (2,))
    full = torch.full((4,), float(dist.get_rank()))
    x = hp.distribute_tensor(full, mesh, [Replicate()], src_data_rank=1)
    y = hp.distribute_tensor(full, mesh, [Shard(0)], src_data_rank=0)
    return x.to_local().tolist(), y.full_tensor().tolist()


def test_src_data_rank_takes_the_values_of_that_index(pool):
    # src_data_rank=1 used to be taken as 0: every rank got rank 0's values
    for x, y in pool.run(_src_data_rank):
        assert x == [1.0] * 4
        assert y == [0.0] * 4


def _from_local_run_check_still_accepts_good_input():
    mesh = hp.init_device_mesh("cpu", (2,))
    rows = 3 if dist.get_rank() == 0 else 2  # torch.chunk of 5 over 2
    d = DTensor.from_local(torch.ones(rows, 4), mesh, [Shard(0)], shape=(5, 4), run_check=True)
    e = DTensor.from_local(torch.ones(rows, 4), mesh, [Shard(0)], run_check=True)
    return tuple(d.shape), tuple(e.shape), math.isclose(d.full_tensor().sum().item(), 20.0)


def test_from_local_run_check_accepts_chunked_pieces(pool):
    assert pool.run(_from_local_run_check_still_accepts_good_input) == [((5, 4), (5, 4), True)] * 2
