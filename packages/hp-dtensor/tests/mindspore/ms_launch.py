"""Launch a function of a test file on 2 MindSpore CPU workers under ``msrun`` (through
``ms_worker.py``) and return every rank's result, in rank order."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mindspore(tmp_path: Path, file: str | Path, func: str, *args) -> list:
    """``func(*args)`` from ``file`` on 2 workers; fails the test with the workers' logs when
    msrun fails and with the traceback when a rank raised."""
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
        str(HERE / "ms_worker.py"),
        str(file),
        func,
        str(tmp_path),
        json.dumps(list(args)),
    ]
    # msrun starts workers with the first "python" on PATH: make it this interpreter
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "HP_BACKEND": "mindspore", "GLOG_v": "3", "PATH": path}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    out = []
    for rank in range(2):
        status, value = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert status == "ok", f"rank {rank}:\n{value}"
        out.append(value)
    return out
