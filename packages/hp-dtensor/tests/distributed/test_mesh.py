"""DeviceMesh, process groups and bad input (4 ranks)."""

import os

import pytest
import torch
import torch.distributed as dist

import hp_dtensor as hp
from hp_dtensor import MeshError, PlacementError, Replicate, Shard, ShardingError
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(4)


def _mesh_queries():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    out = {
        "coord": mesh.get_coordinate(),
        "tp_rank": mesh.get_local_rank("tp"),
        "dp_rank": mesh.get_local_rank("dp"),
        "tp_ranks": hp.get_process_group_ranks(mesh.get_group("tp")),
        "dp_ranks": hp.get_process_group_ranks(mesh.get_group("dp")),
        "size": (mesh.size(), mesh.size("tp")),
        "sub_tp": mesh["tp"].rank_list,
        "sub_both": mesh["dp", "tp"].shape,
        "group_local": hp.get_group_local_rank(mesh.get_group("tp")),
        "backend": hp.get_backend(mesh.get_group("tp")),
    }
    # groups are created once: the same ranks give the same group object
    assert mesh["tp"].get_group() is mesh.get_group("tp")
    assert hp.new_group(out["tp_ranks"]) is mesh.get_group("tp")
    again = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert again.get_group("dp") is mesh.get_group("dp")
    flat = mesh["dp", "tp"].flatten("dp_tp")
    out["flat"] = (flat.shape, flat.get_local_rank(), mesh["dp_tp"].rank_list)
    total = torch.ones(1)
    dist.all_reduce(total, group=flat.get_group())
    out["flat_sum"] = total.item()
    assert r in out["tp_ranks"]
    return out


def test_mesh_queries(pool):
    res = pool.run(_mesh_queries)
    assert [x["coord"] for x in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [x["tp_ranks"] for x in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [x["dp_ranks"] for x in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [x["tp_rank"] for x in res] == [0, 1, 0, 1]
    assert [x["group_local"] for x in res] == [0, 1, 0, 1]
    assert res[3]["sub_tp"] == (2, 3) and res[0]["sub_both"] == (2, 2)
    assert all(x["size"] == (4, 2) for x in res)
    assert [x["flat"] for x in res] == [((4,), i, (0, 1, 2, 3)) for i in range(4)]
    assert all(x["flat_sum"] == 4.0 for x in res)
    assert res[0]["backend"] == "gloo"


def _split():
    g = hp.split_group(None, [[0, 3], [1, 2]])
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=g)
    return hp.get_process_group_ranks(g), t.item()


def test_split_group(pool):
    assert pool.run(_split) == [([0, 3], 3.0), ([1, 2], 3.0), ([1, 2], 3.0), ([0, 3], 3.0)]


def _errors():
    msgs = {}

    def catch(key, exc, fn):
        try:
            fn()
        except exc as e:
            msgs[key] = str(e)

    catch("mesh_shape", MeshError, lambda: hp.init_device_mesh("cpu", (3, 2)))
    catch("names", MeshError, lambda: hp.init_device_mesh("cpu", (4,), mesh_dim_names=("a", "b")))
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    catch("no_dim", MeshError, lambda: mesh["pp"])
    catch("get_group", MeshError, lambda: mesh.get_group())
    x = torch.randn(4, 6)
    catch(
        "too_many",
        PlacementError,
        lambda: hp.distribute_tensor(x, mesh, [Shard(0), Shard(1), Replicate()]),
    )
    catch("dim_range", PlacementError, lambda: hp.distribute_tensor(x, mesh, [Shard(2)]))
    catch(
        "from_local_dim",
        PlacementError,
        lambda: hp.DTensor.from_local(x, mesh, [Replicate(), Shard(5)]),
    )
    a = hp.distribute_tensor(x, mesh, [Shard(0), Replicate()])
    b = hp.distribute_tensor(x, mesh["tp"], [Shard(0)])
    catch("meshes", ShardingError, lambda: a + b)
    catch("mixed", ShardingError, lambda: a + x)
    catch("seed", ShardingError, lambda: hp.manual_seed(dist.get_rank(), mesh))
    # the group still works after all this: no rank was left inside a collective
    t = torch.ones(1)
    dist.all_reduce(t)
    msgs["alive"] = t.item()
    return msgs


def test_bad_input_raises_clear_errors_before_collectives(pool):
    for m in pool.run(_errors):
        assert "mesh_shape=(3, 2) holds 6 ranks but the world has 4" in m["mesh_shape"]
        assert "mesh_dim_names" in m["names"]
        assert "'pp' does not exist" in m["no_dim"]
        assert "mesh_dim is required" in m["get_group"]
        assert "placements=" in m["too_many"] and "3 entries" in m["too_many"]
        assert "Shard(2) is out of range" in m["dim_range"]
        assert "Shard(5) is out of range" in m["from_local_dim"]
        assert "different meshes" in m["meshes"]
        assert "mix of DTensor and torch.Tensor" in m["mixed"]
        assert "different seeds" in m["seed"]
        assert m["alive"] == 4.0


def test_init_process_group_names_missing_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(MeshError, match="torchrun"):
        hp.init_process_group()
    assert "RANK" not in os.environ


def test_backend_selection_is_explicit(monkeypatch):
    from hp_dtensor import BackendError, get_platform

    monkeypatch.delenv("HP_BACKEND", raising=False)
    assert get_platform("cpu").name == "torch"
    monkeypatch.setenv("HP_BACKEND", "nope")
    with pytest.raises(BackendError, match="HP_BACKEND='nope'"):
        get_platform("cpu")
    monkeypatch.setenv("HP_BACKEND", "mindspore")
    try:
        import mindspore  # noqa: F401
    except ImportError:
        with pytest.raises(BackendError, match="mindspore"):
            get_platform("cpu")
    monkeypatch.delenv("HP_BACKEND")
    with pytest.raises(BackendError, match="device_type='tpu'"):
        get_platform("tpu")
    import sys

    assert "torch_npu" not in sys.modules


def _layout_api():
    lay = hp.Layout((2, 2), ("dp", "tp"))
    full = torch.arange(42.0).reshape(7, 6)
    x = hp.distribute_tensor(full, lay(("dp", "tp"), "None"))
    assert x.placements == (Shard(0), Shard(0))
    assert x.device_mesh.mesh_dim_names == ("dp", "tp")
    assert x.layout == hp.Layout((2, 2), ("dp", "tp"))(("dp", "tp"), "None")
    torch.testing.assert_close(x.full_tensor(), full)
    y = hp.DTensor.from_local(x.to_local(), lay(("dp", "tp"), "None"), shape=(7, 6))
    torch.testing.assert_close(y.full_tensor(), full)
    # run_check: the global shape of uneven shards comes from every rank's local shape, and
    # replicated values are taken from the first rank of the mesh dimension
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = [4, 3][mesh.get_local_rank("dp")]
    local = torch.full((rows, 2), float(dist.get_rank()))
    z = hp.DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=True)
    return tuple(z.shape), z.to_local()[0, 0].item()


def test_layout_and_run_check(pool):
    res = pool.run(_layout_api)
    assert [s for s, _ in res] == [(7, 2)] * 4
    # along tp (mesh dim 1) rank 1 takes rank 0's values and rank 3 takes rank 2's
    assert [v for _, v in res] == [0.0, 0.0, 2.0, 2.0]


def _adopt():
    r = dist.get_rank()
    theirs = dist.new_group([0, 1, 2])  # made outside hp_dtensor (every rank takes part)
    other = dist.new_group([0, 1, 2])  # a second group over the same ranks
    out = {}
    if r < 3:
        hp.mark_created_groups([theirs])
        hp.mark_created_groups(theirs)  # the same group again: nothing changes
        out["reused"] = hp.new_group([2, 1, 0]) is theirs
        out["listed"] = hp._groups.created_groups()[(0, 1, 2)] is theirs
        with pytest.raises(MeshError, match=r"groups\[0\] spans ranks \[0, 1, 2\]"):
            hp.mark_created_groups(other)
        t = torch.ones(1)
        dist.all_reduce(t, group=hp.new_group([0, 1, 2]))
        out["sum"] = t.item()
    with pytest.raises(MeshError, match=r"groups\[1\] \(str\) is not a process group"):
        hp.mark_created_groups([dist.group.WORLD, "dp"])
    return out


def test_mark_created_groups_adopts_outside_groups(pool):
    res = pool.run(_adopt)
    assert res[:3] == [{"reused": True, "listed": True, "sum": 3.0}] * 3
    assert res[3] == {}


def _overlapping():
    r = dist.get_rank()
    out = {}
    # every rank builds both, in the same order; only members make groups, and ranks 1 and 2
    # have made one more group than rank 3 by the time of the second (torch's own naming of
    # such groups then differs between members, and they waited for each other forever)
    for name, ranks in (("a", [0, 1, 2]), ("b", [1, 2, 3]), ("c", [3, 0])):
        mesh = hp.DeviceMesh("cpu", ranks)
        if r in ranks:
            t = torch.tensor([float(r)])
            dist.all_reduce(t, group=mesh.get_group())
            out[name] = t.item()
    return out


def test_meshes_over_overlapping_rank_sets(pool):
    res = pool.run(_overlapping)
    assert res == [
        {"a": 3.0, "c": 3.0},
        {"a": 3.0, "b": 6.0},
        {"a": 3.0, "b": 6.0},
        {"b": 6.0, "c": 3.0},
    ]
