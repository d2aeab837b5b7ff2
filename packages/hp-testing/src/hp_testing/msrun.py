"""Run one test body on MindSpore CPU workers started by ``msrun`` (MindSpore's launcher), the
way ``run_ranks`` runs it on torch ranks; framework-parametrized tests use both.

The body is a module-level function of a file (the test file itself, usually): each worker
imports that file, calls the function and pickles its result, or its traceback, for the test
to read. Set up nothing in the worker: the body builds its mesh, which starts the MindSpore
process group.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["run_framework", "run_mindspore"]

_WORKER = Path(__file__).with_name("_ms_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mindspore(
    tmp_path: str | Path, file: str | Path, func: str, *args, workers: int = 2, timeout: float = 300
) -> list:
    """``func(*args)`` from ``file`` on ``workers`` MindSpore CPU workers (``HP_BACKEND`` is
    ``mindspore`` there); every rank's return value, in rank order. Raises ``AssertionError``
    with the workers' logs when msrun fails, and with the traceback when a rank raised."""
    tmp_path = Path(tmp_path)
    msrun = Path(sys.executable).with_name("msrun")
    cmd = [
        str(msrun),
        f"--worker_num={workers}",
        f"--local_worker_num={workers}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        f"--log_dir={tmp_path / 'logs'}",
        "--join=True",
        "--cluster_time_out=90",
        str(_WORKER),
        str(file),
        func,
        str(tmp_path),
        json.dumps(list(args)),
    ]
    # msrun starts workers with the first "python" on PATH: make it this interpreter
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "HP_BACKEND": "mindspore", "GLOG_v": "3", "PATH": path}
    # its own session, so a timeout ends the workers too; run in tmp_path, where MindSpore
    # drops its graph dumps on errors
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\nmsrun and its workers killed after {timeout} s"
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    if proc.returncode != 0:
        raise AssertionError(
            f"msrun exited with {proc.returncode}\n{stdout[-3000:]}{stderr[-3000:]}{logs}"
        )
    out = []
    for rank in range(workers):
        status, value = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        if status != "ok":
            raise AssertionError(f"rank {rank} raised:\n{value}")
        out.append(value)
    return out


def run_framework(
    framework: str, request, tmp_path, func, *args, pool: str = "pool2", workers: int = 2
) -> list:
    """Run ``func(*args)``, a module-level function of the calling test's module, on the ranks
    of ``framework``: ``"torch"`` on the gloo ranks of the ``pool`` fixture, ``"mindspore"`` on
    ``workers`` msrun workers (give the pool's size; the test is skipped where MindSpore is not
    installed). Every rank's result,
    in rank order."""
    import importlib.util

    import pytest

    if framework == "mindspore":
        if importlib.util.find_spec("mindspore") is None:
            pytest.skip("MindSpore is not installed (nox -s tests_mindspore)")
        return run_mindspore(
            tmp_path, request.module.__file__, func.__name__, *args, workers=workers
        )
    if framework != "torch":
        raise ValueError(f"framework={framework!r}: give 'torch' or 'mindspore'")
    return request.getfixturevalue(pool).run(func, *args)
