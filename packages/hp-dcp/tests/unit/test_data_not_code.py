"""Checkpoints are data, not code: values are stored as tagged JSON and round-trip with their
types; a crafted checkpoint whose value is a pickle that would run a command (its checksum
fixed to match) is refused by load, verify and the CLI, and inspect does not read it; nothing
runs (hp-trainer's test_resume_safety does the same for the trainer's resume).
An old checkpoint's pickles load only with allow_pickle=True (warned).
"""

import math
import pickle

import numpy as np
import pytest
import torch

import hp_dcp
from hp_dcp import CheckpointError, StateDictError
from hp_dcp._codec import decode, encode
from hp_testing.tamper import RunsCommand, plant_value


def _value():
    return {
        "step": 3,
        "losses": [1.5, float("nan"), float("inf")],
        "betas": (0.9, 0.95),
        "flags": {True: None, 2: "two", (1, 2): [b"\x00\xff"]},
        "rng": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "scalar": np.float64(0.25),
    }


def _same(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_values_round_trip_with_their_types(tmp_path):
    assert _same(decode(encode(_value())), _value())
    plain = {k: v for k, v in _value().items() if k != "flags"}  # state-dict keys: str / int
    hp_dcp.save({"w": torch.ones(2), "meta": plain}, checkpoint_id=tmp_path / "c")
    out = {"w": torch.zeros(2), "meta": {k: None for k in plain}}
    hp_dcp.load(out, checkpoint_id=tmp_path / "c")
    assert _same(out["meta"], plain) and torch.equal(out["w"], torch.ones(2))
    with pytest.raises(StateDictError, match=r"key 'bad': value\[1\]: a builtins.set"):
        hp_dcp.save({"bad": [1, {2}]}, checkpoint_id=tmp_path / "d")
    assert not (tmp_path / "d" / "metadata.json").exists()  # refused before writing


@pytest.mark.parametrize("encoding", ["pickle", "torch_save"])
def test_a_crafted_checkpoint_runs_nothing(tmp_path, encoding, capsys):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "c"
    hp_dcp.save({"w": torch.ones(2), "meta": {"step": 1}}, checkpoint_id=ckpt)  # "meta.step"
    payload = pickle.dumps(RunsCommand(marker))
    if encoding == "torch_save":
        import io

        buf = io.BytesIO()
        torch.save({"x": RunsCommand(marker)}, buf)
        payload = buf.getvalue()
    plant_value(ckpt, "meta.step", payload, encoding)
    out = {"w": torch.zeros(2), "meta": {"step": 0}}
    with pytest.raises(CheckpointError, match="'meta.step'"):
        hp_dcp.load(out, checkpoint_id=ckpt)
    problems = hp_dcp.verify(ckpt)
    assert problems and "'meta.step'" in problems[0]
    listing = hp_dcp.inspect(ckpt)
    assert "meta" in listing
    from hp_dcp._cli import main

    assert main(["verify", str(ckpt)]) == 1
    main(["inspect", str(ckpt)])
    assert not marker.exists()  # nothing ran


def test_old_pickled_values_need_the_opt_in(tmp_path):
    ckpt = tmp_path / "old"
    hp_dcp.save({"w": torch.ones(2), "meta": {"step": 0}}, checkpoint_id=ckpt)
    plant_value(ckpt, "meta.step", pickle.dumps(7), "pickle")  # what hp-dcp used to write
    out = {"w": torch.zeros(2), "meta": {"step": 0}}
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        hp_dcp.load(out, checkpoint_id=ckpt)
    with pytest.warns(UserWarning, match="unpickling value 'meta.step'"):
        hp_dcp.load(out, checkpoint_id=ckpt, allow_pickle=True)
    assert out["meta"] == {"step": 7}
    # converting it rewrites the value as data: the copy loads without the opt-in
    with pytest.warns(UserWarning):
        hp_dcp.convert(ckpt, tmp_path / "new", to="dcp", allow_pickle=True)
    again = {"w": torch.zeros(2), "meta": {"step": 0}}
    hp_dcp.load(again, checkpoint_id=tmp_path / "new")
    assert again["meta"] == {"step": 7}
