"""LLMTrainer with the shipped MoE configurations on 4 CPU ranks: DeepSeek-V3 EP 2 x FSDP 2
(MLA, MTP, expert bias, sequence-wise balance loss), Qwen3-MoE PP 2 x EP 2 (1F1B) and
Qwen3.5-MoE EP 2 x TP 2 (expert tensor parallelism) give the one-process losses (rtol 1e-4)
over 20 steps with clipping and the LR schedule; a run killed after a checkpoint resumes with
the uninterrupted run's next losses; the expert-load plot is written."""

from pathlib import Path

import pytest
import torch

from hp_testing.pytest_plugin import rank_pool_fixture
from hp_trainer import Callback, LLMTrainer, MoeMonitorCallback, load_config

pool = rank_pool_fixture(4, timeout=300)
CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED = {
    "deepseek_v3_ep2_fsdp2": "deepseek_v3_tiny_ep2_fsdp2.toml",
    "qwen3_moe_pp2_ep2": "qwen3_moe_tiny_pp2_ep2.toml",
    "qwen3_5_moe_ep2_tp2": "qwen3_5_moe_tiny_ep2_tp2.toml",
}
FAST = [
    "--training.seq_len",
    "16",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "20",
    "--checkpoint.interval",
    "8",
    "--metrics.tensorboard",
    "false",
    "--metrics.log_freq",
    "100",
]
# the same job on one process: every parallelism degree back to 1
ONE = [
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--parallelism.tensor_parallel_degree",
    "1",
    "--parallelism.pipeline_parallel_degree",
    "1",
    "--parallelism.expert_parallel_degree",
    "1",
    "--parallelism.expert_tensor_parallel_degree",
    "1",
]


def _run(config, dump, extra=(), kill_at=None):
    class Kill(Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

    cfg = load_config(CONFIGS / config, [*FAST, "--job.dump_folder", dump, *extra])
    monitor = MoeMonitorCallback(log_freq=100, tensorboard=False)
    trainer = LLMTrainer(cfg, callbacks=[Kill(), monitor])
    try:
        losses = trainer.train()
    except KeyboardInterrupt:
        return None
    return losses, {k: str(v) for k, v in monitor.paths.items()}, trainer.moe_statistics()


def _pipeline_one_process(config):
    """PP's one-process equivalent splits each rank's batch in the same microbatches: the
    balance loss (per sequence) and the gradients then match; local_batch_size mirrors the
    pipeline's microbatches."""
    if "pp2" in config:
        return ["--training.local_batch_size", "1"]
    return []


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for name, config in SHIPPED.items():
        dump = str(tmp_path_factory.mktemp(name))
        out[name] = _run(config, dump, [*ONE, *_pipeline_one_process(config)])[0]
    return out


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_moe_config_matches_one_process(pool, tmp_path, references, name):
    ref = references[name]
    assert ref[-1] < ref[0]
    results = pool.run(_run, SHIPPED[name], str(tmp_path / "run"))
    for losses, _paths, stats in results:
        torch.testing.assert_close(losses, ref, rtol=1e-4, atol=0)
        assert stats and all(len(s["tokens"]) == 8 for s in stats)
    paths = results[0][1]
    assert Path(paths["expert_load"]).exists()  # rank 0 wrote the heat map


@pytest.mark.parametrize("name", ["deepseek_v3_ep2_fsdp2", "qwen3_moe_pp2_ep2"])
def test_moe_kill_and_resume(pool, tmp_path, name):
    config = SHIPPED[name]
    straight = pool.run(_run, config, str(tmp_path / "a"))[0][0]
    assert pool.run(_run, config, str(tmp_path / "b"), (), 10) == [None] * 4  # killed at 10
    resumed = pool.run(_run, config, str(tmp_path / "b"))  # from the checkpoint at step 8
    for losses, _, _ in resumed:
        assert losses == straight


def _train_and_export(path):
    """Train a few steps at EP 2 x FSDP 2, export with save_pretrained (collective), and return
    the sharded model's logits on fixed tokens."""
    from hp_trainer.models import save_pretrained

    cfg = load_config(
        CONFIGS / SHIPPED["deepseek_v3_ep2_fsdp2"],
        [
            *FAST,
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            path + "_dump",
        ],
    )
    trainer = LLMTrainer(cfg)
    trainer.train()
    save_pretrained(trainer.model, path)
    trainer.model.eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return trainer.model(ids)


def test_trained_sharded_model_loads_in_transformers(pool, tmp_path):
    transformers = pytest.importorskip("transformers")
    from hp_trainer.models import from_pretrained

    path = str(tmp_path / "hf")
    logits = pool.run(_train_and_export, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours = from_pretrained(path).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
    for got in logits:  # the export holds the trained, sharded model's weights
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _etp_bf16(dump):
    """Expert tensor parallelism leaves the experts out of FSDP: they must still compute in
    the bfloat16 of training.mixed_precision_param (their fp32 parameters get the gradients)."""
    cfg = load_config(
        CONFIGS / SHIPPED["qwen3_5_moe_ep2_tp2"],
        [
            *FAST,
            "--job.dump_folder",
            dump,
            "--training.steps",
            "2",
            "--checkpoint.enable",
            "false",
            "--training.mixed_precision_param",
            "bfloat16",
        ],
    )
    trainer = LLMTrainer(cfg)
    seen = set()
    for name, m in trainer.model.named_modules():
        if name.endswith("moe.experts"):
            m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    losses = trainer.train()
    weights = {p.dtype for n, p in trainer.model.named_parameters() if "experts" in n}
    return losses, seen, weights


def test_expert_tensor_parallel_experts_honour_param_dtype(pool, tmp_path):
    for losses, seen, weights in pool.run(_etp_bf16, str(tmp_path / "bf16")):
        assert seen == {torch.bfloat16} and weights == {torch.float32}
        assert losses[-1] < losses[0]


def test_pipeline_stage_without_moe_layers(tmp_path):
    """DeepSeek-V3 (no MTP) over 3 pipeline stages: the first holds only the dense block, so it
    has no MoE to balance; the run still equals one process (its microbatches as the
    pipeline's)."""
    from hp_testing import run_ranks

    common = [
        "--model.mtp_layers",
        "0",
        "--checkpoint.enable",
        "false",
        "--training.steps",
        "6",
    ]
    pp = [
        "--parallelism.pipeline_parallel_degree",
        "3",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.expert_parallel_degree",
        "1",
        "--parallelism.pipeline_microbatches",
        "2",
    ]
    config = SHIPPED["deepseek_v3_ep2_fsdp2"]
    ref = _run(config, str(tmp_path / "one"), [*ONE, *common, "--training.local_batch_size", "4"])
    results = run_ranks(_run, 3, args=(config, str(tmp_path / "pp3"), [*common, *pp]), timeout=300)
    for losses, _, stats in results:
        torch.testing.assert_close(losses, ref[0], rtol=1e-4, atol=0)
        assert [s["layer"] for s in stats] == ["layers.1", "layers.2"]
        assert [s["tokens"] for s in stats] == [s["tokens"] for s in ref[2]]


def _cp_moe(dump, aux_type, extra):
    cfg = load_config(
        None,
        [
            *FAST,
            "--job.dump_folder",
            dump,
            "--training.steps",
            "8",
            "--checkpoint.enable",
            "false",
            "--model.name",
            "qwen3-moe-tiny",
            "--moe.load_balance_coeff",
            "0.001",
            "--moe.aux_loss_coeff",
            "0.01",
            "--moe.aux_loss_type",
            aux_type,
            *extra,
        ],
    )
    trainer = LLMTrainer(cfg)
    return trainer.train(), trainer.moe_statistics()


CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree"]


@pytest.mark.parametrize("aux_type", ["sequence", "global", "batch"])
def test_moe_under_context_parallelism(pool, tmp_path, aux_type):
    """Qwen3-MoE with CP 2 x FSDP 2: the expert bias's counts and the balance loss see the
    whole sequences (summed over the context-parallel ranks). "sequence" and "global" equal
    one process; "batch" (per forward) equals the same data-parallel layout without CP."""
    if aux_type == "batch":
        ref = pool.run(
            _cp_moe,
            str(tmp_path / "fsdp"),
            aux_type,
            [
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        )[0]
    else:
        ref = _cp_moe(str(tmp_path / "one"), aux_type, ONE)
    for got, stats in pool.run(_cp_moe, str(tmp_path / "cp"), aux_type, [*CP2, "2"]):
        torch.testing.assert_close(got, ref[0], rtol=1e-4, atol=0)
        # the last step's statistics: routed tokens and the balance loss itself
        for mine, theirs in zip(stats, ref[1]):
            assert mine["tokens"] == theirs["tokens"]
            assert mine["aux_loss"] == pytest.approx(theirs["aux_loss"], rel=1e-4)
