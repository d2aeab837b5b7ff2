"""Bad input to hp_pipeline's public functions that needs no process group (issue 26).

Each row is (id, call, error class, regex): the call must raise the error class (a
``PipelineError``/``ScheduleError``; ``PipelineTypeError``/``ScheduleTypeError`` for a wrong
type), with a message matching the regex (which names the argument). Every row failed before
its fix: an AttributeError/TypeError/KeyError/IndexError/ZeroDivisionError from deep inside
(often only at the first ``step``), an untyped ValueError for a wrong type, or a value silently
accepted (``num_stages=True`` taken as 1, ``direct_weight_grads="no"`` as True, a tensor given
as ``args`` iterated row by row, duplicate stages dropped). Checks that involve a process group
are in ``tests/distributed/test_bad_input.py``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from hp_pipeline import (
    BatchDimSpec,
    PipelineError,
    PipelineStage,
    PipelineTypeError,
    Schedule1F1B,
    ScheduleError,
    ScheduleGPipe,
    ScheduleTypeError,
    build_schedule,
    split_microbatches,
)


class Case(NamedTuple):
    id: str
    call: Any  # () -> anything; must raise
    error: type
    match: str  # regex searched in the message; names the argument


def _stage(**kw):
    return PipelineStage(nn.Linear(2, 2), 0, 1, device="cpu", **kw)


def _loss(out, target):
    return out.sum()


def _gpipe(**kw):
    return ScheduleGPipe(_stage(), 2, _loss, **kw)


def _ran():
    st = _stage()
    st.forward_one_chunk(0, (torch.ones(1, 2),))
    return st


T, E = PipelineTypeError, PipelineError
ST, SE = ScheduleTypeError, ScheduleError
CASES = [
    # -- PipelineStage --------------------------------------------------------------------
    Case(
        "PipelineStage/module_class",
        lambda: PipelineStage(nn.Linear, 0, 1),
        T,
        r"module is the class Linear, not an instance",
    ),
    Case(
        "PipelineStage/num_stages_bool",  # was taken as 1
        lambda: PipelineStage(nn.Linear(2, 2), 0, True),
        T,
        r"num_stages=True is a bool",
    ),
    Case(
        "PipelineStage/stage_index_float",
        lambda: PipelineStage(nn.Linear(2, 2), 1.0, 2),
        T,
        r"stage_index=1\.0 is a float: give an int >= 0",
    ),
    Case(
        "PipelineStage/stage_index_bool",  # was taken as 0
        lambda: PipelineStage(nn.Linear(2, 2), False, 2),
        T,
        r"stage_index=False is a bool",
    ),
    Case(
        "PipelineStage/stage_index_range",
        lambda: PipelineStage(nn.Linear(2, 2), 2, 2),
        E,
        r"stage_index must be in \[0, 2\) for num_stages=2, got 2",
    ),
    Case(
        "PipelineStage/device_bad",
        lambda: PipelineStage(nn.Linear(2, 2), 0, 1, device="gpu"),
        E,
        r"device='gpu' is not a device",
    ),
    Case(
        "PipelineStage/device_list",
        lambda: PipelineStage(nn.Linear(2, 2), 0, 1, device=["cpu"]),
        T,
        r"device=\['cpu'\] is a list",
    ),
    Case(
        "PipelineStage/direct_weight_grads_str",  # "no" was True
        lambda: _stage(direct_weight_grads="no"),
        T,
        r"direct_weight_grads='no' must be True or False",
    ),
    Case("PipelineStage/cuda_graphs_int", lambda: _stage(cuda_graphs=1), T, r"cuda_graphs=1"),
    Case(
        "PipelineStage/activation_hooks_obj",
        lambda: _stage(activation_hooks=3),
        T,
        r"activation_hooks=3 is a int",
    ),
    Case(
        "forward_one_chunk/args_tensor",  # a tensor was iterated row by row
        lambda: _stage().forward_one_chunk(0, torch.ones(2, 2)),
        T,
        r"forward_one_chunk: args is a Tensor: give a tuple of inputs, e\.g\. \(x,\)",
    ),
    Case(
        "forward_one_chunk/mb_str",
        lambda: _stage().forward_one_chunk("0", (torch.ones(1, 2),)),
        T,
        r"mb='0' is a str",
    ),
    Case(
        "forward_one_chunk/kwargs_list",
        lambda: _stage().forward_one_chunk(0, (torch.ones(1, 2),), []),
        T,
        r"kwargs is a list",
    ),
    Case(
        "outputs/unknown_mb",  # KeyError: 1
        lambda: _ran().outputs(1),
        E,
        r"PipelineStage\.outputs: mb=1 has no forward on stage 0 .*\[0\]",
    ),
    Case(
        "set_loss/unknown_mb",
        lambda: _ran().set_loss(3, torch.ones(())),
        E,
        r"set_loss: mb=3 has no forward",
    ),
    Case(
        "set_loss/float",  # was stored, failing in backward
        lambda: _ran().set_loss(0, 1.0),
        T,
        r"set_loss: loss is a float",
    ),
    Case(
        "backward_full/unknown_mb",
        lambda: _ran().backward_full(5),
        E,
        r"backward_full: mb=5 has no forward",
    ),
    Case(
        "backward_input/unknown_mb",
        lambda: _ran().backward_input(5),
        E,
        r"backward_input: mb=5 has no forward",
    ),
    # -- schedules ------------------------------------------------------------------------
    Case(
        "ScheduleGPipe/stages_none",
        lambda: ScheduleGPipe(None, 2, _loss),
        T,
        r"ScheduleGPipe: stages is a NoneType",
    ),
    Case(
        "ScheduleGPipe/stages_module",
        lambda: ScheduleGPipe([nn.Linear(2, 2)], 2, _loss),
        T,
        r"stages\[0\] is a Linear, not a PipelineStage",
    ),
    Case("Schedule1F1B/stages_empty", lambda: Schedule1F1B([], 2, _loss), E, r"stages is empty"),
    Case(
        "Schedule1F1B/duplicate_stage",  # the duplicate was dropped silently
        lambda: Schedule1F1B([_stage(), _stage()], 2, _loss),
        E,
        r"stage_index \[0, 0\]: each stage index may appear once",
    ),
    Case(
        "ScheduleGPipe/n_microbatches_bool",
        lambda: ScheduleGPipe(_stage(), True, _loss),
        T,
        r"n_microbatches=True is a bool",
    ),
    Case(
        "ScheduleGPipe/n_microbatches_float",
        lambda: ScheduleGPipe(_stage(), 4.0, _loss),
        T,
        r"n_microbatches=4\.0 is a float",
    ),
    Case(
        "ScheduleGPipe/loss_fn_str",  # was found at the first step
        lambda: ScheduleGPipe(_stage(), 2, "mse"),
        T,
        r"loss_fn='mse' is a str, not callable",
    ),
    Case("ScheduleGPipe/scale_grads_str", lambda: _gpipe(scale_grads="no"), T, r"scale_grads='no'"),
    Case("ScheduleGPipe/overlap_p2p_int", lambda: _gpipe(overlap_p2p=1), T, r"overlap_p2p=1"),
    Case(
        "ScheduleGPipe/record_timeline_str",
        lambda: _gpipe(record_timeline="yes"),
        T,
        r"record_timeline='yes'",
    ),
    Case(
        "ScheduleGPipe/batch_spec_int",  # was found at the first step
        lambda: _gpipe(batch_spec=1),
        T,
        r"batch_spec=1 is a int: give a BatchDimSpec",
    ),
    Case(
        "step/losses_dict",  # was found after the whole step ran
        lambda: _gpipe().step(torch.ones(2, 2), target=torch.ones(2, 2), losses={}),
        T,
        r"ScheduleGPipe\.step: losses is a dict: give a list",
    ),
    Case(
        "step/batch_dim_out_of_range",  # IndexError
        lambda: _gpipe(batch_spec=BatchDimSpec(args=3)).step(
            torch.ones(2, 2), target=torch.ones(2, 2)
        ),
        E,
        r"input 0 has shape \(2, 2\): batch dim 3 is out of range",
    ),
    # -- BatchDimSpec, split_microbatches -------------------------------------------------
    Case("BatchDimSpec/args_str", lambda: BatchDimSpec(args="0"), T, r"args='0' is a str"),
    Case(
        "BatchDimSpec/args_list",
        lambda: BatchDimSpec(args=[0, None]),
        T,
        r"args=\[0, None\] is a list: .* e\.g\. \(0, None\)",
    ),
    Case(
        "BatchDimSpec/args_item_float",
        lambda: BatchDimSpec(args=(0, 1.0)),
        T,
        r"args\[1\]=1\.0 is a float",
    ),
    Case(
        "BatchDimSpec/kwargs_list", lambda: BatchDimSpec(kwargs=["mask"]), T, r"kwargs=\['mask'\]"
    ),
    Case(
        "BatchDimSpec/kwargs_value_str",
        lambda: BatchDimSpec(kwargs={"mask": "0"}),
        T,
        r"kwargs\['mask'\]='0' is a str",
    ),
    Case("BatchDimSpec/target_dim_none", lambda: BatchDimSpec(target_dim=None), T, r"target_dim"),
    Case(
        "split_microbatches/n_zero",  # ZeroDivisionError
        lambda: split_microbatches((torch.ones(4),), {}, 0),
        E,
        r"split_microbatches: n=0 is out of range: give an int >= 1",
    ),
    Case(
        "split_microbatches/args_tensor",
        lambda: split_microbatches(torch.ones(4, 2), {}, 2),
        T,
        r"args is a Tensor: give a tuple of inputs",
    ),
    Case(
        "split_microbatches/kwargs_none",
        lambda: split_microbatches((torch.ones(4),), None, 2),
        T,
        r"kwargs is a NoneType: give a dict",
    ),
    Case(
        "split_microbatches/spec_dict",
        lambda: split_microbatches((torch.ones(4),), {}, 2, {"args": 0}),
        T,
        r"batch_spec=\{'args': 0\} is a dict",
    ),
    Case(
        "split_microbatches/scalar_tensor",
        lambda: split_microbatches((torch.tensor(1.0),), {}, 2),
        E,
        r"input 0 has shape \(\): batch dim 0 is out of range",
    ),
    # -- build_schedule -------------------------------------------------------------------
    Case(
        "build_schedule/name_int",
        lambda: build_schedule(1, 2, 4),
        ST,
        r"build_schedule: name=1 is a int: give one of \[",
    ),
    Case("build_schedule/pp_bool", lambda: build_schedule("1f1b", True, 4), ST, r"pp .*=True"),
    Case(
        "build_schedule/m_float",
        lambda: build_schedule("gpipe", 2, 4.0),
        ST,
        r"n_microbatches=4\.0 is a float",
    ),
    Case(
        "build_schedule/stages_per_rank_zero",
        lambda: build_schedule("interleaved_1f1b", 2, 4, stages_per_rank=0),
        SE,
        r"stages_per_rank=0 is out of range: give an int >= 1",
    ),
    Case(
        "build_schedule/stages_per_rank_str",
        lambda: build_schedule("interleaved_1f1b", 2, 4, stages_per_rank="2"),
        ST,
        r"stages_per_rank='2' is a str",
    ),
    Case(
        "build_schedule/split_bw_str",
        lambda: build_schedule("zbv", 2, 4, split_bw="no"),
        ST,
        r"split_bw='no' must be True or False",
    ),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "duplicate case ids"


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error(case_id):
    case = _BY_ID[case_id]
    with pytest.raises(case.error) as info:
        case.call()
    assert isinstance(info.value, (PipelineError, ScheduleError))
    assert re.search(case.match, str(info.value)), f"{str(info.value)!r} !~ {case.match!r}"


def test_type_errors_are_builtin_type_errors_too():
    for call in (lambda: PipelineStage(nn.Linear, 0, 1), lambda: build_schedule(1, 2, 4)):
        with pytest.raises(TypeError):
            call()
        with pytest.raises(ValueError):
            call()


def test_good_input_still_accepted():
    st = PipelineStage(nn.Linear(2, 2), 0, 1, device=torch.device("cpu"), group=None)
    sched = ScheduleGPipe([st], 2, _loss, batch_spec=BatchDimSpec(args=(0,), kwargs={}))
    losses: list = []
    out = sched.step(torch.ones(4, 2), target=torch.ones(4, 2), losses=losses)
    assert out.shape == (4, 2) and len(losses) == 2
    mbs = split_microbatches((torch.ones(4, 2), None), {"m": torch.ones(4)}, 2, None)
    assert len(mbs) == 2 and mbs[0][0][0].shape == (2, 2)
    assert split_microbatches((torch.ones(4, 2),), {}, 2, BatchDimSpec(args=-1))[0][0][0].shape == (
        4,
        1,
    )
    build_schedule("interleaved_1f1b", 2, 4, stages_per_rank=2, overlap_p2p=True)
