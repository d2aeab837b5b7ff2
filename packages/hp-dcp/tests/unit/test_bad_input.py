"""Bad input to hp_dcp's public functions (issue 26), in one process.

Each row is (id, call, error class, regex): the call must raise the error class (a
``StateDictError``; ``DCPTypeError`` for a wrong type), with a message matching the regex
(which names the argument). The checks are local and run first in ``save``/``async_save``
(before the all-gather of the plan) and ``load``, so under ``torch.distributed`` every rank
raises the same error. Every row failed before its fix: a TypeError/AttributeError from deep
inside (``Path(None)``, ``planner.plan``), or a value silently accepted (``allow_pickle="no"``
counted as True, which would unpickle untrusted data).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

import hp_dcp
from hp_dcp import (
    DCPTypeError,
    LoadPlanner,
    ModelState,
    OptimizerState,
    SavePlanner,
    StateDictError,
)


class Case(NamedTuple):
    id: str
    call: Any  # tmp_path -> anything; must raise
    error: type
    match: str  # regex searched in the message; names the argument


def _sd():
    return {"w": torch.ones(2)}


def _saved(tmp):
    hp_dcp.save(_sd(), checkpoint_id=tmp / "c")
    return tmp / "c"


def _opt():
    m = nn.Linear(2, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


T = DCPTypeError
CASES = [
    Case(
        "save/checkpoint_id_none",
        lambda t: hp_dcp.save(_sd(), checkpoint_id=None),
        T,
        r"save: checkpoint_id=None is a NoneType: give the checkpoint's path",
    ),
    Case(
        "save/checkpoint_id_int", lambda t: hp_dcp.save(_sd(), checkpoint_id=3), T, r"=3 is a int"
    ),
    Case(
        "save/planner_class",
        lambda t: hp_dcp.save(_sd(), checkpoint_id=t / "c", planner=SavePlanner),
        T,
        r"planner is the class SavePlanner, not an instance",
    ),
    Case(
        "save/planner_load_planner",
        lambda t: hp_dcp.save(_sd(), checkpoint_id=t / "c", planner=LoadPlanner()),
        T,
        r"save: planner is a LoadPlanner: give a SavePlanner\(\.\.\.\) instance",
    ),
    Case(
        "async_save/checkpoint_id_none",
        lambda t: hp_dcp.async_save(_sd(), checkpoint_id=None),
        T,
        r"async_save: checkpoint_id=None",
    ),
    Case(
        "load/checkpoint_id_none",
        lambda t: hp_dcp.load(_sd(), checkpoint_id=None),
        T,
        r"load: checkpoint_id=None",
    ),
    Case(
        "load/allow_pickle_str",  # "no" was truthy: pickled values were read
        lambda t: hp_dcp.load(_sd(), checkpoint_id=_saved(t), allow_pickle="no"),
        T,
        r"allow_pickle='no' must be True or False",
    ),
    Case(
        "load/planner_dict",
        lambda t: hp_dcp.load(_sd(), checkpoint_id=_saved(t), planner={"allow_partial_load": 1}),
        T,
        r"load: planner is a dict: give a LoadPlanner",
    ),
    Case(
        "LoadPlanner/allow_partial_load_str",
        lambda t: LoadPlanner(allow_partial_load="no"),
        T,
        r"allow_partial_load='no'",
    ),
    Case("ModelState/dict", lambda t: ModelState({"w": torch.ones(1)}), T, r"model is a dict"),
    Case(
        "OptimizerState/optimizer_str",
        lambda t: OptimizerState(nn.Linear(2, 2), "adamw"),
        T,
        r"OptimizerState: optimizer is a str, not an optimizer",
    ),
    Case(
        "OptimizerState/model_params",
        lambda t: OptimizerState(nn.Linear(2, 2).parameters(), _opt()[1]),
        T,
        r"model is a generator",
    ),
    Case(
        "get_optimizer_state_dict/args_swapped",
        lambda t: hp_dcp.get_optimizer_state_dict(_opt()[1], _opt()[0]),
        T,
        r"get_optimizer_state_dict: model is a SGD",
    ),
    Case(
        "set_optimizer_state_dict/not_a_dict",
        lambda t: hp_dcp.set_optimizer_state_dict(*_opt(), [1]),
        T,
        r"state_dict is a list",
    ),
    Case(
        "set_optimizer_state_dict/model_state_dict",  # a model's state dict by mistake
        lambda t: hp_dcp.set_optimizer_state_dict(*_opt(), nn.Linear(2, 2).state_dict()),
        T,
        r"state_dict is a OrderedDict without param_groups",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id, tmp_path):
    case = _BY_ID[case_id]
    with pytest.raises(Exception) as info:
        case.call(tmp_path)
    e = info.value
    assert isinstance(e, case.error) and isinstance(e, StateDictError), (
        f"{case_id}: raised {type(e).__module__}.{type(e).__qualname__}: {e}"
    )
    assert re.search(case.match, str(e)), f"{case_id}: {str(e)!r} !~ {case.match!r}"


def test_good_input_is_still_accepted(tmp_path):
    hp_dcp.save(_sd(), checkpoint_id=str(tmp_path / "c"), planner=SavePlanner())
    out = {"w": torch.zeros(2)}
    hp_dcp.load(out, checkpoint_id=tmp_path / "c", planner=LoadPlanner(), allow_pickle=False)
    assert out["w"].tolist() == [1.0, 1.0]
    model, opt = _opt()
    hp_dcp.set_optimizer_state_dict(model, opt, hp_dcp.get_optimizer_state_dict(model, opt))
    hp_dcp.async_save({"m": ModelState(model)}, checkpoint_id=tmp_path / "d").result()
