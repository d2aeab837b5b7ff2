"""LLMTrainer on 4 CPU ranks: FSDP 2 x TP 2 (also with async TP), HSDP 2 x 2 (with the fused
output projection and loss), PP 2 x FSDP 2
(1F1B, activation checkpointing), PP 2 x TP 2 (GPipe) and context parallelism (CP 2 x FSDP 2
ring, CP 2 x TP 2 all-gather, CP 4 Ulysses, PP 2 x CP 2, Qwen3.5 under CP 2 x FSDP 2; activation
checkpointing under CP;
FSDP 4 with CPU offload and a swap / selective-recomputation plan) give the one-process losses
(within 1e-4) with accumulation, clipping and the LR schedule in the loop; async TP runs
hp-kernels' MC2; a run killed after a checkpoint resumes with the uninterrupted run's losses;
the hp-train CLI end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hp_testing.pytest_plugin import rank_pool_fixture
from hp_trainer import Callback, LLMTrainer, load_config

pool = rank_pool_fixture(4)
CONFIGS = Path(__file__).parents[2] / "configs"
FAST = [
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "10",
    "--training.local_batch_size",
    "1",
    "--checkpoint.interval",
    "4",
    "--metrics.tensorboard",
    "false",
]


def _losses(dump, parallel, kill_at=None):
    class Kill(Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

    cfg = load_config(None, [*FAST, "--job.dump_folder", dump, *parallel])
    try:
        return LLMTrainer(cfg, callbacks=[Kill()]).train()
    except KeyboardInterrupt:
        return None


PAR = {
    "fsdp2xtp2": "--parallelism.data_parallel_shard_degree 2 "
    "--parallelism.tensor_parallel_degree 2",
    # async TP: the row-parallel projections' reduce-scatters and the output head's gather
    # fused into their matmuls (hp-kernels' MC2 through shared memory)
    "fsdp2xtp2-async": "--parallelism.data_parallel_shard_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.async_tp true",
    # HSDP with the output projection and the loss fused (inside the root's forward, where
    # FSDP has gathered the output weight)
    "hsdp2x2-fused-loss": "--parallelism.data_parallel_replicate_degree 2 "
    "--parallelism.data_parallel_shard_degree 2 --training.fused_loss true",
    # replication with nothing to shard over: whole parameters, gradients all-reduced
    "replicate2xpp2": "--parallelism.data_parallel_replicate_degree 2 "
    "--parallelism.data_parallel_shard_degree 1 --parallelism.pipeline_parallel_degree 2 "
    "--parallelism.pipeline_microbatches 2 --training.local_batch_size 0",
    "pp2xfsdp2-ac": "--parallelism.pipeline_parallel_degree 2 "
    "--parallelism.data_parallel_shard_degree 2 --parallelism.pipeline_microbatches 2 "
    "--training.local_batch_size 0 --activation_checkpoint.mode full",
    "pp2xtp2-gpipe": "--parallelism.pipeline_parallel_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.pipeline_schedule gpipe "
    "--parallelism.pipeline_microbatches 4 --training.local_batch_size 0",
    # context parallelism: ring under FSDP over dp_shard x cp, all-gather under TP, Ulysses
    # over 4 ranks (2 key/value heads replicated to 4), and under a pipeline
    "cp2xfsdp2-ring-ac": "--parallelism.context_parallel_degree 2 "
    "--parallelism.data_parallel_shard_degree 2 --activation_checkpoint.mode full",
    "cp2xtp2-allgather": "--parallelism.context_parallel_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 "
    "--parallelism.context_parallel_method allgather",
    "cp4-ulysses-no-lb": "--parallelism.context_parallel_degree 4 "
    "--parallelism.data_parallel_shard_degree 1 --parallelism.context_parallel_method ulysses "
    "--parallelism.context_parallel_load_balance false",
    # FSDP 4 with its shards in host memory, blocks 0-1 swapping their activations to host
    # memory and the others recomputing (a per-layer plan)
    "fsdp4-cpu-offload-swap-plan": "--parallelism.fsdp_cpu_offload true "
    "--activation_checkpoint.mode selective --activation_checkpoint.plan layers.0-1=swap",
    "pp2xcp2": "--parallelism.pipeline_parallel_degree 2 "
    "--parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 "
    "--parallelism.pipeline_microbatches 2 --training.local_batch_size 0",
}
PAR = {k: v.split() for k, v in PAR.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(str(tmp_path_factory.mktemp("one")), [])


@pytest.mark.parametrize("layout", sorted(PAR))
def test_losses_match_one_process(pool, tmp_path, reference, layout):
    assert reference[-1] < reference[0] - 0.3
    for got in pool.run(_losses, str(tmp_path / "run"), PAR[layout]):
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=0)


def test_qwen3_5_under_context_parallelism_matches_one_process(pool, tmp_path):
    """Qwen3.5 (Gated DeltaNet and gated attention) in the trainer, fp32, CP 2 (ring) x FSDP
    2: the Gated DeltaNet layers take their conv halo and recurrent state from the previous
    rank, and the losses are the one-process ones, with accumulation, clipping and the LR
    schedule in the loop."""
    qwen = ["--model.name", "qwen3.5-tiny"]
    ref = _losses(str(tmp_path / "one"), qwen)
    assert ref[-1] < ref[0] - 0.3
    cp = [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ]
    for got in pool.run(_losses, str(tmp_path / "cp"), [*qwen, *cp]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=0)


def test_kill_and_resume(pool, tmp_path):
    straight = pool.run(_losses, str(tmp_path / "a"), PAR["fsdp2xtp2"])
    assert pool.run(_losses, str(tmp_path / "b"), PAR["fsdp2xtp2"], 6) == [None] * 4  # killed at 6
    resumed = pool.run(_losses, str(tmp_path / "b"), PAR["fsdp2xtp2"])  # from step 4
    assert resumed == straight


def _why(stderr: str) -> str:
    """What a failed launch's ranks said (torchrun's own summary, which names only signals,
    comes last and would crowd it out of a plain tail)."""
    keep = [
        ln
        for ln in stderr.splitlines()
        if "torch/distributed/elastic" not in ln and "closing signal" not in ln
    ]
    return "\n".join(keep)[-4000:]


def test_hp_train_cli(tmp_path):
    cfg = CONFIGS / "llama3_tiny_fsdp2_tp2.toml"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "hp_trainer.train",
        "--config",
        str(cfg),
        "--nproc",
        "4",
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--checkpoint.interval",
        "2",
    ]
    args = [*base, "--training.steps", "4"]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, _why(out.stderr)
    assert f"plot: {tmp_path / 'loss.png'}" in out.stdout and "checkpoint:" in out.stdout
    assert (tmp_path / "checkpoint" / "step-4" / "metadata.json").exists()
    again = subprocess.run(
        [*base, "--training.steps", "6"], capture_output=True, text=True, env=env, timeout=300
    )
    assert again.returncode == 0, _why(again.stderr)
    assert "resumed from" in again.stdout and "at step 4" in again.stdout
    # bad configs: one line naming the key, exit status 2, no process started
    for extra, message in [
        (["--parallelism.tensor_parallel_degree", "3"], "degrees multiply to 6"),
        (
            ["--nproc", "6", "--parallelism.tensor_parallel_degree", "3"],
            "parallelism.tensor_parallel_degree=3 does not divide the model's 4 attention heads",
        ),
        (["--training.stepz", "3"], "unknown config key 'training.stepz'"),
    ]:
        bad = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("hp-train: " + message[:10]), (
            bad.stderr
        )
        assert message in bad.stderr
        assert all("parallelism." in ln or "config key" in ln for ln in bad.stderr.splitlines())


def _mc2_calls(dump):
    from hp_kernels import mc2

    calls = {"ag": 0, "rs": 0}
    ag, rs = mc2.all_gather_matmul, mc2.matmul_reduce_scatter

    def count_ag(*a, **k):
        calls["ag"] += 1
        return ag(*a, **k)

    def count_rs(*a, **k):
        calls["rs"] += 1
        return rs(*a, **k)

    mc2.all_gather_matmul, mc2.matmul_reduce_scatter = count_ag, count_rs
    try:
        args = [*FAST, "--training.steps", "1", "--job.dump_folder", dump]
        args += PAR["fsdp2xtp2-async"] + ["--training.local_batch_size", "0"]
        LLMTrainer(load_config(None, args)).train()
    finally:
        mc2.all_gather_matmul, mc2.matmul_reduce_scatter = ag, rs
    return calls


def test_async_tp_runs_the_mc2_kernels(pool, tmp_path):
    # one step, one microbatch, 2 blocks: forward reduce-scatters wo and w2 of each block and
    # gathers the output head's input (5 calls), backward the other way round
    assert pool.run(_mc2_calls, str(tmp_path)) == [{"ag": 5, "rs": 5}] * 4
