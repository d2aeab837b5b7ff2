"""The MindSpore platform of hp_dtensor on 2 CPU workers launched by msrun, against numpy.

Runs where MindSpore is installed (``nox -s tests_mindspore``); elsewhere it is skipped, and
asking for the backend must name the package to install."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HAVE_MS = importlib.util.find_spec("mindspore") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not HAVE_MS, reason="MindSpore is not installed (nox -s tests_mindspore)")
def test_collectives_on_two_cpu_workers(tmp_path):
    msrun = Path(sys.executable).with_name("msrun")
    cmd = [
        str(msrun),
        "--worker_num=2",
        "--local_worker_num=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        f"--log_dir={tmp_path / 'logs'}",
        "--join=True",
        "--cluster_time_out=90",
        str(HERE / "ms_collectives.py"),
        str(tmp_path),
    ]
    # msrun starts workers with the first "python" on PATH: make it this interpreter
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "HP_BACKEND": "mindspore", "GLOG_v": "3", "PATH": path}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = {k: v for k, v in results.items() if v != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
        assert len(results) == 6


@pytest.mark.skipif(HAVE_MS, reason="checks the message shown when MindSpore is missing")
def test_missing_mindspore_names_the_package(monkeypatch):
    from hp_dtensor import get_platform
    from hp_dtensor.errors import BackendError

    monkeypatch.setenv("HP_BACKEND", "mindspore")
    with pytest.raises(BackendError, match='pip install mindspore "numpy<2"'):
        get_platform("cpu")
