"""Shared by the unit and distributed tests: the planner's own hp-train TOML for a plan."""

import pytest

from hp_autoparallel import Workload, estimate, load_cluster, load_gpu, model_spec, train_config


@pytest.fixture
def planner_toml(tmp_path):
    """``planner_toml(model, plan, batch=8, seq=64, name="plan") -> (path, predicted bytes)``:
    ``train_config(estimate(...))`` with the shipped ``cpu`` calibration, written under
    ``tmp_path``."""

    def write(model, plan, batch=8, seq=64, name="plan"):
        gpu = load_gpu("cpu")
        est = estimate(model_spec(model), plan, Workload(batch, seq), gpu, load_cluster("cpu"))
        text = train_config(
            est,
            model=model,
            global_batch=batch,
            seq_len=seq,
            gpu=gpu.name,
            compute_dtype=gpu.compute_dtype,
        )
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        return path, est.memory.allocated

    return write
