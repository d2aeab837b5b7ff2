"""Bad input to hp_kernels' collectives (comm, mc2, symm_mem.empty) on 2 gloo ranks (issue 26).

Each row is (id, call, error class, regex): the call (the same on both ranks) must raise the
error class (a ``KernelsError``: ``KernelsTypeError`` for a wrong type, ``KernelsValueError``
for a bad value), with a message matching the regex (which names the argument), on both ranks
alike; afterwards the group still works (no rank was left waiting). Every row failed before its
fix: an AttributeError (``.device`` of a non-tensor), an untyped TypeError/ValueError from deep
inside, or a value silently accepted (a float split size or shape truncated, an out-of-range dim
wrapped by ``%``, a str flag counted as True). The last tests check that a bad argument on one
rank alone still stops both ranks, now with a typed error.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hp_kernels
from hp_kernels import (
    KernelsError,
    KernelsTypeError,
    KernelsValueError,
    comm,
    mc2,
    symm_mem,
)
from hp_testing.bad_input import Case, by_id, check, run_case, type_name
from hp_testing.pytest_plugin import rank_pool_fixture

pytestmark = pytest.mark.skipif(not hp_kernels.is_built(), reason="hp_kernels._C not built")

pool = rank_pool_fixture(2, timeout=120)


def _w():
    return torch.randn(8, 4)


T, V = KernelsTypeError, KernelsValueError
CASES = [
    # -- comm.all_gather_into_tensor -----------------------------------------------------------
    Case(  # AttributeError: 'list' object has no attribute 'device'
        "all_gather/output_list",
        lambda: comm.all_gather_into_tensor([0.0] * 8, torch.ones(4)),
        T,
        r"all_gather_into_tensor: output must be a torch\.Tensor, got list",
    ),
    Case(
        "all_gather/group_str",
        lambda: comm.all_gather_into_tensor(torch.empty(8), torch.ones(4), group="world"),
        T,
        r"all_gather_into_tensor: group='world' is a str",
    ),
    Case(
        "all_gather/dtype_mismatch",
        lambda: comm.all_gather_into_tensor(torch.empty(8, dtype=torch.float64), torch.ones(4)),
        T,
        r"output has dtype torch\.float64 but input has torch\.float32",
    ),
    Case(
        "all_gather/output_size",
        lambda: comm.all_gather_into_tensor(torch.empty(5), torch.ones(4)),
        V,
        r"output has 5 elements",
    ),
    # -- comm.all_to_all_single ------------------------------------------------------------------
    Case(  # float sizes were truncated by int()
        "all_to_all/split_float",
        lambda: comm.all_to_all_single(torch.empty(2), torch.ones(2), [1.5, 0.5], [1, 1]),
        T,
        r"output_split_sizes=\[1\.5, 0\.5\] holds 1\.5",
    ),
    Case(  # TypeError: 'int' object is not iterable
        "all_to_all/split_int",
        lambda: comm.all_to_all_single(torch.empty(2), torch.ones(2), None, 2),
        T,
        r"input_split_sizes=2 is a int: give a list of ints",
    ),
    Case(
        "all_to_all/split_str",  # ValueError from int('a')
        lambda: comm.all_to_all_single(torch.empty(2), torch.ones(2), "11", None),
        T,
        r"output_split_sizes='11' is a str",
    ),
    Case(
        "all_to_all/input_none",
        lambda: comm.all_to_all_single(torch.empty(2), None),
        T,
        r"all_to_all_single: input must be a torch\.Tensor, got NoneType",
    ),
    Case(
        "all_to_all/split_sum",
        lambda: comm.all_to_all_single(torch.empty(2), torch.ones(2), None, [1, 2]),
        V,
        r"input_split_sizes=\[1, 2\] sums to 3",
    ),
    # -- comm reductions ----------------------------------------------------------------------
    Case(  # TypeError: unhashable type: 'list'
        "all_reduce/op_list",
        lambda: comm.all_reduce(torch.ones(3), ["sum"]),
        T,
        r"all_reduce: op=\['sum'\] is a list",
    ),
    Case(
        "all_reduce/op_unknown",
        lambda: comm.all_reduce(torch.ones(3), "prod"),
        V,
        r"all_reduce: op='prod'",
    ),
    Case(  # said "applies to floating tensors only" for a float tensor
        "all_reduce/wire_str",
        lambda: comm.all_reduce(torch.ones(3), wire_dtype="bf16"),
        T,
        r"all_reduce: wire_dtype='bf16' must be a torch\.dtype",
    ),
    Case(
        "all_reduce/tensor_int",
        lambda: comm.all_reduce(3),
        T,
        r"all_reduce: tensor must be a torch\.Tensor, got int",
    ),
    Case(
        "all_reduce/group_int",
        lambda: comm.all_reduce(torch.ones(3), group=0),
        T,
        r"all_reduce: group=0 is a int",
    ),
    Case(
        "all_reduce/noncontiguous",
        lambda: comm.all_reduce(torch.ones(4, 4).t()),
        V,
        r"tensor must be contiguous",
    ),
    Case(
        "reduce_scatter/input_list",
        lambda: comm.reduce_scatter_tensor(torch.empty(2), [1.0] * 4),
        T,
        r"reduce_scatter_tensor: input must be a torch\.Tensor, got list",
    ),
    Case(
        "reduce_scatter/avg_int",
        lambda: comm.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.int64), torch.ones(4, dtype=torch.int64), "avg"
        ),
        T,
        r"op='avg' needs a floating dtype",
    ),
    # -- mc2.all_gather_matmul ----------------------------------------------------------------
    Case(  # AttributeError: 'list' object has no attribute 'device'
        "ag_matmul/x_list",
        lambda: mc2.all_gather_matmul([[1.0] * 8] * 3, [_w()]),
        T,
        r"all_gather_matmul: x_shard must be a torch\.Tensor, got list",
    ),
    Case(  # a lone tensor was iterated row by row: "weights[0] must be a 2-D tensor"
        "ag_matmul/weights_tensor",
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), _w()),
        T,
        r"all_gather_matmul: weights is a Tensor; .*\[w\]",
    ),
    Case(  # TypeError: 'NoneType' object is not iterable, on this rank only
        "ag_matmul/weights_none",
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), None),
        T,
        r"weights=None is a NoneType",
    ),
    Case(  # 2 % 2 == 0: silently gathered along dim 0
        "ag_matmul/gather_dim_out_of_range",
        lambda: mc2.all_gather_matmul(torch.randn(3, 4, 8), [_w()], gather_dim=3),
        V,
        r"gather_dim=3 is out of range for x_shard with 3 dims",
    ),
    Case(  # TypeError: not all arguments converted during string formatting
        "ag_matmul/gather_dim_str",
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), [_w()], gather_dim="0"),
        T,
        r"gather_dim='0' is a str",
    ),
    Case(  # a str counted as True
        "ag_matmul/return_gathered_str",
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), [_w()], return_gathered="no"),
        T,
        r"return_gathered='no' must be True or False",
    ),
    Case(  # IndexError on x.shape[-1]
        "ag_matmul/x_0dim",
        lambda: mc2.all_gather_matmul(torch.tensor(1.0), [_w()]),
        V,
        r"x_shard has shape \(\); it needs at least 2 dims",
    ),
    Case(
        "ag_matmul/group_str",
        lambda: mc2.all_gather_matmul(torch.randn(3, 8), [_w()], group="tp"),
        T,
        r"all_gather_matmul: group='tp' is a str",
    ),
    # -- mc2.matmul_reduce_scatter ------------------------------------------------------------
    Case(  # AttributeError: 'list' object has no attribute 'dim'
        "mm_rs/weight_list",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), [_w()]),
        T,
        r"matmul_reduce_scatter: weight must be a torch\.Tensor, got list",
    ),
    Case(  # AttributeError: 'NoneType' object has no attribute 'device'
        "mm_rs/x_none",
        lambda: mc2.matmul_reduce_scatter(None, _w()),
        T,
        r"matmul_reduce_scatter: x must be a torch\.Tensor, got NoneType",
    ),
    Case(  # TypeError: unhashable type: 'list' (outside the error path)
        "mm_rs/reduce_op_list",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), _w(), reduce_op=["sum"]),
        T,
        r"reduce_op=\['sum'\] is a list",
    ),
    Case(
        "mm_rs/reduce_op_max",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), _w(), reduce_op="max"),
        V,
        r"reduce_op='max'; choose 'sum' or 'avg'",
    ),
    Case(  # -3 % 2 == 1: silently scattered along the last dim
        "mm_rs/scatter_dim_out_of_range",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), _w(), scatter_dim=-3),
        V,
        r"scatter_dim=-3 is out of range for the product with 2 dims",
    ),
    Case(
        "mm_rs/scatter_dim_float",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), _w(), scatter_dim=0.0),
        T,
        r"scatter_dim=0\.0 is a float",
    ),
    Case(
        "mm_rs/group_str",
        lambda: mc2.matmul_reduce_scatter(torch.randn(4, 8), _w(), group="tp"),
        T,
        r"matmul_reduce_scatter: group='tp' is a str",
    ),
    # -- symm_mem.empty -----------------------------------------------------------------------
    Case(  # 2.5 truncated to 2
        "empty/shape_float",
        lambda: symm_mem.empty((2.5,), torch.float32),
        T,
        r"size=2\.5 is a float",
    ),
    Case(  # ValueError from int('a')
        "empty/shape_str",
        lambda: symm_mem.empty("16", torch.float32),
        T,
        r"shape='16' must be an int or a tuple of ints",
    ),
    Case(
        "empty/dtype_str",
        lambda: symm_mem.empty((4,), "float32"),
        T,
        r"dtype must be a torch\.dtype, got 'float32'",
    ),
    Case(  # ValueError: could not convert string to float
        "empty/timeout_str",
        lambda: symm_mem.empty((4,), torch.float32, timeout="60"),
        T,
        r"timeout='60' is a str",
    ),
    Case(  # every wait failed at once
        "empty/timeout_zero",
        lambda: symm_mem.empty((4,), torch.float32, timeout=0),
        V,
        r"timeout=0 must be > 0",
    ),
    Case(
        "empty/group_str",
        lambda: symm_mem.empty((4,), torch.float32, group="world"),
        T,
        r"symm_mem\.empty: group='world' is a str",
    ),
]
_BY_ID = by_id(CASES)


def _alive() -> list:
    y = torch.ones(2)
    comm.all_reduce(y)  # both ranks got here, and the group's workspace still works
    return y.tolist()


def _run_case(case_id: str) -> dict:
    torch.manual_seed(0)
    return run_case(_BY_ID[case_id].call, alive=_alive)


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error_on_every_rank(pool, case_id):
    check(_BY_ID[case_id], pool.run(_run_case, case_id), KernelsError, alive=[2.0, 2.0])


def _one_rank_bad(kind: str) -> dict:
    """Only rank 1 passes a bad argument: rank 0 must raise too (naming rank 1), not wait."""
    rank = dist.get_rank()
    w = torch.randn(8, 4)
    calls = {
        "all_gather_output_list": lambda: comm.all_gather_into_tensor(
            [0.0] if rank else torch.empty(8), torch.ones(4)
        ),
        "all_to_all_split_float": lambda: comm.all_to_all_single(
            torch.empty(2), torch.ones(2), [1, 1], [1.5, 0.5] if rank else [1, 1]
        ),
        "all_reduce_tensor_none": lambda: comm.all_reduce(None if rank else torch.ones(3)),
        "ag_matmul_weights_tensor": lambda: mc2.all_gather_matmul(
            torch.randn(3, 8), w if rank else [w]
        ),
        "mm_rs_reduce_op_list": lambda: mc2.matmul_reduce_scatter(
            torch.randn(4, 8), w, reduce_op=["sum"] if rank else "sum"
        ),
        "mm_rs_x_none": lambda: mc2.matmul_reduce_scatter(None if rank else torch.randn(4, 8), w),
    }
    return run_case(calls[kind], alive=_alive)


@pytest.mark.parametrize(
    "kind",
    [
        "all_gather_output_list",
        "all_to_all_split_float",
        "all_reduce_tensor_none",
        "ag_matmul_weights_tensor",
        "mm_rs_reduce_op_list",
        "mm_rs_x_none",
    ],
)
def test_one_bad_rank_stops_every_rank_with_a_typed_error(pool, kind):
    r0, r1 = pool.run(_one_rank_bad, kind)
    assert all(type_name(KernelsError) in r["types"] for r in (r0, r1)), (r0, r1)
    assert "rank(s) [1] passed invalid arguments" in r0["message"], r0
    assert r1["raised"] == type_name(KernelsTypeError), r1
    assert r0["alive"] == r1["alive"] == [2.0, 2.0]


def test_error_classes_keep_their_builtin_bases():
    assert issubclass(KernelsValueError, ValueError) and issubclass(KernelsTypeError, TypeError)
    assert issubclass(hp_kernels.HostSpanError, KernelsError)
    assert issubclass(hp_kernels.HostSpanError, ValueError)
    assert issubclass(hp_kernels.PeerError, KernelsError)
    assert issubclass(hp_kernels.PeerError, RuntimeError)
    assert hp_kernels.symm_mem.HostSpanError is hp_kernels.HostSpanError
