"""The search: the two 1,024-GPU cases in well under 30 s, every ranked plan one hp-train
accepts (its TOML loads and passes hp-trainer's preflight for the world size), the rejected
families explained, and the error for a GPU count no configuration can use."""

import time

import pytest

from hp_autoparallel import (
    NoPlanError,
    Workload,
    load_cluster,
    load_gpu,
    model_spec,
    search,
    train_config,
)
from hp_trainer import load_config, preflight

H200, CLUSTER = load_gpu("h200"), load_cluster("h200")


def _preflight_ok(tmp_path, result, name: str, *, mtp_layers=None, rows=None):
    """Every ranked plan's TOML loads with hp-trainer's load_config and passes its preflight
    for the searched world size, with the degrees multiplying to it."""
    for i, est in enumerate(result.ranked[:rows]):
        text = train_config(
            est,
            model=name,
            global_batch=result.work.global_batch,
            seq_len=result.work.seq_len,
            gpu=result.gpu.name,
            mtp_layers=mtp_layers,
            compute_dtype=result.gpu.compute_dtype,
        )
        path = tmp_path / f"{name}-{i}.toml"
        path.write_text(text)
        cfg = load_config(path)
        p = cfg.parallelism
        degrees = (
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
            p.context_parallel_degree,
        )
        assert p.data_parallel_shard_degree > 0  # resolved, not -1
        prod = 1
        for d in degrees:
            prod *= d
        assert prod == result.gpus, (est.plan, degrees)
        pd, _ = preflight(cfg, result.gpus)
        assert (pd.dp_shard, pd.tp, pd.pp, pd.ep, pd.etp) == (
            est.plan.dp_shard,
            est.plan.tp,
            est.plan.pp,
            est.plan.ep,
            est.plan.etp,
        )
        assert cfg.activation_checkpoint.mode == est.plan.recompute


def _ranked_well(result):
    times = [e.time.total for e in result.ranked]
    assert times == sorted(times)
    designs = {
        (e.plan.tp, e.plan.cp, e.plan.pp, e.plan.ep, e.plan.etp, e.plan.schedule, e.plan.recompute)
        for e in result.ranked
    }
    assert len(designs) == len(result.ranked)  # one row per design
    for e in result.ranked:
        assert e.plan.world == result.gpus
        assert e.memory.peak <= result.gpu.memory


@pytest.fixture(scope="module")
def llama70b():
    t0 = time.perf_counter()
    result = search(model_spec("llama3-70b"), 1024, H200, CLUSTER, Workload(4096, 8192))
    return result, time.perf_counter() - t0


@pytest.fixture(scope="module")
def deepseek():
    t0 = time.perf_counter()
    result = search(model_spec("deepseek-v3-671b"), 1024, H200, CLUSTER, Workload(4096, 8192))
    return result, time.perf_counter() - t0


def test_llama3_70b_on_1024_h200(llama70b, tmp_path):
    result, seconds = llama70b
    assert seconds < 30, f"the search took {seconds:.1f} s"
    assert len(result.ranked) == 10
    _ranked_well(result)
    _preflight_ok(tmp_path, result, "llama3-70b")
    # no pipeline makes the best here: the last stage keeps every microbatch's full-vocabulary
    # logits (2 x m x 8192 x 128256 bf16 values at the concatenation), see test_estimate
    why = result.why()
    assert "tensor parallelism across nodes (8 GPUs per node)" in why
    assert "out of memory even at its leanest" in why and "(by " in why


def test_pipelines_among_the_best_are_simulated():
    result = search(model_spec("llama3-70b"), 32, H200, CLUSTER, Workload(128, 4096))
    assert result.simulated > 0  # pipelines among the best were re-scored by the simulator


def test_deepseek_v3_on_1024_h200(deepseek, tmp_path):
    result, seconds = deepseek
    assert seconds < 30, f"the search took {seconds:.1f} s"
    _ranked_well(result)
    _preflight_ok(tmp_path, result, "deepseek-v3-671b")
    # hp-trainer runs multi-token prediction only without tp, pp and cp; experts need ep > 1
    for e in result.ranked:
        assert (e.plan.tp, e.plan.pp, e.plan.cp) == (1, 1, 1)
    assert result.best.plan.ep > 1
    assert "multi-token prediction is not supported with tensor parallelism" in result.why()


def test_every_ranked_plan_passes_preflight_small_dense(tmp_path):
    result = search(model_spec("llama3-8b"), 16, H200, CLUSTER, Workload(64, 4096), top=10)
    _ranked_well(result)
    _preflight_ok(tmp_path, result, "llama3-8b")
    assert {e.plan.pp > 1 for e in result.ranked} == {True, False}  # pipelines and not


def test_every_ranked_plan_passes_preflight_moe(tmp_path):
    result = search(model_spec("qwen3-30b-a3b"), 32, H200, CLUSTER, Workload(64, 4096), top=10)
    _ranked_well(result)
    _preflight_ok(tmp_path, result, "qwen3-30b-a3b")
    assert any(e.plan.ep > 1 for e in result.ranked)


def test_deepseek_without_mtp_may_pipeline(tmp_path):
    spec = model_spec("deepseek-v3-671b", mtp_layers=0)
    result = search(spec, 256, H200, CLUSTER, Workload(512, 4096), top=5)
    _ranked_well(result)
    _preflight_ok(tmp_path, result, "deepseek-v3-671b", mtp_layers=0)
    # without MTP the pipelined families are open and rank; with it every one is refused
    assert any(e.plan.pp > 1 for e in result.ranked)
    with_mtp = search(model_spec("deepseek-v3-671b"), 256, H200, CLUSTER, Workload(512, 4096))
    assert all(e.plan.pp == 1 for e in with_mtp.ranked)


def test_cpu_ranks_plan_in_float32(tmp_path):
    cpu = load_gpu("cpu")
    result = search(model_spec("llama3-tiny"), 4, cpu, load_cluster("cpu"), Workload(8, 128))
    _preflight_ok(tmp_path, result, "llama3-tiny")
    text = train_config(
        result.best,
        model="llama3-tiny",
        global_batch=8,
        seq_len=128,
        gpu="cpu",
        compute_dtype=cpu.compute_dtype,
    )
    assert 'mixed_precision_param = "float32"' in text


def test_no_configuration_names_the_nearest_gpu_count():
    # 70.6 B parameters x 16 bytes of fp32 state need more than 8 H200s; 7 GPUs also divide
    # neither the heads nor the batch
    with pytest.raises(
        NoPlanError, match=r"--gpus 7: .* nearest GPU count with a plan is --gpus 16"
    ) as e:
        search(model_spec("llama3-70b"), 7, H200, CLUSTER, Workload(4096, 8192))
    msg = str(e.value)
    assert "does not divide the model's 8 key/value heads" in msg
    assert "global_batch_size=4096 is not divisible by the data parallel degree 7" in msg


def test_swap_variants_over_host_memory_are_rejected_with_a_reason():
    import dataclasses

    tiny_host = dataclasses.replace(H200, host_memory=1 * 2**30)
    result = search(model_spec("llama3-8b"), 8, tiny_host, CLUSTER, Workload(64, 8192))
    assert all(e.plan.recompute != "swap" for e in result.ranked)
    assert "host_memory_gib = 1.0" in result.why()


def test_replication_alone_is_a_family_and_replicated_tp_is_not(tmp_path):
    """dp_replicate over every data-parallel rank (hp-trainer's HSDP over a shard group of
    one) is generated, estimated and written as a TOML hp-train's preflight accepts;
    dp_replicate > 1 with tp > 1, which ParallelDims refuses, is never generated."""
    from hp_autoparallel import Plan, estimate
    from hp_autoparallel._search import _families

    cpu, cluster = load_gpu("cpu"), load_cluster("cpu")
    spec, work = model_spec("llama3-tiny"), Workload(8, 128)
    fams = list(_families(spec, 4, work, cluster, 4, []))
    assert any((f.dp_replicate, f.dp_shard, f.tp, f.cp) == (4, 1, 1, 1) for f in fams)
    assert any(f.dp_replicate > 1 for f in fams) and not any(
        f.dp_replicate > 1 and f.tp > 1 for f in fams
    )
    est = estimate(spec, Plan(4, 1), work, cpu, cluster)
    text = train_config(
        est, model="llama3-tiny", global_batch=8, seq_len=128, gpu="cpu", compute_dtype="float32"
    )
    path = tmp_path / "replicate.toml"
    path.write_text(text)
    pd, _ = preflight(load_config(path), 4)
    assert (pd.dp_replicate, pd.dp_shard) == (4, 1)
