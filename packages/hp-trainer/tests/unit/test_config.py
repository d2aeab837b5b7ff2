"""Job config: TOML + overrides, one clear error per bad key, before anything starts."""

import pytest
import torch

from hp_trainer import ConfigError, load_config, preflight
from hp_trainer._trainer import _moe_overrides
from hp_trainer.models import get_config
from hp_trainer.train import main


def _toml(tmp_path, text):
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_toml_and_overrides(tmp_path):
    p = _toml(
        tmp_path, "[training]\nsteps = 7\nlr = 0.5\n[parallelism]\ntensor_parallel_degree = 2\n"
    )
    cfg = load_config(p, ["--training.steps", "9", "--metrics.plot=false", "--training.seq_len=64"])
    assert cfg.training.steps == 9 and cfg.training.lr == 0.5 and cfg.training.seq_len == 64
    assert cfg.metrics.plot is False and cfg.parallelism.tensor_parallel_degree == 2


@pytest.mark.parametrize(
    "text,overrides,message",
    [
        (
            "[training]\nstepz = 3\n",
            [],
            "unknown config key 'training.stepz' (did you mean 'training.steps'",
        ),
        (
            "[trainign]\nsteps = 3\n",
            [],
            "unknown config key 'trainign.steps' (did you mean 'training'",
        ),
        ("", ["--training.steps", "ten"], "training.steps='ten': expected an integer"),
        ("", ["--metrics.plot", "maybe"], "metrics.plot='maybe': expected true or false"),
        ("[data]\npath = 'nope.txt'\n", [], "data.path='nope.txt': no such file"),
        (
            "[model]\nname = 'llama3-tin'\n",
            [],
            "model.name='llama3-tin' (did you mean 'llama3-tiny'",
        ),
        ("", ["training.steps", "3"], "write --section.key value"),
    ],
)
def test_bad_config_named(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(_toml(tmp_path, text), overrides)
    assert message in str(e.value)


def test_degrees_checked_before_any_process(tmp_path, capsys):
    p = _toml(tmp_path, "[parallelism]\ntensor_parallel_degree = 3\n")
    with pytest.raises(
        ConfigError, match="tensor_parallel_degree=3 does not divide the model's 4 attention heads"
    ):
        preflight(load_config(p), 3)
    # the CLI prints one line per problem and starts nothing (exit status 2)
    assert main(["--config", str(p), "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hp-train: parallelism.tensor_parallel_degree=3 does not divide")
    assert main(["--config", str(p), "--nproc", "4"]) == 2
    assert "world size 4 is not divisible by" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="world size 4 is not divisible"):
        preflight(load_config(p), 4)


def test_pipeline_checks(tmp_path):
    p = _toml(tmp_path, "[parallelism]\npipeline_parallel_degree = 2\npipeline_schedule = 'zbv'\n")
    with pytest.raises(
        ConfigError,
        match="pipeline_parallel_degree=2 x 2 stage\\(s\\) per rank exceeds the model's 2 layers",
    ):
        preflight(load_config(p), 2)
    with pytest.raises(ConfigError, match="pipeline_schedule='1fb1' \\(did you mean '1f1b'"):
        load_config(None, ["--parallelism.pipeline_schedule", "1fb1"])


def test_pipeline_cuda_graphs_checks():
    """Graphed stages need a pipeline and unsharded stages: said before any process."""
    on = ["--parallelism.pipeline_cuda_graphs", "true"]
    with pytest.raises(ConfigError, match="set pipeline_parallel_degree > 1"):
        preflight(load_config(None, on), 1)
    cfg = load_config(None, [*on, "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="got data_parallel_shard_degree=2: set them to 1"):
        preflight(cfg, 4)  # dp_shard fills the other 2 ranks
    if torch.cuda.is_available():
        assert preflight(cfg, 2)[0].pp == 2
    else:
        with pytest.raises(ConfigError, match="pipeline_cuda_graphs=true needs CUDA devices"):
            preflight(cfg, 2)


def test_collectives_and_linear_heads_checks(tmp_path):
    with pytest.raises(ConfigError, match="parallelism.collectives='nccl': use 'torch' or"):
        load_config(None, ["--parallelism.collectives", "nccl"])
    assert load_config(None, ["--parallelism.collectives", "hp_kernels"]).parallelism.collectives
    # qwen3.5-tiny has 2 linear-attention key heads: TP 4 cannot split them
    cfg = load_config(
        None, ["--model.name", "qwen3.5-tiny", "--parallelism.tensor_parallel_degree", "4"]
    )
    with pytest.raises(ConfigError, match="does not divide the model's 2 linear-attention key"):
        preflight(cfg, 4)


def test_moe_section_and_its_checks(tmp_path):
    from hp_trainer._trainer import preflight

    cfg = load_config(
        None,
        [
            "--model.name",
            "deepseek-v3-tiny",
            "--moe.aux_loss_coeff",
            "0.01",
            "--moe.aux_loss_type",
            "global",
            "--moe.load_balance_coeff",
            "0",
            "--moe.capacity_factor",
            "1.25",
        ],
    )
    _, mc = preflight(cfg, 1)
    assert mc.moe.aux_loss_coeff == 0.01 and mc.moe.aux_loss_type == "global"
    # 0 keeps DeepSeek's expert bias, fixed
    assert mc.moe.load_balance_coeff == 0.0 and mc.moe.capacity_factor == 1.25
    _, kept = preflight(load_config(None, ["--model.name", "deepseek-v3-tiny"]), 1)
    assert kept.moe.load_balance_coeff == 1e-3 and kept.moe.aux_loss_coeff == 0.0
    # a model without a bias gets none
    qwen = ["--model.name", "qwen3-moe-tiny", "--moe.load_balance_coeff", "0"]
    assert preflight(load_config(None, qwen), 1)[1].moe.load_balance_coeff is None
    with pytest.raises(ConfigError, match="moe.load_balance_coeff=-0.5: must be >= 0, or -1"):
        load_config(None, ["--moe.load_balance_coeff", "-0.5"])
    with pytest.raises(ConfigError, match="moe.aux_loss_type='batch' has no effect without"):
        preflight(
            load_config(None, ["--model.name", "qwen3-moe-tiny", "--moe.aux_loss_type", "batch"]),
            1,
        )
    dense = load_config(None, ["--moe.aux_loss_coeff", "0.1"])
    dense.model.hf_path = "x/y"  # the message names the model by its folder
    with pytest.raises(ConfigError, match="model 'x/y' has no MoE layers"):
        _moe_overrides(get_config("llama3-tiny"), dense)
    with pytest.raises(ConfigError, match="moe.aux_loss_type='token'"):
        load_config(None, ["--moe.aux_loss_type", "token"])
    with pytest.raises(ConfigError, match="model 'llama3-tiny' has no MoE layers"):
        preflight(load_config(None, ["--moe.aux_loss_coeff", "0.1"]), 1)
    with pytest.raises(ConfigError, match="multi-token prediction module.*model.mtp_layers = 0"):
        preflight(
            load_config(
                None,
                [
                    "--model.name",
                    "deepseek-v3-tiny",
                    "--parallelism.pipeline_parallel_degree",
                    "2",
                    "--parallelism.data_parallel_shard_degree",
                    "1",
                ],
            ),
            2,
        )
    tp = ["--model.name", "deepseek-v3-tiny", "--parallelism.tensor_parallel_degree", "2"]
    with pytest.raises(ConfigError, match="tensor_parallel_degree=2: multi-token prediction"):
        preflight(load_config(None, tp), 4)
    _, mc = preflight(load_config(None, [*tp, "--model.mtp_layers", "0"]), 4)
    assert mc.mtp_layers == 0 and mc.architecture == "deepseek_v3"
    with pytest.raises(ConfigError, match=r"model.mtp_layers=-2: must be >= 0, or -1"):
        load_config(None, ["--model.mtp_layers", "-2"])
    with pytest.raises(ConfigError, match="model.mtp_layers=1: mtp_layers: multi-token"):
        preflight(load_config(None, ["--model.mtp_layers", "1"]), 1)  # llama has none
    with pytest.raises(ConfigError, match="does not divide the 8 experts"):
        preflight(
            load_config(
                None,
                [
                    "--model.name",
                    "qwen3-moe-tiny",
                    "--parallelism.expert_parallel_degree",
                    "3",
                    "--parallelism.data_parallel_shard_degree",
                    "3",
                ],
            ),
            3,
        )


def test_shipped_configs_pass_preflight():
    """Every shipped config loads and fits 4 ranks (what hp-train checks before launching)."""
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
    assert len(configs) >= 8
    for path in configs:
        dims, _ = preflight(load_config(path), 4)
        assert dims.world_size == 4, path.name


def test_context_parallel_checks():
    cp = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree"]
    with pytest.raises(ConfigError, match="context_parallel_method='tree'"):
        load_config(None, ["--parallelism.context_parallel_method", "tree"])
    with pytest.raises(ConfigError, match=r"training.seq_len=30 must be divisible by 2 x"):
        preflight(load_config(None, [*cp, "2", "--training.seq_len", "30"]), 4)
    no_lb = ["--parallelism.context_parallel_load_balance", "false", "--training.seq_len", "30"]
    preflight(load_config(None, [*cp, "2", *no_lb]), 4)  # 30 splits over cp 2 without it
    preflight(load_config(None, [*cp, "2", "--model.name", "qwen3.5-tiny"]), 4)  # supported
    with pytest.raises(ConfigError, match="context_parallel_degree=2: multi-token prediction"):
        preflight(load_config(None, [*cp, "2", "--model.name", "deepseek-v3-tiny"]), 4)
