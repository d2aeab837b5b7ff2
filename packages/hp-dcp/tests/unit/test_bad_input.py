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
E = StateDictError
# -- the offline tools: convert, export_hf, import_hf, save_hf, consolidate, reshard, verify,
# inspect, parse_placements. Before: Path(None)'s TypeError, an AttributeError (``.items`` of a
# list, ``.replace`` of a list), a plain ValueError/TypeError/re.error (not an hp_dcp error), or
# a str flag taken as True (``allow_pickle="no"`` unpickling).
CASES += [
    Case(
        "convert/src_none",
        lambda t: hp_dcp.convert(None, t / "o", to="hf"),
        T,
        r"convert: src=None is a NoneType: give a path",
    ),
    Case(
        "convert/to_unknown",
        lambda t: hp_dcp.convert(_saved(t), t / "o", to="safetensors"),
        E,
        r"convert: to='safetensors': use 'hf' or 'dcp'",
    ),
    Case(
        "convert/dcp_with_hf_kwargs",
        lambda t: hp_dcp.convert(_saved(t), t / "o", to="dcp", dtype=torch.bfloat16),
        T,
        r"convert\(to='dcp'\) takes no \['dtype'\]: those are export_hf's",
    ),
    Case(
        "convert/allow_pickle_str",
        lambda t: hp_dcp.convert(_saved(t), t / "o", to="dcp", allow_pickle="no"),
        T,
        r"convert: allow_pickle='no' must be True or False",
    ),
    Case(
        "export_hf/max_shard_bytes_str",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", max_shard_bytes="5GB"),
        T,
        r"export_hf: max_shard_bytes='5GB' is a str",
    ),
    Case(
        "export_hf/max_shard_bytes_zero",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", max_shard_bytes=0),
        E,
        r"max_shard_bytes=0: give a finite number of bytes >= 1",
    ),
    Case(
        "export_hf/dtype_unknown_name",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", dtype="bf16"),
        E,
        r"dtype='bf16' names no torch dtype",
    ),
    Case(
        "export_hf/dtype_type",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", dtype=torch.float16.itemsize),
        T,
        r"dtype=2 is a int: give a torch\.dtype",
    ),
    Case(
        "export_hf/name_map_list",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", name_map=[("w", "v")]),
        T,
        r"export_hf: name_map is a list: give a dict of regex -> new name",
    ),
    Case(
        "export_hf/name_map_bad_regex",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", name_map={"(w": "v"}),
        E,
        r"name_map pattern '\(w' is not a regular expression",
    ),
    Case(
        "export_hf/name_map_int_value",
        lambda t: hp_dcp.export_hf(_saved(t), t / "o", name_map={"w": 1}),
        T,
        r"name_map\['w'\]=1: 1 is a int",
    ),
    Case(
        "save_hf/module",
        lambda t: hp_dcp.save_hf(nn.Linear(2, 2), t / "o"),
        T,
        r"save_hf: state_dict is a Linear: .*\(pass model\.state_dict\(\)\)",
    ),
    Case("save_hf/dst_none", lambda t: hp_dcp.save_hf(_sd(), None), T, r"save_hf: dst=None"),
    Case(
        "save_hf/progress_str",
        lambda t: hp_dcp.save_hf(_sd(), t / "o", progress="yes"),
        T,
        r"progress='yes' must be True or False",
    ),
    Case("import_hf/src_int", lambda t: hp_dcp.import_hf(3, t / "o"), T, r"import_hf: src=3"),
    Case(
        "consolidate/out_none",  # failed after reading the checkpoint
        lambda t: hp_dcp.consolidate(_saved(t), None),
        T,
        r"consolidate: out=None is a NoneType",
    ),
    Case("inspect/src_none", lambda t: hp_dcp.inspect(None), T, r"inspect: src=None"),
    Case("verify/src_list", lambda t: hp_dcp.verify([_saved(t)]), T, r"verify: src=\[.*is a list"),
    Case(
        "verify/allow_pickle_str",  # "no" was True: pickled values were unpickled
        lambda t: hp_dcp.verify(_saved(t), allow_pickle="no"),
        T,
        r"verify: allow_pickle='no' must be True or False",
    ),
    Case(
        "reshard/mesh_shape_int",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape=2),
        T,
        r"reshard: mesh_shape=2 is a int: give a tuple of positive ints",
    ),
    Case(
        "reshard/mesh_shape_str",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape="2,2"),
        T,
        r"mesh_shape='2,2' is a str",
    ),
    Case(
        "reshard/mesh_shape_zero",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape=(2, 0)),
        E,
        r"mesh_shape\[1\]=0: give a positive int",
    ),
    Case(
        "reshard/placements_list",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape=(2,), placements=["S(0)"]),
        T,
        r"placements=\['S\(0\)'\] is a list: write a str",
    ),
    Case(
        "reshard/placements_vs_mesh",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape=(2, 2), placements="S(0)"),
        E,
        r"do not match mesh_shape=\(2, 2\): give one placement per mesh dimension \(2\)",
    ),
    Case(
        "reshard/rules_list",
        lambda t: hp_dcp.reshard(_saved(t), t / "o", mesh_shape=(2,), rules=["*=R"]),
        T,
        r"reshard: rules is a list: give a dict of fnmatch pattern -> placements",
    ),
    Case(
        "parse_placements/int",
        lambda t: hp_dcp.parse_placements(0),
        T,
        r"placements=0 is a int: write a str",
    ),
    Case(
        "parse_placements/bad",
        lambda t: hp_dcp.parse_placements("S0"),
        E,
        r"placements 'S0': write one per mesh dimension",
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
    # the offline tools, as the CLI and hp_trainer call them (a str dtype worked before too)
    hf = hp_dcp.export_hf(tmp_path / "c", tmp_path / "hf", max_shard_bytes=5e9, dtype="bfloat16")
    assert hf["metadata"]["total_size"] == 4
    hp_dcp.save_hf(_sd(), tmp_path / "hf2", name_map={"w": "v"}, max_shard_bytes=1 << 20)
    hp_dcp.reshard(tmp_path / "c", tmp_path / "r", mesh_shape=[2], placements="S(0)", rules={})
    hp_dcp.reshard(tmp_path / "c", tmp_path / "r2", mesh_shape=torch.Size([2]), placements=None)
    assert hp_dcp.verify(tmp_path / "r", progress=False) == []
    assert "w" in hp_dcp.inspect(str(tmp_path / "r"))
