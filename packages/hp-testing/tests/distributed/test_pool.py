"""RankPool: one start-up for many calls, restart after failures."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hp_testing import RankFailure, RankPool, RankTimeout
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2, timeout=60)

_STATE = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pid():
    return os.getpid()


def _sum_of_ranks(scale=1.0):
    t = torch.tensor([float(dist.get_rank())]) * scale
    dist.all_reduce(t)
    return t.item()


def _remember(value):
    _STATE["value"] = value + dist.get_rank()


def _recall():
    return _STATE.get("value")


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise KeyError(f"missing on rank {bad_rank}")
    return "ok"


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    return "ok"


def _unpicklable_result():
    return threading.Lock()


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return "ok"


def test_many_functions_run_on_the_same_processes(pool):
    pids = pool.run(_pid)
    assert pids == pool.pids and len(set(pids)) == 2
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]
    assert pool.run(_sum_of_ranks, scale=3.0) == [3.0, 3.0]
    assert pool.run(_remember, 10) == [None, None]
    assert pool.run(_recall) == [10, 11]  # state persists between calls
    assert pool.run(_pid) == pids


def test_pool_restarts_after_a_failure(pool):
    before = pool.run(_pid)
    restarts = pool.restarts
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank, 0)
    assert "rank 0: KeyError" in str(info.value) and "missing on rank 0" in str(info.value)
    assert set(info.value.failures) == {0}
    assert not any(_alive(pid) for pid in before)
    after = pool.run(_pid)
    assert set(after).isdisjoint(before)
    assert pool.restarts == restarts + 1
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]


def test_a_dying_rank_and_an_unpicklable_result_are_failures(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_exit_on_rank_1)
    assert "rank 1: died (exit code 3)" in str(info.value)
    with pytest.raises(RankFailure) as info:
        pool.run(_unpicklable_result)
    assert "pickling the return value of type lock" in str(info.value)
    assert set(info.value.failures) == {0, 1}
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]


def test_pool_timeout_then_restart():
    with RankPool(2, timeout=6) as small:
        pids = small.pids
        start = time.monotonic()
        with pytest.raises(RankTimeout) as info:
            small.run(_hang_on_rank_0)
        assert time.monotonic() - start < 6 + 5
        assert info.value.unfinished == [0]
        assert "_hang_on_rank_0" in info.value.stacks[0]
        assert not any(_alive(pid) for pid in pids)
        assert small.run(_raise_on_rank, -1) == ["ok", "ok"]
        assert small.restarts == 1
    assert small.pids == []
