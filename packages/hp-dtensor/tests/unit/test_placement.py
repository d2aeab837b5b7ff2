import pytest
import torch

from hp_dtensor import Partial, PlacementError, Replicate, Shard, chunk_size_and_offset
from hp_dtensor._placement import normalize_placements
from hp_dtensor._shard_math import is_evenly_sharded, local_shape_and_offset


def test_placements_are_values():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert hash(Shard(1)) == hash(Shard(1))
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum") != Partial("max")
    assert {Shard(0), Shard(0), Replicate()} == {Shard(0), Replicate()}
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # frozen


def test_repr_and_str():
    assert repr(Shard(2)) == "Shard(dim=2)" and str(Shard(2)) == "S(2)"
    assert repr(Replicate()) == "Replicate()" and str(Replicate()) == "R"
    assert repr(Partial("avg")) == "Partial(reduce_op='avg')" and str(Partial()) == "P(sum)"


def test_bad_placements():
    with pytest.raises(PlacementError, match="reduce_op"):
        Partial("mul")
    with pytest.raises(PlacementError, match="dim"):
        Shard("0")
    with pytest.raises(PlacementError, match="placements=.*2 entries.*1 dimension"):
        normalize_placements([Shard(0), Shard(1)], 1, 2)
    with pytest.raises(PlacementError, match=r"Shard\(2\) is out of range"):
        normalize_placements([Shard(2)], 1, 2)
    with pytest.raises(PlacementError, match="not a placement"):
        normalize_placements(["S(0)"], 1, 2)


def test_normalize_fills_and_wraps():
    assert normalize_placements([Shard(-1)], 2, 3) == (Shard(2), Replicate())


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunks_match_torch_chunk(size, n):
    t = torch.arange(size)
    pieces = list(torch.chunk(t, n)) if size else []
    pieces += [t[:0]] * (n - len(pieces))
    for i in range(n):
        length, start = chunk_size_and_offset(size, n, i)
        assert t[start : start + length].tolist() == pieces[i].tolist()


def test_nested_local_shape_and_offset():
    # dim 0 of size 7 split over mesh dim 0 (2) then mesh dim 1 (2): 4,3 -> 2,2 | 2,1
    shapes = {}
    for c0 in range(2):
        for c1 in range(2):
            shapes[(c0, c1)] = local_shape_and_offset(
                (7, 3), (2, 2), (c0, c1), (Shard(0), Shard(0))
            )
    assert shapes[(0, 0)] == ((2, 3), (0, 0))
    assert shapes[(0, 1)] == ((2, 3), (2, 0))
    assert shapes[(1, 0)] == ((2, 3), (4, 0))
    assert shapes[(1, 1)] == ((1, 3), (6, 0))
    assert is_evenly_sharded((8, 3), (2, 2), (Shard(0), Shard(0)))
    assert not is_evenly_sharded((6, 3), (2, 2), (Shard(0), Shard(0)))
