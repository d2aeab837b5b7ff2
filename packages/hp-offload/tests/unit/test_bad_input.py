"""Bad input to hp_offload's public functions (issue 26).

Each row is (id, call, error class, regex): the call must raise the error class (an
``OffloadError``; ``OffloadTypeError`` for a wrong type), with a message matching the regex
(which names the argument). Every check is local (no process group): it runs before the wrapped
forward. Every row failed before its fix: an AttributeError/TypeError from deep inside (often
only at the first forward or backward), an untyped ValueError for a wrong type, or a value
silently accepted (a str ``save`` iterated per character, ``save_every=True``, a falsy policy
replaced by the default, ``pin_memory="no"`` counting as True).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from hp_offload import (
    CheckpointPolicy,
    OffloadError,
    OffloadPlan,
    OffloadTypeError,
    SwapManager,
    SwapPolicy,
    apply_offload_plan,
    checkpoint,
    checkpoint_wrapper,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)


class Case(NamedTuple):
    id: str
    call: Any  # () -> anything; must raise
    error: type
    match: str  # regex searched in the message; names the argument


def _model():
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def _x():
    return torch.ones(1, 2, requires_grad=True)


def _region(mgr, **kw):
    with mgr.region(**kw):
        pass


T = OffloadTypeError
E = OffloadError
CASES = [
    # -- CheckpointPolicy -----------------------------------------------------------------
    Case(
        "CheckpointPolicy/save_str",  # was iterated per character: "op 'a': expected ..."
        lambda: CheckpointPolicy(mode="selective", save="aten.mm"),
        T,
        r"save='aten\.mm' is a str: give a tuple of op names, e\.g\. \('aten\.mm',\)",
    ),
    Case("CheckpointPolicy/save_none", lambda: CheckpointPolicy(save=None), T, r"save=None"),
    Case(
        "CheckpointPolicy/save_int_item",
        lambda: CheckpointPolicy(save=("aten.mm", 3)),
        T,
        r"save\[1\]=3 is a int",
    ),
    Case(
        "CheckpointPolicy/save_every_bool",
        lambda: CheckpointPolicy(save_every=True),
        T,
        r"save_every=True is a bool",
    ),
    Case(
        "CheckpointPolicy/save_every_float",
        lambda: CheckpointPolicy(save_every=2.0),
        T,
        r"save_every=2\.0 is a float: give an int >= 1",
    ),
    Case("CheckpointPolicy/every_str", lambda: CheckpointPolicy(every="2"), T, r"every='2'"),
    # -- checkpoint -----------------------------------------------------------------------
    Case(
        "checkpoint/fn_not_callable",
        lambda: checkpoint(3, _x()),
        T,
        r"checkpoint: fn=3 is a int, not callable",
    ),
    Case(
        "checkpoint/policy_str",
        lambda: checkpoint(torch.tanh, _x(), policy="selective"),
        T,
        r"policy='selective' is a str: pass a CheckpointPolicy",
    ),
    Case(
        "checkpoint/policy_false",  # was replaced by the default (full) silently
        lambda: checkpoint(torch.tanh, _x(), policy=False),
        T,
        r"policy=False is a bool",
    ),
    Case(
        "checkpoint/policy_class",
        lambda: checkpoint(torch.tanh, _x(), policy=CheckpointPolicy),
        T,
        r"policy=.* is the class CheckpointPolicy, not an instance",
    ),
    Case(
        "checkpoint/use_reentrant",
        lambda: checkpoint(torch.tanh, _x(), use_reentrant=True),
        T,
        r"use_reentrant= is set by hp_offload",
    ),
    # -- checkpoint_wrapper ---------------------------------------------------------------
    Case(
        "checkpoint_wrapper/module_class",
        lambda: checkpoint_wrapper(nn.Linear),
        T,
        r"module is the class Linear, not an instance: pass an nn\.Module",
    ),
    Case(
        "checkpoint_wrapper/function",
        lambda: checkpoint_wrapper(torch.tanh),
        T,
        r"module is a builtin_function_or_method",
    ),
    Case(
        "checkpoint_wrapper/policy_swap",
        lambda: checkpoint_wrapper(nn.Linear(2, 2), policy=SwapPolicy()),
        T,
        r"policy=SwapPolicy\(.*\) is a SwapPolicy: pass a CheckpointPolicy",
    ),
    # -- OffloadPlan ----------------------------------------------------------------------
    Case(
        "OffloadPlan/list",
        lambda: OffloadPlan([("layers.*", "swap")]),
        T,
        r"rules is a list: give a non-empty \{pattern: action\} mapping",
    ),
    Case("OffloadPlan/empty", lambda: OffloadPlan({}), E, r"rules is empty"),
    Case(
        "OffloadPlan/int_pattern",
        lambda: OffloadPlan({0: "swap"}),
        T,
        r"pattern 0 is a int: give a module name pattern string",
    ),
    Case(
        "OffloadPlan/empty_range",  # was only found at apply time
        lambda: OffloadPlan({"layers.3-1": "swap"}),
        E,
        r"pattern 'layers\.3-1': range 3-1 is empty",
    ),
    Case(
        "OffloadPlan/resolve_not_module",
        lambda: OffloadPlan({"0": "swap"}).resolve("model"),
        T,
        r"OffloadPlan\.resolve: model is a str",
    ),
    # -- apply_offload_plan ---------------------------------------------------------------
    Case(
        "apply_offload_plan/model_none",
        lambda: apply_offload_plan(None, OffloadPlan({"0": "swap"})),
        T,
        r"apply_offload_plan: model is a NoneType: pass an nn\.Module",
    ),
    Case(
        "apply_offload_plan/plan_dict",
        lambda: apply_offload_plan(_model(), {"0": "swap"}),
        T,
        r"plan is a dict: pass an OffloadPlan \(wrap the mapping: OffloadPlan\(\{\.\.\.\}\)\)",
    ),
    Case(
        "apply_offload_plan/manager_policy",  # was only found at the first forward
        lambda: apply_offload_plan(_model(), OffloadPlan({"0": "swap"}), manager=SwapPolicy()),
        T,
        r"manager=SwapPolicy\(.*\) is a SwapPolicy: pass a SwapManager",
    ),
    # -- SwapPolicy -----------------------------------------------------------------------
    Case("SwapPolicy/min_bytes_str", lambda: SwapPolicy(min_bytes="1k"), T, r"min_bytes='1k'"),
    Case(
        "SwapPolicy/fuse_below_neg",
        lambda: SwapPolicy(fuse_below=-1),
        E,
        r"fuse_below=-1 is out of range: give an int >= 0",
    ),
    Case("SwapPolicy/min_bytes_none", lambda: SwapPolicy(min_bytes=None), T, r"min_bytes=None"),
    # -- SwapManager ----------------------------------------------------------------------
    Case(
        "SwapManager/budget_str",
        lambda: SwapManager(budget_bytes="1GB"),
        T,
        r"budget_bytes='1GB' is a str: give an int >= 1 \(or None\)",
    ),
    Case("SwapManager/budget_zero", lambda: SwapManager(budget_bytes=0), E, r"budget_bytes=0"),
    Case(
        "SwapManager/inflight_float",
        lambda: SwapManager(max_inflight_bytes=1.5),
        T,
        r"max_inflight_bytes=1\.5",
    ),
    Case(
        "SwapManager/pin_memory_str",  # "no" counted as True
        lambda: SwapManager(pin_memory="no"),
        T,
        r"pin_memory='no' must be True or False \(or None\)",
    ),
    Case(
        "SwapManager/region_policy",
        lambda: _region(SwapManager(), policy=CheckpointPolicy()),
        T,
        r"SwapManager\.region: policy=.* is a CheckpointPolicy: pass a SwapPolicy",
    ),
    Case(
        "SwapManager/region_only_marked",
        lambda: _region(SwapManager(), only_marked="yes"),
        T,
        r"only_marked='yes'",
    ),
    Case(
        "SwapManager/mark_list",
        lambda: SwapManager().mark([1.0]),
        T,
        r"SwapManager\.mark: tensor is a list: pass a torch\.Tensor",
    ),
    # -- swap, swap_wrapper, swap_tensor_wrapper ------------------------------------------
    Case("swap/fn_none", lambda: swap(None, _x()), T, r"swap: fn=None is a NoneType"),
    Case(
        "swap/manager_str",
        lambda: swap(torch.tanh, _x(), manager="host"),
        T,
        r"swap: manager='host' is a str: pass a SwapManager",
    ),
    Case(
        "swap/policy_int",
        lambda: swap(torch.tanh, _x(), policy=1024),
        T,
        r"policy=1024 is a int: pass a SwapPolicy",
    ),
    Case(
        "swap_wrapper/module_class",
        lambda: swap_wrapper(nn.Linear),
        T,
        r"swap_wrapper: module is the class Linear, not an instance",
    ),
    Case(
        "swap_wrapper/manager_dict",  # was only found at the first forward
        lambda: swap_wrapper(nn.Linear(2, 2), manager={}),
        T,
        r"manager=\{\} is a dict: pass a SwapManager",
    ),
    Case(
        "swap_wrapper/policy_str",
        lambda: swap_wrapper(nn.Linear(2, 2), policy="swap"),
        T,
        r"policy='swap' is a str: pass a SwapPolicy",
    ),
    Case(
        "swap_tensor_wrapper/list",
        lambda: swap_tensor_wrapper([1.0]),
        T,
        r"swap_tensor_wrapper: tensor is a list: pass a torch\.Tensor",
    ),
    Case(
        "swap_tensor_wrapper/manager_str",
        lambda: swap_tensor_wrapper(torch.ones(2), manager="m"),
        T,
        r"manager='m' is a str: pass a SwapManager",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "duplicate case ids"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id):
    case = _BY_ID[case_id]
    with pytest.raises(case.error) as info:
        case.call()
    assert isinstance(info.value, OffloadError)
    assert re.search(case.match, str(info.value)), f"{str(info.value)!r} !~ {case.match!r}"


def test_type_errors_are_also_builtin_type_errors():
    with pytest.raises(TypeError):
        SwapManager(budget_bytes="1GB")
    with pytest.raises(ValueError):
        SwapManager(budget_bytes="1GB")


def test_good_input_still_accepted():
    # the forms the rest of the repo passes: defaults, None managers/policies, lists for save
    CheckpointPolicy(mode="selective", save=["aten.mm", "aten.addmm"], save_every=2, every=1)
    SwapManager(budget_bytes=1 << 20, pin_memory=False, max_inflight_bytes=None)
    SwapPolicy(min_bytes=0, fuse_below=0)
    x = _x()
    checkpoint(torch.tanh, x, policy=None).sum().backward()
    mgr = SwapManager(pin_memory=False)
    swap(torch.tanh, x, manager=None, policy=None).sum().backward()
    m = apply_offload_plan(_model(), OffloadPlan({"0": "swap", "1": "checkpoint"}), manager=mgr)
    m(x).sum().backward()
    mgr.step()
    assert swap_tensor_wrapper(x, manager=mgr) is x
