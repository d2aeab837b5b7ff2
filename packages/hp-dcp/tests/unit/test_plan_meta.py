"""Pure planning and metadata: dedup, balance, consistency checks, read plans, JSON."""

import pytest

from hp_dcp import (
    Chunk,
    Metadata,
    ObjectEntry,
    SavePlanner,
    StateDictError,
    StoredObject,
    TensorEntry,
    WriteItem,
)
from hp_dcp._meta import intersect
from hp_dcp._plan import plan_reads


def _t(key, offsets, sizes, shape, nbytes=None):
    n = (
        nbytes
        if nbytes is not None
        else 4 * (sizes[0] if sizes else 1) * (sizes[1] if len(sizes) > 1 else 1)
    )
    return WriteItem(key, "tensor", n, "float32", shape, offsets, sizes)


def test_replicated_written_once_and_balanced():
    # "w" replicated on 4 ranks, "s" sharded in 4 rows: every box written once, bytes balanced
    items = [[_t("w", (0, 0), (4, 4), (4, 4)), _t("s", (r, 0), (1, 4), (4, 4))] for r in range(4)]
    plan = SavePlanner().plan(items)
    written = [(it.key, it.offsets) for p in plan for it in p]
    assert sorted(written) == [("s", (r, 0)) for r in range(4)] + [("w", (0, 0))]
    loads = [sum(it.nbytes for it in p) for p in plan]
    assert sorted(loads) == [16, 16, 16, 80]


def test_many_replicated_spread_over_ranks():
    # 8 replicated tensors of equal size over 4 ranks: 2 each (torch DCP's first-rank rule
    # would give all to rank 0)
    items = [[_t(f"w{i}", (0,), (10,), (10,), 40) for i in range(8)] for _ in range(4)]
    plan = SavePlanner().plan(items)
    assert [len(p) for p in plan] == [2, 2, 2, 2]


def test_objects_equal_once_differing_per_rank():
    items = [
        [WriteItem("step", "object", 5, digest=7), WriteItem("pos", "object", 5, digest=r)]
        for r in range(3)
    ]
    plan = SavePlanner().plan(items)
    steps = [r for r, p in enumerate(plan) for it in p if it.key == "step"]
    pos = [r for r, p in enumerate(plan) for it in p if it.key == "pos"]
    assert len(steps) == 1 and pos == [0, 1, 2]


def test_inconsistent_shapes_name_the_key():
    items = [[_t("w", (0,), (4,), (8,))], [_t("w", (4,), (4,), (9,))]]
    with pytest.raises(StateDictError, match="'w' differs between ranks.*rank 0.*rank 1"):
        SavePlanner().plan(items)


def test_shards_must_tile():
    items = [[_t("w", (0,), (4,), (10,))], [_t("w", (4,), (4,), (10,))]]
    with pytest.raises(StateDictError, match="'w'.*cover 8 of 10"):
        SavePlanner().plan(items)


def test_intersect_and_read_plan():
    assert intersect((0, 0), (4, 6), (2, 3), (4, 4)) == ((2, 3), (2, 3))
    assert intersect((0,), (4,), (4,), (2,)) is None
    e = TensorEntry(
        "float32",
        (7, 4),
        [Chunk((0, 0), (4, 4), "a", 0, 64), Chunk((4, 0), (3, 4), "b", 0, 48)],
    )
    reads = plan_reads("w", e, (3, 1), (2, 2))
    assert [(r.chunk.file, r.offsets, r.sizes) for r in reads] == [
        ("a", (3, 1), (1, 2)),
        ("b", (4, 1), (1, 2)),
    ]
    e.chunks.pop()
    with pytest.raises(StateDictError, match="holds 2 of the 4 elements of 'w'"):
        plan_reads("w", e, (3, 1), (2, 2))


def test_metadata_json_roundtrip():
    md = Metadata(world_size=2)
    md.tensors["w"] = TensorEntry(
        "bfloat16", (3, 2), [Chunk((0, 0), (3, 2), "f", 8, 12, 99)], "S(0)"
    )
    md.tensors["s"] = TensorEntry("float32", (), [Chunk((), (), "f", 0, 4, 5)])
    md.objects["o"] = ObjectEntry(value=StoredObject("f", 20, 3, 1))
    md.objects["p"] = ObjectEntry(
        per_rank={0: StoredObject("f", 23, 3, 2), 1: StoredObject("g", 0, 3, 4)}
    )
    back = Metadata.from_json(md.to_json())
    assert back.tensors == md.tensors and back.objects == md.objects and back.world_size == 2
    with pytest.raises(ValueError, match="not an hp-dcp checkpoint"):
        Metadata.from_json('{"format": "x"}')
