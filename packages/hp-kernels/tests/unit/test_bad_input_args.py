"""Bad input to hp_kernels.moe's public functions (issue 26); no process group needed.

Each row is (id, call, error class, regex): the call must raise the error class (a
``KernelsError``: ``KernelsTypeError`` for a wrong type, ``KernelsValueError`` for a bad value),
with a message matching the regex (which names the argument). Every row failed before its fix:
an AttributeError (``.dim``/``.reshape`` of a non-tensor), an untyped TypeError/RuntimeError
from torch, or a value silently accepted (float ids or a float ``num_tokens`` truncated, a str
flag counted as True). The collectives' rows run on 2 ranks in
``tests/distributed/test_bad_input.py``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch

from hp_kernels import KernelsError, KernelsTypeError, KernelsValueError
from hp_kernels.moe import (
    count_experts,
    expert_order,
    gather_rows,
    permute_tokens,
    swiglu,
    unpermute_tokens,
)


class Case(NamedTuple):
    id: str
    call: Any
    error: type
    match: str


def _ids():
    return torch.tensor([[0, 1], [1, 2], [2, 0]])


def _perm():
    return permute_tokens(torch.randn(3, 4), _ids(), 3)


T, V = KernelsTypeError, KernelsValueError
CASES = [
    Case("count/ids_list", lambda: count_experts([0, 1], 2), T, r"expert_ids must be a torch"),
    Case(  # float ids were truncated
        "count/ids_float",
        lambda: count_experts(torch.tensor([0.7, 1.2]), 2),
        T,
        r"count_experts: expert_ids must hold integer ids, got torch\.float32",
    ),
    Case("count/num_str", lambda: count_experts(_ids(), "3"), T, r"num_experts='3' is a str"),
    Case("count/num_zero", lambda: count_experts(_ids(), 0), V, r"num_experts=0 must be >= 1"),
    Case("order/ids_none", lambda: expert_order(None, 3), T, r"expert_ids must be a torch"),
    Case("order/num_str", lambda: expert_order(_ids(), "3"), T, r"num_experts='3' is a str"),
    Case("order/num_float", lambda: expert_order(_ids(), 3.0), T, r"num_experts=3\.0"),
    Case("order/num_neg", lambda: expert_order(_ids(), -1), V, r"num_experts=-1 must be"),
    Case(
        "order/check_str",
        lambda: expert_order(_ids(), 3, check="no"),
        T,
        r"check='no' must be True or False",
    ),
    Case(
        "order/keep_list",
        lambda: expert_order(_ids(), 3, keep=[[True] * 2] * 3),
        T,
        r"keep must be a torch\.Tensor or None, got list",
    ),
    Case(
        "permute/tokens_list",
        lambda: permute_tokens([[0.0] * 4] * 3, _ids(), 3),
        T,
        r"permute_tokens: tokens must be a torch\.Tensor, got list",
    ),
    Case(
        "permute/indices_list",
        lambda: permute_tokens(torch.randn(3, 4), [[0, 1]] * 3, 3),
        T,
        r"permute_tokens: expert_indices must be a torch\.Tensor",
    ),
    Case(
        "permute/num_bool",
        lambda: permute_tokens(torch.randn(3, 4), _ids(), True),
        T,
        r"num_experts=True is a bool",
    ),
    Case(
        "permute/ids_out_of_range",
        lambda: permute_tokens(torch.randn(3, 4), _ids(), 2),
        V,
        r"permute_tokens: expert ids must lie in \[0, num_experts=2\)",
    ),
    Case(
        "unpermute/permuted_none",
        lambda: unpermute_tokens(None, _perm().order),
        T,
        r"unpermute_tokens: permuted must be a torch\.Tensor, got NoneType",
    ),
    Case(
        "unpermute/probs_list",
        lambda: unpermute_tokens(_perm().tokens, _perm().order, [0.5] * 6),
        T,
        r"probs must be a torch\.Tensor or None, got list",
    ),
    Case(  # int(2.5) == 2
        "unpermute/num_tokens_float",
        lambda: unpermute_tokens(_perm().tokens, _perm().order, num_tokens=3.0),
        T,
        r"num_tokens=3\.0 is a float",
    ),
    Case(
        "unpermute/num_tokens_zero",
        lambda: unpermute_tokens(_perm().tokens, _perm().order, num_tokens=0),
        V,
        r"num_tokens=0 must be >= 1",
    ),
    Case(
        "gather_rows/src_list",
        lambda: gather_rows([1.0], torch.tensor([0]), torch.tensor([0])),
        T,
        r"gather_rows: src must be a torch\.Tensor, got list",
    ),
    Case(  # ZeroDivisionError / RuntimeError from torch.div
        "gather_rows/k_zero",
        lambda: gather_rows(torch.randn(2, 3), torch.tensor([1, 0]), torch.tensor([1, 0]), 0),
        V,
        r"gather_rows: k=0 must be >= 1",
    ),
    Case(
        "gather_rows/k_float",
        lambda: gather_rows(torch.randn(2, 3), torch.tensor([1, 0]), torch.tensor([1, 0]), 1.0),
        T,
        r"k=1\.0 is a float",
    ),
    Case(
        "swiglu/a_list",
        lambda: swiglu([[1.0]], torch.randn(1, 1)),
        T,
        r"swiglu: a must be a torch\.Tensor, got list",
    ),
    Case(
        "swiglu/row_weights_list",
        lambda: swiglu(torch.randn(2, 3), torch.randn(2, 3), [1.0, 1.0]),
        T,
        r"swiglu: row_weights must be a torch\.Tensor or None, got list",
    ),
    Case(
        "swiglu/shape",
        lambda: swiglu(torch.randn(2, 3), torch.randn(2, 4)),
        V,
        r"swiglu: a \(2, 3\) and b \(2, 4\)",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id):
    case = _BY_ID[case_id]
    with pytest.raises(case.error) as info:
        case.call()
    assert isinstance(info.value, KernelsError)
    assert re.search(case.match, str(info.value)), (str(info.value), case.match)


def test_good_input_is_still_accepted():
    perm = _perm()
    out = unpermute_tokens(perm.tokens, perm.order, torch.full((3, 2), 0.5), inverse=perm.inverse)
    assert out.shape == (3, 4)
    assert count_experts(torch.tensor([0, 2, 2], dtype=torch.int32), 3).tolist() == [1, 0, 2]
    assert unpermute_tokens(perm.tokens, perm.order, num_tokens=3).shape == (3, 4)
