"""The trainer's resume reads checkpoints as data: a value swapped for a pickle that would run a
command (checksum fixed to match) is refused with a CheckpointError and nothing runs."""

import json
import pickle

import pytest

from hp_dcp import CheckpointError
from hp_testing.tamper import RunsCommand, plant_value
from hp_trainer import LLMTrainer, load_config


def test_the_trainer_refuses_to_resume_a_crafted_checkpoint(tmp_path):
    marker = tmp_path / "pwned"
    args = ["--training.steps", "2", "--training.seq_len", "16", "--training.global_batch_size"]
    args += ["2", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path / "run")]
    args += ["--metrics.tensorboard", "false", "--metrics.plot", "false"]
    trainer = LLMTrainer(load_config(None, args))
    trainer.train()
    latest = trainer.latest_checkpoint()
    md = json.loads((latest / "metadata.json").read_text())
    key = next(iter(md["objects"]))  # any stored value: the loss history, the data position...
    plant_value(latest, key, pickle.dumps(RunsCommand(marker)), "pickle")
    with pytest.raises(CheckpointError, match="stored as a pickle"):
        LLMTrainer(load_config(None, args))
    assert not marker.exists()
