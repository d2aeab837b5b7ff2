"""Functions defined in a loose test file resolve in the ranks under pytest's importlib mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hp_testing

LOOSE_TEST = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    from hp_testing import run_ranks

    OFFSET = 100  # module state the ranks must see


    def _body(x):
        t = torch.tensor([float(x + dist.get_rank())])
        dist.all_reduce(t)
        return (__name__, OFFSET + t.item())


    def test_loose_file_under_importlib_mode():
        results = run_ranks(_body, 2, args=(5,), timeout=60)
        assert [value for _, value in results] == [111.0, 111.0]
        names = {name for name, _ in results}
        print("CHILD MODULE NAMES", names)
        assert all(name.startswith("_hp_testing_file_test_loose_") for name in names), names
    """
)


def test_loose_test_file_under_importlib_mode(tmp_path):
    tests = tmp_path / "loose"
    tests.mkdir()
    (tests / "test_loose_ranks.py").write_text(LOOSE_TEST)
    elsewhere = tmp_path / "cwd"  # keep the test file's folder off sys.path
    elsewhere.mkdir()
    env = dict(os.environ)  # hp_testing importable even when it is not installed
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(hp_testing.__file__).parents[1]), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            f"--rootdir={tests}",
            str(tests / "test_loose_ranks.py"),
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "1 passed" in output
    assert "CHILD MODULE NAMES" in output
