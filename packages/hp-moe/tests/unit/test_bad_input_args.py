"""Bad input to hp_moe's public functions that needs no process group (issue 26).

Each row is (id, call, error class, regex): the call must raise the error class (an
``MoEError``; ``MoETypeError`` for a wrong type), with a message matching the regex (which
names the argument). Mesh and style rows are in ``tests/distributed/test_bad_input.py``. Every
row failed before its fix: a TypeError/AttributeError/RuntimeError from deep inside (torch's
``nn.Linear``, ``F.linear``, ``cumsum``), an untyped error, or a value silently accepted (a
str flag counted as True, NaN coefficients, a one-element expert bias broadcast to all).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

import hp_moe
from hp_moe import (
    DispatchError,
    FeedForward,
    GroupedExperts,
    LocalDispatcher,
    MoE,
    MoEAuxLossAutoScaler,
    MoEConfigError,
    MoEError,
    MoETypeError,
    TokenChoiceTopKRouter,
    grouped_mm,
)


class Case(NamedTuple):
    id: str
    call: Any  # () -> anything; must raise
    error: type
    match: str  # regex searched in the message; names the argument


def _moe(**kw):
    return MoE(8, 16, 4, 2, **kw)


def _router():
    return TokenChoiceTopKRouter(8, 4, 2)


def _dispatch(**kw):
    d = LocalDispatcher(4)
    x = torch.randn(3, 8)
    scores, idx = torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    args = {"x": x, "top_scores": scores, "top_indices": idx}
    args.update(kw)
    keep = args.pop("keep", None)
    return d.dispatch(args["x"], args["top_scores"], args["top_indices"], keep=keep)


T = MoETypeError
C = MoEConfigError
CASES = [
    # -- MoE ------------------------------------------------------------------------------
    Case("MoE/dim_str", lambda: MoE("8", 16, 4, 2), T, r"dim='8'"),
    Case("MoE/hidden_dim_float", lambda: MoE(8, 16.0, 4, 2), T, r"hidden_dim=16\.0"),
    Case("MoE/num_experts_str", lambda: MoE(8, 16, "4", 2), T, r"num_experts='4'"),
    Case("MoE/route_norm_str", lambda: _moe(route_norm="no"), T, r"route_norm='no'"),
    Case(
        "MoE/shared_expert_gate_str",
        lambda: _moe(num_shared_experts=1, shared_expert_gate="no"),
        T,
        r"shared_expert_gate='no'",
    ),
    Case("MoE/route_scale_nan", lambda: _moe(route_scale=float("nan")), C, r"route_scale=nan"),
    Case(
        "MoE/aux_loss_coeff_nan",
        lambda: _moe(aux_loss_coeff=float("nan")),
        C,
        r"aux_loss_coeff=nan must be a number >= 0 \(finite\)",
    ),
    Case(
        "MoE/load_balance_coeff_inf",
        lambda: _moe(load_balance_coeff=float("inf")),
        C,
        r"load_balance_coeff=inf",
    ),
    Case(
        "MoE/capacity_factor_nan",
        lambda: _moe(capacity_factor=float("nan")),
        C,
        r"capacity_factor=nan .*None: dropless",
    ),
    Case(
        "MoE/num_shared_experts_str",
        lambda: _moe(num_shared_experts="1"),
        T,
        r"num_shared_experts='1'",
    ),
    Case(
        "MoE/forward_wrong_width",
        lambda: _moe()(torch.randn(2, 3, 6)),
        DispatchError,
        r"x has shape \(2, 3, 6\); this layer takes \(batch, seq, dim=8\)",
    ),
    Case("MoE/forward_list", lambda: _moe()([[1.0] * 8]), T, r"MoE: x is a list"),
    # -- TokenChoiceTopKRouter ------------------------------------------------------------
    Case("Router/dim_str", lambda: TokenChoiceTopKRouter("8", 4, 2), T, r"dim='8'"),
    Case("Router/dim_zero", lambda: TokenChoiceTopKRouter(0, 4, 2), C, r"dim=0 must be a positive"),
    Case(
        "Router/route_norm_str",
        lambda: TokenChoiceTopKRouter(8, 4, 2, route_norm="false"),
        T,
        r"route_norm='false'",
    ),
    Case(
        "Router/forward_wrong_width",
        lambda: _router()(torch.randn(3, 6)),
        C,
        r"x has shape \(3, 6\); the gate takes \(T, dim=8\)",
    ),
    Case("Router/forward_3d", lambda: _router()(torch.randn(1, 3, 8)), C, r"x has shape"),
    Case(
        "Router/expert_bias_broadcast",  # a (1,) bias was broadcast over every expert
        lambda: _router()(torch.randn(3, 8), torch.zeros(1)),
        C,
        r"expert_bias has shape \(1,\): give one bias per expert, shape \(4,\)",
    ),
    Case(
        "Router/expert_bias_list",
        lambda: _router()(torch.randn(3, 8), [0.0] * 4),
        T,
        r"expert_bias is a list",
    ),
    # -- experts --------------------------------------------------------------------------
    Case("FeedForward/bias_str", lambda: FeedForward(8, 16, bias="no"), T, r"bias='no'"),
    Case("FeedForward/dim_str", lambda: FeedForward("8", 16), T, r"dim='8'"),
    Case("GroupedExperts/num_experts_float", lambda: GroupedExperts(8, 16, 4.0), T, r"=4\.0"),
    Case(
        "GroupedExperts/counts_list",
        lambda: GroupedExperts(8, 16, 2)(torch.randn(3, 8), [1, 2]),
        T,
        r"num_tokens_per_expert is a list",
    ),
    Case(
        "GroupedExperts/x_wrong_width",
        lambda: GroupedExperts(8, 16, 2)(torch.randn(3, 6), torch.tensor([1, 2])),
        C,
        r"x has shape \(3, 6\); the experts take \(rows, dim=8\)",
    ),
    Case(
        "GroupedExperts/counts_float",
        lambda: GroupedExperts(8, 16, 2)(torch.randn(3, 8), torch.tensor([1.0, 2.0])),
        C,
        r"num_tokens_per_expert has dtype torch\.float32",
    ),
    Case(
        "GroupedExperts/row_weights_shape",
        lambda: GroupedExperts(8, 16, 2)(
            torch.randn(3, 8), torch.tensor([1, 2]), row_weights=torch.ones(2)
        ),
        C,
        r"row_weights has shape \(2,\): give one weight per row of x, shape \(3,\)",
    ),
    Case(
        "grouped_mm/x_1d",
        lambda: grouped_mm(torch.randn(8), torch.randn(2, 4, 8), torch.tensor([1, 1])),
        C,
        r"x has shape \(8,\): give a 2-D tensor",
    ),
    Case(
        "grouped_mm/width_mismatch",
        lambda: grouped_mm(torch.randn(3, 6), torch.randn(2, 4, 8), torch.tensor([1, 3])),
        C,
        r"grouped_mm: x \(3, 6\), w \(2, 4, 8\)",
    ),
    Case(
        "grouped_mm/offsets_list",
        lambda: grouped_mm(torch.randn(3, 8), torch.randn(2, 4, 8), [1, 3]),
        T,
        r"offsets is a list",
    ),
    # -- dispatchers ----------------------------------------------------------------------
    Case("LocalDispatcher/str", lambda: LocalDispatcher("4"), T, r"num_experts='4'"),
    Case("LocalDispatcher/zero", lambda: LocalDispatcher(0), C, r"num_experts=0"),
    Case("LocalDispatcher/float", lambda: LocalDispatcher(2.5), T, r"num_experts=2\.5"),
    Case("dispatch/x_list", lambda: _dispatch(x=[[0.0] * 8] * 3), T, r"dispatch: x is a list"),
    Case(
        "dispatch/top_indices_float",
        lambda: _dispatch(top_indices=torch.zeros(3, 2)),
        DispatchError,
        r"top_indices has dtype torch\.float32: give integer expert ids",
    ),
    Case(
        "dispatch/keep_int",
        lambda: _dispatch(keep=torch.ones(3, 2, dtype=torch.int64)),
        DispatchError,
        r"keep has dtype torch\.int64: give a bool mask",
    ),
    Case(
        "dispatch/gates_to_experts_str",
        lambda: LocalDispatcher(4).dispatch(
            torch.randn(1, 8), torch.rand(1, 2), torch.tensor([[0, 1]]), gates_to_experts="no"
        ),
        T,
        r"gates_to_experts='no'",
    ),
    Case(
        "combine/ctx_tuple",
        lambda: LocalDispatcher(4).combine(torch.randn(6, 8), _dispatch()),
        T,
        r"combine: ctx is a tuple: give the DispatchContext",
    ),
    # -- balance --------------------------------------------------------------------------
    Case(
        "set_aux_loss_scale/nan",
        lambda: hp_moe.set_aux_loss_scale(_moe(), float("nan")),
        C,
        r"scale=nan",
    ),
    Case(
        "set_aux_loss_scale/model_str",
        lambda: hp_moe.set_aux_loss_scale("model", 0.5),
        T,
        r"set_aux_loss_scale: model is a str",
    ),
    Case(
        "update_expert_bias/model_list",
        lambda: hp_moe.update_expert_bias([_moe()]),
        T,
        r"update_expert_bias: model is a list",
    ),
    Case(
        "reset_statistics/none",
        lambda: hp_moe.reset_statistics(None),
        T,
        r"reset_statistics: model is a NoneType",
    ),
    Case(
        "moe_statistics/model_params",
        lambda: hp_moe.moe_statistics(_moe().parameters()),
        T,
        r"moe_statistics: model is a generator",
    ),
    Case(
        "set_load_balance_group/model_str",
        lambda: hp_moe.set_load_balance_group("model"),
        T,
        r"set_load_balance_group: model is a str",
    ),
    Case(
        "register_expert_bias_update/optimizer_module",  # the group was set before it failed
        lambda: hp_moe.register_expert_bias_update(nn.Linear(2, 2), _moe()),
        T,
        r"optimizer is a Linear: give a torch\.optim\.Optimizer",
    ),
    Case(
        "MoEAuxLossAutoScaler/aux_float",
        lambda: MoEAuxLossAutoScaler.apply(torch.ones(2, requires_grad=True), 0.5, 1.0),
        T,
        r"aux_loss is a float",
    ),
    Case(
        "MoEAuxLossAutoScaler/coeff_str",
        lambda: MoEAuxLossAutoScaler.apply(torch.ones(2), torch.tensor(0.5), "0.1"),
        T,
        r"coeff='0\.1'",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id):
    case = _BY_ID[case_id]
    torch.manual_seed(0)
    with pytest.raises(Exception) as info:
        case.call()
    e = info.value
    assert isinstance(e, case.error) and isinstance(e, MoEError), (
        f"{case_id}: raised {type(e).__module__}.{type(e).__qualname__}: {e}"
    )
    assert re.search(case.match, str(e)), f"{case_id}: {str(e)!r} !~ {case.match!r}"


def test_good_input_is_still_accepted():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, load_balance_coeff=0, aux_loss_coeff=0, capacity_factor=1)
    assert moe(torch.randn(5, 8)).shape == (5, 8)  # (seq, dim) too
    router = TokenChoiceTopKRouter(8, 4, 2, route_scale=2)
    router(torch.randn(3, 8), torch.zeros(4))
    tokens, counts, ctx = LocalDispatcher(4).dispatch(
        torch.randn(3, 8),
        torch.rand(3, 2),
        torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32),
        keep=torch.ones(3, 2, dtype=torch.bool),
    )
    experts = GroupedExperts(8, 16, 4)
    assert experts(tokens, counts.to(torch.int32)).shape == (6, 8)
    hp_moe.set_aux_loss_scale(moe, 1)
    hp_moe.update_expert_bias(nn.ModuleList([moe]))
