"""Bad input to hp_optim's public functions (issue 26).

Each row is (id, call, error class, regex): the call must raise the error class (an
``OptimError``; ``OptimTypeError`` for a wrong type), with a message matching the regex (which
names the argument). None of these needs a process group: every check is local and runs before
the first collective (``clip_grad_norm_``'s all-reduce, ``orthogonalize``'s all-to-all). Every
row failed before its fix: a TypeError/AttributeError/KeyError from deep inside, torch's untyped
ValueError, or a value silently accepted (a str ``match`` iterated per character, a negative
step giving a negative LR).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from hp_optim import (
    AdamW,
    ChainedOptimizer,
    HyperLRScheduler,
    LRScheduleConfig,
    Muon,
    OptimError,
    OptimTypeError,
    clip_grad_norm_,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    lr_factor,
    orthogonalize,
    zeropower_via_newtonschulz5,
)


class Case(NamedTuple):
    id: str
    call: Any  # () -> anything; must raise
    error: type
    match: str  # regex searched in the message; names the argument


def _p(*shape):
    return nn.Parameter(torch.ones(*shape))


def _pg(*shape):
    p = _p(*shape)
    p.grad = torch.ones(*shape)
    return p


def _opt():
    return AdamW([_p(2)], lr=0.1)


def _sched():
    return get_hyper_lr_scheduler(_opt(), {"total_steps": 4})


T = OptimTypeError
E = OptimError
CASES = [
    # -- clip_grad_norm_ ------------------------------------------------------------------
    Case("clip/max_norm_str", lambda: clip_grad_norm_([_pg(2)], "1.0"), T, r"max_norm='1\.0'"),
    Case("clip/max_norm_none", lambda: clip_grad_norm_([_pg(2)], None), T, r"max_norm=None"),
    Case("clip/norm_type_str", lambda: clip_grad_norm_([_pg(2)], 1.0, "fro"), T, r"norm_type="),
    Case("clip/norm_type_zero", lambda: clip_grad_norm_([_pg(2)], 1.0, 0), E, r"norm_type=0"),
    Case("clip/norm_type_neg", lambda: clip_grad_norm_([_pg(2)], 1.0, -2.0), E, r"norm_type"),
    Case("clip/norm_type_nan", lambda: clip_grad_norm_([_pg(2)], 1.0, float("nan")), E, "nan"),
    Case(
        "clip/module",
        lambda: clip_grad_norm_(nn.Linear(2, 2), 1.0),
        T,
        r"parameters is a Linear module: pass model\.parameters\(\)",
    ),
    Case("clip/none", lambda: clip_grad_norm_(None, 1.0), T, r"parameters is a NoneType"),
    Case("clip/ints", lambda: clip_grad_norm_([1, 2], 1.0), T, r"parameters\[0\] is a int"),
    Case(
        "clip/foreach_str",
        lambda: clip_grad_norm_([_pg(2)], 1.0, foreach="yes"),
        T,
        r"foreach='yes'",
    ),
    Case(
        "clip/error_if_nonfinite_str",
        lambda: clip_grad_norm_([_pg(2)], 1.0, error_if_nonfinite="no"),
        T,
        r"error_if_nonfinite='no'",
    ),
    # -- AdamW ----------------------------------------------------------------------------
    Case("AdamW/module", lambda: AdamW(nn.Linear(2, 2)), T, r"params is a Linear module"),
    Case("AdamW/tensor", lambda: AdamW(_p(2)), T, r"params is a single Tensor"),
    Case("AdamW/lr_str", lambda: AdamW([_p(2)], lr="1e-3"), T, r"lr='1e-3'"),
    Case("AdamW/lr_negative", lambda: AdamW([_p(2)], lr=-1.0), E, r"lr=-1\.0 is out of range"),
    Case("AdamW/lr_nan", lambda: AdamW([_p(2)], lr=float("nan")), E, r"lr=nan must be finite"),
    Case("AdamW/betas_float", lambda: AdamW([_p(2)], betas=0.9), T, r"betas=0\.9: give a pair"),
    Case("AdamW/betas_three", lambda: AdamW([_p(2)], betas=(0.9, 0.9, 0.9)), T, r"betas="),
    Case("AdamW/beta2_one", lambda: AdamW([_p(2)], betas=(0.9, 1.0)), E, r"betas\[1\]=1\.0"),
    Case("AdamW/eps_negative", lambda: AdamW([_p(2)], eps=-1e-8), E, r"eps=-1e-08"),
    Case("AdamW/wd_str", lambda: AdamW([_p(2)], weight_decay="0.1"), T, r"weight_decay='0\.1'"),
    Case("AdamW/amsgrad_str", lambda: AdamW([_p(2)], amsgrad="no"), T, r"amsgrad='no'"),
    # -- Muon, orthogonalize, zeropower ---------------------------------------------------
    Case("Muon/module", lambda: Muon(nn.Linear(2, 2)), T, r"params is a Linear module"),
    Case("Muon/lr_str", lambda: Muon([_p(2, 2)], lr="0.02"), T, r"lr='0\.02'"),
    Case("Muon/lr_negative", lambda: Muon([_p(2, 2)], lr=-0.02), E, r"lr=-0\.02"),
    Case("Muon/momentum_one", lambda: Muon([_p(2, 2)], momentum=1.0), E, r"momentum=1\.0"),
    Case("Muon/momentum_str", lambda: Muon([_p(2, 2)], momentum="0.9"), T, r"momentum='0\.9'"),
    Case("Muon/nesterov_str", lambda: Muon([_p(2, 2)], nesterov="no"), T, r"nesterov='no'"),
    Case("Muon/ns_steps_float", lambda: Muon([_p(2, 2)], ns_steps=5.0), T, r"ns_steps=5\.0"),
    Case("Muon/ns_steps_negative", lambda: Muon([_p(2, 2)], ns_steps=-1), E, r"ns_steps=-1"),
    Case("Muon/wd_negative", lambda: Muon([_p(2, 2)], weight_decay=-0.1), E, r"weight_decay"),
    Case(
        "zeropower/1d",
        lambda: zeropower_via_newtonschulz5(torch.ones(3)),
        E,
        r"g has shape \(3,\) \(1-D\): give a 2-D matrix",
    ),
    Case("zeropower/list", lambda: zeropower_via_newtonschulz5([[1.0]]), T, r"g is a list"),
    Case(
        "zeropower/int_dtype",
        lambda: zeropower_via_newtonschulz5(torch.ones(2, 2, dtype=torch.int64)),
        E,
        r"g has dtype torch\.int64",
    ),
    Case(
        "zeropower/steps_str",
        lambda: zeropower_via_newtonschulz5(torch.ones(2, 2), "5"),
        T,
        r"steps='5'",
    ),
    Case(
        "orthogonalize/3d",
        lambda: orthogonalize([torch.ones(2, 2), torch.ones(2, 2, 2)]),
        E,
        r"updates\[1\] has shape \(2, 2, 2\)",
    ),
    Case(
        "orthogonalize/tensor", lambda: orthogonalize(torch.ones(2, 2)), T, r"updates is a Tensor"
    ),
    Case("orthogonalize/steps_neg", lambda: orthogonalize([torch.ones(2, 2)], -1), E, r"steps=-1"),
    Case(
        "orthogonalize/naive_str",
        lambda: orthogonalize([torch.ones(2, 2)], naive="no"),
        T,
        r"naive='no'",
    ),
    # -- ChainedOptimizer -----------------------------------------------------------------
    Case(
        "Chained/one_optimizer",
        lambda: ChainedOptimizer(_opt()),
        T,
        r"optimizers is a single AdamW: give a list",
    ),
    Case("Chained/none", lambda: ChainedOptimizer(None), T, r"optimizers is a NoneType"),
    Case(
        "Chained/not_an_optimizer",
        lambda: ChainedOptimizer([_opt(), nn.Linear(2, 2)]),
        T,
        r"optimizers\[1\] is a Linear, not an optimizer",
    ),
    Case(
        "Chained/load_state_dict_plain",
        lambda: ChainedOptimizer([_opt()]).load_state_dict(_opt().state_dict()),
        T,
        r"state is a dict without it: give the dict \{'optimizers'",
    ),
    # -- get_hyper_optimizer --------------------------------------------------------------
    Case(
        "get_hyper_optimizer/model_params",
        lambda: get_hyper_optimizer(nn.Linear(2, 2).parameters(), {}),
        T,
        r"model is a generator: give a torch\.nn\.Module",
    ),
    Case(
        "get_hyper_optimizer/config_none",
        lambda: get_hyper_optimizer(nn.Linear(2, 2), None),
        T,
        r"config is a NoneType",
    ),
    Case(
        "get_hyper_optimizer/groups_dict",
        lambda: get_hyper_optimizer(nn.Linear(2, 2), {"groups": {"ndim": 1}}),
        T,
        r"config\['groups'\] is a dict: give a list",
    ),
    Case(
        "get_hyper_optimizer/group_str",
        lambda: get_hyper_optimizer(nn.Linear(2, 2), {"groups": ["bias"]}),
        T,
        r"config\['groups'\]\[0\] is a str",
    ),
    Case(
        "get_hyper_optimizer/match_str",  # was iterated per character: "*" matched everything
        lambda: get_hyper_optimizer(nn.Linear(2, 2), {"groups": [{"match": "w*", "lr": 1.0}]}),
        T,
        r"\['match'\]='w\*': give a list of fnmatch patterns, e\.g\. \['w\*'\]",
    ),
    Case(
        "get_hyper_optimizer/ndim_str",  # p.ndim == "1" never matched
        lambda: get_hyper_optimizer(nn.Linear(2, 2), {"groups": [{"ndim": "1"}]}),
        T,
        r"\['ndim'\]='1'",
    ),
    Case(
        "get_hyper_optimizer/lr_str",
        lambda: get_hyper_optimizer(nn.Linear(2, 2), {"lr": "3e-4"}),
        T,
        r"config\['lr'\]='3e-4'",
    ),
    # -- schedules ------------------------------------------------------------------------
    Case(
        "get_hyper_lr_scheduler/config_none",
        lambda: get_hyper_lr_scheduler(_opt(), None),
        T,
        r"scheduler config is a NoneType",
    ),
    Case(
        "get_hyper_lr_scheduler/optimizer_module",
        lambda: get_hyper_lr_scheduler(nn.Linear(2, 2), {"total_steps": 4}),
        T,
        r"optimizer is a Linear, not an optimizer",
    ),
    Case(
        "HyperLRScheduler/cfg_dict",
        lambda: HyperLRScheduler(_opt(), {"total_steps": 4}),
        T,
        r"cfg is a dict: give an LRScheduleConfig",
    ),
    Case(
        "HyperLRScheduler/load_state_dict_empty",
        lambda: _sched().load_state_dict({}),
        T,
        r"state is a dict without last_step",
    ),
    Case(
        "HyperLRScheduler/load_state_dict_str",
        lambda: _sched().load_state_dict({"last_step": "x"}),
        T,
        r"state\['last_step'\]='x'",
    ),
    Case(
        "LRScheduleConfig/total_steps_str",
        lambda: LRScheduleConfig(total_steps="100"),
        T,
        r"total_steps='100'",
    ),
    Case(
        "LRScheduleConfig/warmup_float",
        lambda: LRScheduleConfig(warmup_steps=2.5, total_steps=10),
        T,
        r"warmup_steps=2\.5",
    ),
    Case(
        "LRScheduleConfig/decay_steps_negative",  # the WSD decay silently never started
        lambda: LRScheduleConfig(total_steps=10, decay_style="wsd", decay_steps=-2),
        E,
        r"decay_steps=-2",
    ),
    Case(
        "LRScheduleConfig/min_lr_ratio_str",
        lambda: LRScheduleConfig(total_steps=10, min_lr_ratio="0.1"),
        T,
        r"min_lr_ratio='0\.1'",
    ),
    Case(
        "lr_factor/cfg_dict",
        lambda: lr_factor(0, {"total_steps": 4}),
        T,
        r"cfg is a dict: give an LRScheduleConfig",
    ),
    Case(
        "lr_factor/step_negative",  # gave a negative LR during warmup
        lambda: lr_factor(-5, LRScheduleConfig(warmup_steps=2, total_steps=4)),
        E,
        r"step=-5",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id):
    case = _BY_ID[case_id]
    with pytest.raises(Exception) as info:
        case.call()
    e = info.value
    assert isinstance(e, case.error) and isinstance(e, OptimError), (
        f"{case_id}: raised {type(e).__module__}.{type(e).__qualname__}: {e}"
    )
    assert re.search(case.match, str(e)), f"{case_id}: {str(e)!r} !~ {case.match!r}"


def test_good_input_is_still_accepted():
    p = _pg(2, 2)
    assert clip_grad_norm_(iter([p]), float("inf")).item() == 2.0  # an iterator; inf max_norm
    assert clip_grad_norm_(p, 1, norm_type=1).item() == 4.0  # ints; a lone tensor
    AdamW([p], lr=1, betas=[0.9, 0.95], weight_decay=0)
    Muon([{"params": [p], "lr": 0.01}], ns_steps=0)
    opt = get_hyper_optimizer(nn.Linear(2, 2), {"groups": [{"match": ("b*",), "ndim": 1}]})
    sched = get_hyper_lr_scheduler(opt, LRScheduleConfig(total_steps=4, min_lr_ratio=1))
    sched.load_state_dict({"last_step": torch.tensor(2)})
    assert sched.last_step == 2
    assert zeropower_via_newtonschulz5(torch.eye(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
