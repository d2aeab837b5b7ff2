"""ParallelDims: degree arithmetic and one message per problem, before any process group."""

import pytest

from hp_trainer import ParallelDims
from hp_trainer.errors import ConfigError


def test_fill_and_mesh_shape():
    pd = ParallelDims(dp_replicate=2, cp=2, world_size=8)
    assert pd.dp_shard == 2 and pd.dp == 4
    assert pd.mesh_shape() == ((2, 2, 2), ("dp_replicate", "dp_shard", "cp"))
    assert ParallelDims(world_size=1).mesh_shape() == ((1,), ("dp_shard",))
    # replication alone keeps its (dp_replicate, dp_shard) pair: FSDP's 2-D mesh, not 1-D
    rep = ParallelDims(dp_replicate=4, world_size=4)
    assert rep.mesh_shape() == ((4, 1), ("dp_replicate", "dp_shard"))
    assert ParallelDims(dp_replicate=2, cp=2, world_size=4).mesh_shape() == (
        (2, 2),
        ("dp_replicate", "cp"),
    )
    assert ParallelDims(pp=2, dp_shard=2, world_size=4).mesh_shape() == ((2, 2), ("pp", "dp_shard"))


def test_bad_degrees_listed_together():
    with pytest.raises(ConfigError) as e:
        ParallelDims(dp_shard=3, tp=2, world_size=4)
    assert "degrees multiply to 6" in str(e.value) and "data_parallel_shard_degree = -1" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="world size 6 is not divisible by .* = 4"):
        ParallelDims(tp=4, world_size=6)
    with pytest.raises(ConfigError) as e:
        ParallelDims(tp=0, pp=-2, world_size=4)
    assert str(e.value).count("\n") == 1  # two problems, two lines
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree=3"):
        ParallelDims(tp=2, etp=3, world_size=4)
    with pytest.raises(ConfigError, match="expert_parallel_degree=3 must divide"):
        ParallelDims(ep=3, world_size=4)
    # replicated (or HSDP) parameters do not compose with TP's DTensors in hp_fsdp: refused
    # here, before any process group, with the sharded layout of the same ranks as the fix
    for shard in (1, 2):
        with pytest.raises(
            ConfigError,
            match=f"replicate_degree=2 with .*tensor_parallel_degree=2.*shard_degree = {2 * shard}",
        ):
            ParallelDims(dp_replicate=2, dp_shard=shard, tp=2, world_size=4 * shard)


def test_model_checks():
    pd = ParallelDims(tp=4, pp=2, cp=2, world_size=32)
    with pytest.raises(ConfigError) as e:
        pd.check_model(
            n_heads=6, n_kv_heads=2, n_layers=1, global_batch_size=3, seq_len=6, num_experts=3
        )
    lines = str(e.value).splitlines()
    assert len(lines) == 5
    assert "tensor_parallel_degree=4 does not divide the model's 6 attention heads" in lines[0]
    assert "2 key/value heads" in lines[1]
    assert "pipeline_parallel_degree=2" in lines[2] and "1 layers" in lines[2]
    assert "global_batch_size=3" in lines[3] and "training.seq_len=6" in lines[4]
    ParallelDims(tp=2, world_size=2).check_model(n_heads=4, n_kv_heads=2, n_layers=2)


def test_pipeline_stages_balanced_with_the_output_cost():
    from hp_trainer._pipeline import layer_ranges
    from hp_trainer.models import get_config

    # Llama 3 8B on 4 stages: the 128K-vocabulary output weighs ~3 blocks, so the last stage
    # takes fewer blocks than the others
    ranges = layer_ranges(get_config("llama3-8b"), 4)
    sizes = [hi - lo for lo, hi in ranges]
    assert sum(sizes) == 32 and ranges[0][0] == 0 and ranges[-1][1] == 32
    assert sizes[-1] < min(sizes[:-1])
    assert layer_ranges(get_config("llama3-tiny"), 2) == [(0, 1), (1, 2)]
    with pytest.raises(ConfigError, match="4 pipeline stages for 2 layers"):
        layer_ranges(get_config("llama3-tiny"), 4)


def test_expert_parallel_degrees():
    pd = ParallelDims(dp_shard=4, ep=2, world_size=4)
    assert pd.expert_mesh_shape() == ((2, 2), ("efsdp", "ep"))
    pd = ParallelDims(pp=2, tp=2, dp_shard=2, ep=2, etp=2, world_size=8)
    assert pd.expert_mesh_shape() == ((2, 1, 2, 2), ("pp", "efsdp", "ep", "tp"))
    with pytest.raises(ConfigError) as e:
        ParallelDims(dp_shard=2, tp=2, ep=4, world_size=4)
    assert "expert_parallel_degree=4 must divide parallelism.data_parallel_shard_degree = 2" in (
        str(e.value)
    )
    with pytest.raises(ConfigError, match="shards each expert over ep x tp already"):
        ParallelDims(dp_shard=4, tp=2, ep=2, etp=2, world_size=8)
    with pytest.raises(ConfigError, match="context_parallel_degree=2 is not supported"):
        ParallelDims(dp_shard=2, cp=2, ep=2, world_size=4)
    with pytest.raises(ConfigError) as e:  # refused before any process group exists
        ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=4)
    assert "expert_parallel_degree=2 with parallelism.data_parallel_replicate_degree=2" in str(
        e.value
    )
    assert "set parallelism.data_parallel_replicate_degree = 1" in str(e.value)
    pd = ParallelDims(dp_shard=4, ep=2, tp=1, world_size=4)
    with pytest.raises(ConfigError) as e:
        pd.check_model(n_heads=4, n_kv_heads=2, n_layers=2, num_experts=7)
    assert "expert_parallel_degree=2 does not divide the 7 experts" in str(e.value)
    with pytest.raises(ConfigError, match="the model has no MoE layers to split"):
        pd.check_model(n_heads=4, n_kv_heads=2, n_layers=2)
    pd = ParallelDims(dp_shard=2, tp=2, etp=2, world_size=4)
    with pytest.raises(ConfigError, match="does not divide the experts' hidden width 5"):
        pd.check_model(n_heads=4, n_kv_heads=2, n_layers=2, num_experts=4, expert_hidden=5)


def test_moe_pipeline_stages_weigh_active_compute():
    from hp_trainer._pipeline import layer_ranges
    from hp_trainer.models import get_config

    # DeepSeek-V3: 3 dense blocks, then 58 MoE blocks holding 256 experts but computing 9
    cfg = get_config("deepseek-v3-671b", mtp_layers=0)
    ranges = layer_ranges(cfg, 8)
    sizes = [hi - lo for lo, hi in ranges]
    assert sum(sizes) == 61 and ranges[-1][1] == 61
    assert max(sizes) - min(sizes) <= 3
