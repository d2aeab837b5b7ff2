"""Bad process groups and per-step arguments for hp_pipeline's stages and schedules (issue 26),
on 2 gloo ranks.

Each row is (id, call, error class, regex): the call must raise the error class (a
``PipelineError``; ``PipelineTypeError`` for a wrong type), with a message matching the regex
(which names the argument), on both ranks alike and before any collective or transfer. Every
row failed before its fix: a str or mesh taken as the group (failing later inside
``torch.distributed``), stages of one rank on different groups accepted, or a bad ``losses``
found only on the last stage's rank after the whole step ran. Checks that need no group are in
``tests/unit/test_bad_input_args.py``.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh as init_torch_mesh

from hp_pipeline import (
    PipelineError,
    PipelineStage,
    PipelineTypeError,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from hp_testing.bad_input import Case, by_id, check, run_case
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=60)


def _loss(out, target):
    return out.sum()


def _stage(c, s, n, group=None):
    return PipelineStage(nn.Linear(2, 2), s, n, device="cpu", group=group)


T, E = PipelineTypeError, PipelineError
CASES = [
    Case(
        "PipelineStage/group_str",
        lambda c: _stage(c, c.rank, 2, group="pp"),
        T,
        r"group='pp' is a str, not a ProcessGroup: pass the pipeline group",
    ),
    Case(
        "PipelineStage/group_mesh",
        lambda c: _stage(c, c.rank, 2, group=c.torch_mesh),
        T,
        r"group=.* is a DeviceMesh, not a ProcessGroup: .*mesh\.get_group\('pp'\)",
    ),
    Case(
        "Interleaved/groups_differ",
        lambda c: ScheduleInterleaved1F1B(
            [_stage(c, c.rank, 4, group=c.world), _stage(c, c.rank + 2, 4, group=c.other)],
            2,
            _loss,
        ),
        E,
        r"ScheduleInterleaved1F1B: the stages' groups differ .*same pipeline group",
    ),
    Case(
        "step/losses_str",
        lambda c: c.gpipe.step(
            *((torch.ones(2, 2),) if c.rank == 0 else ()),
            target=torch.ones(2, 2) if c.rank == 1 else None,
            losses="losses",
        ),
        T,
        r"ScheduleGPipe\.step: losses is a str: give a list",
    ),
]
_BY_ID = by_id(CASES)

_COLLECTIVES = (  # torch.distributed's: a row must raise before any collective or transfer
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "new_group",
)


@functools.cache
def _ctx():
    rank = dist.get_rank()
    return types.SimpleNamespace(
        rank=rank,
        world=dist.group.WORLD,
        other=dist.new_group([0, 1]),
        torch_mesh=init_torch_mesh("cpu", (2,), mesh_dim_names=("pp",)),
        gpipe=ScheduleGPipe(PipelineStage(nn.Linear(2, 2), rank, 2, device="cpu"), 2, _loss),
    )


def _run_case(case_id: str) -> dict:
    """On each rank: run the call, counting collectives; then check the group is still alive."""
    return run_case(_BY_ID[case_id].call, _ctx(), count=(dist, _COLLECTIVES))


@pytest.mark.parametrize("case_id", list(_BY_ID))
def test_bad_input_raises_typed_error_on_every_rank(pool, case_id):
    check(_BY_ID[case_id], pool.run(_run_case, case_id), PipelineError)


def _good_step():
    rank = dist.get_rank()
    pp = dist.new_group([0, 1])
    st = PipelineStage(nn.Linear(2, 2), rank, 2, device="cpu", group=pp)
    sched = ScheduleGPipe([st], 2, _loss)
    losses: list = []
    if rank == 0:
        sched.step(torch.ones(4, 2), losses=losses)
    else:
        sched.step(target=torch.ones(4, 2), losses=losses)
    return len(losses)


def test_good_input_still_accepted(pool):
    assert pool.run(_good_step) == [0, 2]
