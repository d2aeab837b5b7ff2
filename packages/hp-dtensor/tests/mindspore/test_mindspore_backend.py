"""The MindSpore platform of hp_dtensor on 2 CPU workers launched by msrun, against numpy.

Runs where MindSpore is installed (``nox -s tests_mindspore``); elsewhere it is skipped, and
asking for the backend must name the package to install."""

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).parent

HAVE_MS = importlib.util.find_spec("mindspore") is not None


@pytest.mark.skipif(not HAVE_MS, reason="MindSpore is not installed (nox -s tests_mindspore)")
def test_collectives_on_two_cpu_workers(tmp_path):
    from hp_testing.msrun import run_mindspore

    results = run_mindspore(tmp_path, HERE / "ms_collectives.py", "collectives_body")
    for rank, verdicts in enumerate(results):
        failed = {k: v for k, v in verdicts.items() if v != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
        assert len(verdicts) == 6


@pytest.mark.skipif(HAVE_MS, reason="checks the message shown when MindSpore is missing")
def test_missing_mindspore_names_the_package(monkeypatch):
    from hp_dtensor import get_platform
    from hp_dtensor.errors import BackendError

    monkeypatch.setenv("HP_BACKEND", "mindspore")
    with pytest.raises(BackendError, match='pip install mindspore "numpy<2"'):
        get_platform("cpu")
