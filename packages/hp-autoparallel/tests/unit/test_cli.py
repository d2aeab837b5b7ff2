"""The ``hp-plan`` command: the table, the TOML it writes (loadable by hp-train and passing
its preflight), ``--why``, and the typed errors with the nearest valid choice (exit 2)."""

import subprocess
import sys
import time

from hp_autoparallel.cli import main
from hp_trainer import load_config, preflight


def test_plan_writes_a_toml_hp_train_accepts(tmp_path, capsys):
    out = tmp_path / "plans"
    code = main(
        [
            "--model",
            "llama3-8b",
            "--gpus",
            "16",
            "--global-batch",
            "64",
            "--seq",
            "4096",
            "--out",
            str(out),
            "--top",
            "5",
            "--why",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "#  config" in text and "tok/s/GPU" in text and "MFU" in text and "peak GiB" in text
    assert "biggest cost" in text and "\nbest: " in text and "rejected (" in text
    path = out / "llama3-8b-16xh200.toml"
    assert f"wrote the hp-train config of the best plan: {path}" in text
    cfg = load_config(path)
    pd, _ = preflight(cfg, 16)
    assert pd.world_size == 16 and cfg.training.global_batch_size == 64


def test_unknown_model(capsys):
    assert main(["--model", "deepseek-v3-67b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "--model 'deepseek-v3-67b'" in err and "did you mean 'deepseek-v3-671b'" in err


def test_unknown_gpu(capsys):
    assert main(["--model", "llama3-8b", "--gpus", "8", "--gpu", "h20"]) == 2
    assert "did you mean 'h200'" in capsys.readouterr().err


def test_cluster_file_missing_field(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(
        "[cluster]\ngpus_per_node = 8\n[intra_node]\nbandwidth_gbps = 200\nlatency_us = 10\n"
        "[inter_node]\nlatency_us = 20\n"
    )
    assert main(["--model", "llama3-8b", "--gpus", "8", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert "inter_node.bandwidth_gbps is missing: add it to [inter_node]" in err


def test_gpu_count_no_config_can_use(capsys, tmp_path):
    code = main(["--model", "llama3-70b", "--gpus", "7", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--gpus 7: no configuration of llama3-70b" in err and "--gpus 16" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_bad_numbers(capsys):
    assert main(["--model", "llama3-8b", "--gpus", "0"]) == 2
    assert "--gpus 0: must be at least 1" in capsys.readouterr().err


def test_the_command_end_to_end_in_under_30_s(tmp_path):
    # a fresh interpreter: imports (torch, through hp-trainer) included
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hp_autoparallel.cli",
            "--model",
            "deepseek-v3-671b",
            "--gpus",
            "1024",
            "--gpu",
            "h200",
            "--global-batch",
            "4096",
            "--seq",
            "8192",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    assert seconds < 30, f"hp-plan took {seconds:.1f} s"
    path = tmp_path / "deepseek-v3-671b-1024xh200.toml"
    assert str(path) in done.stdout
    cfg = load_config(path)
    pd, _ = preflight(cfg, 1024)
    assert pd.world_size == 1024 and pd.ep > 1


def test_custom_gpu_kind_needs_cluster(tmp_path, capsys):
    from importlib import resources

    text = (resources.files("hp_autoparallel") / "data/gpus/h200.toml").read_text()
    path = tmp_path / "mygpu.toml"
    path.write_text(text.replace('name = "h200"', 'name = "mygpu"'))
    assert main(["--model", "llama3-8b", "--gpus", "8", "--gpu", str(path)]) == 2
    err = capsys.readouterr().err
    assert "custom GPU kind" in err and "give --cluster" in err
