"""Symmetric memory on CPU ranks: peer views, put/get, counted signals, barriers; agreement
checks; a killed rank makes its peers fail fast and leaves nothing in /dev/shm."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hp_kernels.symm_mem as symm
from hp_testing.pytest_plugin import rank_pool_fixture

pool4 = rank_pool_fixture(4)
pool2 = rank_pool_fixture(2)


def _ring_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = symm.empty((3, 5), torch.float32)
    assert mem.buffer.shape == (3, 5) and mem.pids[rank] == os.getpid()
    right, left = (rank + 1) % world, (rank - 1) % world
    # put into the right neighbour's buffer, signal it, wait for the left one's put
    mem.put(torch.full((3, 5), float(rank)), right)
    mem.signal(right, slot=1)
    mem.wait(left, slot=1)
    assert torch.equal(mem.buffer, torch.full((3, 5), float(left)))
    mem.barrier()
    # get a peer's buffer; write through a peer view
    got = mem.get(right, torch.empty(3, 5))
    assert torch.equal(got, torch.full((3, 5), float(rank)))
    mem.barrier()
    mem.peer(right)[0, rank % 5] = 100.0 + rank
    mem.barrier()
    assert float(mem.buffer[0, left % 5]) == 100.0 + left
    # counted signals: three in a row are three waits
    for _ in range(3):
        mem.signal(right)
    for _ in range(3):
        mem.wait(left)
    # byte views at an offset, another dtype
    mem.barrier()
    view = mem.peer(rank, shape=(2,), dtype=torch.int64, offset=8)
    view.copy_(torch.tensor([rank, -rank]))
    mem.barrier()
    assert mem.peer(left, shape=(2,), dtype=torch.int64, offset=8).tolist() == [left, -left]
    with pytest.raises(ValueError, match="does not fit"):
        mem.peer(right, shape=(16,))
    with pytest.raises(ValueError, match="not a rank"):
        mem.signal(world)
    mem.barrier()
    mem.close()
    return True


def test_put_get_signal_barrier(pool4):
    assert pool4.run(_ring_body) == [True] * 4


def _disagree_body(kind):
    rank = dist.get_rank()
    try:
        if kind == "shape":
            symm.empty((4 + rank,), torch.float32)
        else:
            symm._host_id = lambda: f"node{rank}/boot"  # pretend rank 1 is elsewhere
            symm.empty((4,), torch.float32)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind, words",
    [("shape", ["rank 1 for shape (5,)"]), ("host", ["more than one host", "node0", "node1"])],
)
def test_disagreement_raises_everywhere(kind, words):
    from hp_testing import run_ranks

    for message in run_ranks(_disagree_body, 2, args=(kind,), timeout=60):
        for word in words:
            assert word in message


def _segments():
    return {p.name for p in Path("/dev/shm").glob("hp_symm_*")}


def _no_names_left_body():
    mem = symm.empty((1 << 16,), torch.float32)
    mem.barrier()
    from hp_kernels._ext import load

    return load().pending_names(), sorted(_segments())


def test_names_are_unlinked_after_rendezvous(pool2):
    before = _segments()
    for pending, segments in pool2.run(_no_names_left_body):
        assert pending == []
        assert set(segments) <= before  # the new buffer is mapped but has no name any more


_KILLED = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import hp_kernels.symm_mem as symm
    rank = int(sys.argv[1]); store = sys.argv[2]; phase = sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    if phase == "before-unlink" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies during the rendezvous
    mem = symm.empty((1024,), torch.float32, timeout=60)
    mem.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        mem.wait(1)
    except symm.PeerError as exc:
        print("PEERERROR", round(time.monotonic() - start, 1), exc, flush=True)
        sys.exit(0)
    print("NO ERROR", flush=True)
    """
)


@pytest.mark.parametrize("phase", ["after-unlink", "before-unlink"])
def test_killed_rank_fails_fast_and_leaves_no_segment(tmp_path, phase):
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    before = _segments()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store"), phase],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert procs[1].returncode == -signal.SIGKILL
    if phase == "after-unlink":
        assert procs[0].returncode == 0, outs[0]
        line = next(x for x in outs[0].splitlines() if x.startswith("PEERERROR"))
        assert "rank 1" in line and "exited" in line
        assert float(line.split()[1]) < 10  # noticed the dead peer long before the 60 s timeout
    else:
        assert procs[0].returncode != 0  # the rendezvous itself failed (gloo saw the peer go)
    time.sleep(0.2)
    assert _segments() <= before, _segments() - before
