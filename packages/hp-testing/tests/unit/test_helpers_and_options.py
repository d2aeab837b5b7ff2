"""Helpers and argument checks that need no processes."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import hp_testing
from hp_testing import RankFailure, RankPool, RankTimeout, assert_close, run_ranks, seed_all
from hp_testing._group import _trim_stack


def _noop():
    return None


def test_public_names():
    assert set(hp_testing.__all__) == {
        "RankFailure",
        "RankPool",
        "RankTimeout",
        "assert_close",
        "run_ranks",
        "seed_all",
    }
    assert issubclass(RankFailure, RuntimeError)
    assert issubclass(RankTimeout, RankFailure)


def test_assert_close_passes_and_fails_with_message():
    assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]))
    with pytest.raises(AssertionError, match="(?s)grad of layer 3.*Mismatched elements"):
        assert_close(torch.tensor([1.0]), torch.tensor([1.5]), msg="grad of layer 3")


def test_assert_close_accepts_a_single_tolerance():
    assert_close(torch.tensor([1.0]), torch.tensor([1.05]), atol=0.1)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1.0]), torch.tensor([1.05]), rtol=0.01)


def test_seed_all_makes_every_rng_repeat():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3)

    seed_all(1234)
    first = draw()
    seed_all(1234)
    second = draw()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2])
    seed_all(4321)
    assert draw()[0] != first[0]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"world_size": 0}, ValueError),
        ({"world_size": 2, "timeout": 0}, ValueError),
        ({"world_size": 2, "env": {"X": 1}}, TypeError),
        ({"world_size": 2, "args": (threading.Lock(),)}, TypeError),
    ],
)
def test_bad_options_raise_before_any_process_starts(kwargs, error):
    with pytest.raises(error):
        run_ranks(_noop, **kwargs)


def test_run_ranks_rejects_a_lambda():
    with pytest.raises(TypeError, match="module level"):
        run_ranks(lambda: 1, 2)


def test_closed_pool_refuses_work():
    pool = RankPool(2)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_noop)
    assert pool.pids == []


def test_stack_trimming_drops_harness_frames():
    dump = (
        "Current thread 0x1 (most recent call first):\n"
        '  File "/t/test_x.py", line 3 in body\n'
        '  File "/s/hp_testing/_worker.py", line 120 in _serve\n'
        '  File "/usr/lib/multiprocessing/process.py", line 108 in run\n'
        "\n"
        "Thread 0x2 (most recent call first):\n"
        '  File "/usr/lib/threading.py", line 1 in wait\n'
    )
    trimmed = _trim_stack(dump)
    assert "body" in trimmed and "wait" in trimmed
    assert "_serve" not in trimmed and "process.py" not in trimmed
    assert "harness frames omitted" in trimmed
