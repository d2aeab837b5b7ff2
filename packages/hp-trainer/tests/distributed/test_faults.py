"""Faults on CPU ranks, each rank a plain process as a cluster scheduler starts them:
SIGTERM sent to all 4 ranks mid-run makes them finish the step, write a checkpoint and exit 0,
and the resumed run's losses equal an uninterrupted run's; a rank that hangs or dies is named
by the rank that waits for it (within ``comm.train_timeout_s``); a NaN on one rank makes every
rank skip the same step."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fault_worker.py")
BASE = ["--training.seq_len", "32", "--training.global_batch_size", "8"]
BASE += ["--metrics.tensorboard", "false", "--metrics.plot", "false", "--metrics.log_freq", "1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(n: int, spec: dict) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs, timeout=180.0, wait_for=None) -> list[tuple[int, str, str]]:
    """(exit code, last stdout line, stderr) of each rank; ``wait_for``: only those ranks are
    waited for, the others killed afterwards (a hung rank)."""
    out = []
    try:
        for r, p in enumerate(procs):
            if wait_for is not None and r not in wait_for:
                out.append(None)
                continue
            so, se = p.communicate(timeout=timeout)
            lines = so.strip().splitlines()
            out.append((p.returncode, lines[-1] if lines else "", se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _losses(line: str) -> list[float]:
    assert line.startswith("LOSSES "), line
    return json.loads(line[len("LOSSES ") :])


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(tmp_path):
    args = [*BASE, "--training.steps", "12", "--checkpoint.interval", "100"]
    straight = _finish(_start(4, {"args": [*args, "--job.dump_folder", str(tmp_path / "a")]}))
    assert all(code == 0 for code, _, _ in straight), straight[0][2][-3000:]
    expected = _losses(straight[0][1])
    ready = tmp_path / "ready"
    run = [*args, "--job.dump_folder", str(tmp_path / "b")]
    spec = {"args": run, "fault": {"sleep": 0.4, "ready": str(ready), "ready_step": 3}}
    procs = _start(4, spec)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    for p in procs:  # a real signal to every rank, as a scheduler's preemption sends it
        p.send_signal(signal.SIGTERM)
    stopped = _finish(procs)
    assert all(code == 0 for code, _, _ in stopped), [s[2][-2000:] for s in stopped]
    partial = [_losses(line) for _, line, _ in stopped]
    k = len(partial[0])
    assert all(p == partial[0] for p in partial) and 3 <= k < 12  # all stopped at one step
    assert (tmp_path / "b" / "checkpoint" / f"step-{k}" / "metadata.json").exists()
    resumed = _finish(_start(4, {"args": run}))
    assert all(code == 0 for code, _, _ in resumed), resumed[0][2][-3000:]
    assert _losses(resumed[0][1]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kind", ["hang", "die"])
def test_a_rank_that_hangs_or_dies_is_named(tmp_path, kind):
    args = [*BASE, "--training.steps", "6", "--checkpoint.enable", "false"]
    args += ["--comm.train_timeout_s", "4", "--job.dump_folder", str(tmp_path)]
    spec = {"args": args, "fault": {"rank": 1, "step": 2, "kind": kind}}
    t0 = time.monotonic()
    res = _finish(_start(2, spec), timeout=120, wait_for={0})
    code, line, err = res[0]
    assert code == 5 and line.startswith("PEERFAILURE "), err[-3000:]
    msg = json.loads(line[len("PEERFAILURE ") :])
    assert "rank 0: a collective failed or timed out in step 3" in msg
    assert "did not report, dead or hung: rank 1 (last started step 2)" in msg
    assert time.monotonic() - t0 < 90  # the timeout, then a short grace: no hang


def test_nan_on_one_rank_is_skipped_by_all(tmp_path):
    args = [*BASE, "--training.steps", "4", "--checkpoint.enable", "false"]
    args += ["--training.on_nonfinite", "skip", "--job.dump_folder", str(tmp_path)]
    res = _finish(_start(2, {"args": args, "nan": {"rank": 1, "call": 2}}))
    assert all(code == 0 for code, _, _ in res), res[1][2][-3000:]
    losses = [_losses(line) for _, line, _ in res]
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(*losses))
    assert math.isnan(losses[0][1]) and all(math.isfinite(v) for v in losses[0][2:])


def test_hp_train_passes_sigterm_to_the_ranks(tmp_path):
    """SIGTERM to the ``hp-train`` process (what a container's PID 1 gets): the ranks finish
    the step, checkpoint, and everything exits 0."""
    args = [sys.executable, "-m", "hp_trainer.train", "--nproc", "2", *BASE]
    args += ["--training.steps", "100000", "--checkpoint.interval", "100000"]
    args += ["--job.dump_folder", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # rank 0's lines: wait for a step to be done
        if line.startswith("step ") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM: stopping after step" in out
    k = int(out.split("SIGTERM: stopping after step")[1].split()[0])
    assert (tmp_path / "checkpoint" / f"step-{k}" / "metadata.json").exists()
