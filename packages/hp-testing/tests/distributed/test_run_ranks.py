"""run_ranks on real processes: results, collectives, failures and hangs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hp_testing import RankFailure, RankTimeout, run_ranks

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HP_EXTRA")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _report(offset, *, scale):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "value": t.item() * scale + offset,
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "tmpdir": os.environ["HP_TESTING_TMPDIR"],
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order_with_all_reduce(world_size):
    results = run_ranks(
        _report, world_size, args=(10,), kwargs={"scale": 2}, env={"HP_EXTRA": "x"}, timeout=60
    )
    total = world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size
        assert r["value"] == total * 2 + 10
        assert r["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "HP_EXTRA": "x",
        }
        assert r["threads"] == 1
    pids = [r["pid"] for r in results]
    assert len(set(pids)) == world_size and os.getpid() not in pids
    assert not any(_alive(pid) for pid in pids), "rank processes outlived run_ranks"
    assert len({r["tmpdir"] for r in results}) == 1
    assert not os.path.exists(results[0]["tmpdir"]), "temporary folder was not removed"


def _raise_on_rank_1(pid_dir):
    rank = dist.get_rank()
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("bad value on rank 1")
    dist.barrier()  # never completes: rank 1 does not arrive
    return rank


def test_a_raising_rank_is_reported_and_blocked_ranks_are_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 3, args=(str(tmp_path),), timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert type(err) is RankFailure
    assert elapsed < 25, f"took {elapsed:.1f} s: blocked ranks were not killed promptly"
    text = str(err)
    assert "rank 1: ValueError: bad value on rank 1" in text
    assert "in _raise_on_rank_1" in text  # the child's traceback
    assert "rank(s) 0, 2 did not finish" in text
    assert set(err.failures) == {1}
    assert "ValueError: bad value on rank 1" in err.failures[1]
    assert err.unfinished == [0, 2]
    for rank in (0, 2):
        assert "barrier" in err.stacks[rank]
        assert "_raise_on_rank_1" in err.stacks[rank]
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 3
    assert not any(_alive(pid) for pid in pids), "rank processes left behind"


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)
    return dist.get_rank()


def test_a_hanging_rank_times_out_with_its_stack():
    timeout = 6.0
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_1, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    err = info.value
    assert isinstance(err, RankFailure)
    assert timeout - 0.5 < elapsed < timeout + 5, f"took {elapsed:.1f} s"
    assert err.unfinished == [1]
    assert err.failures == {}
    assert "in _hang_on_rank_1" in err.stacks[1]
    text = str(err)
    assert "timed out after 6 s" in text and "rank(s) 1 of 2 still running" in text
    assert "rank 1: Python stack at the timeout" in text
    assert "in _hang_on_rank_1" in text
