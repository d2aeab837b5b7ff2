"""The (tp, dp) rank grid fully_shard builds for tensor-parallel parameters, on meshes of more
than two dimensions (a pipeline dimension around them, a flattened dp): pure index arithmetic,
checked on stand-in meshes."""

import pytest

from hp_fsdp._param import tp_dp_grid as _tp_dp_grid


class _Root:
    def __init__(self, shape, coord):
        self.shape, self.coord = tuple(shape), tuple(coord)
        self.rank_list = tuple(range(_prod(shape)))
        self.ndim = len(shape)

    def get_coordinate(self):
        return self.coord


class _Sub:
    def __init__(self, root, dims):
        self._root, self._root_dims, self.ndim = root, (tuple(dims),), 1
        self._size = _prod(root.shape[d] for d in dims)

    def size(self):
        return self._size


def _prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


def test_two_d_mesh_is_the_whole_grid():
    root = _Root((2, 3), (1, 2))  # (dp, tp); rank = dp * 3 + tp
    assert _tp_dp_grid(_Sub(root, [1]), _Sub(root, [0])) == [[0, 3], [1, 4], [2, 5]]


def test_pipeline_dimension_stays_at_this_ranks_coordinate():
    # (pp, dp, tp) = (2, 2, 2): rank = pp * 4 + dp * 2 + tp; this rank is in pipeline stage 1
    root = _Root((2, 2, 2), (1, 0, 1))
    assert _tp_dp_grid(_Sub(root, [2]), _Sub(root, [1])) == [[4, 6], [5, 7]]
    root0 = _Root((2, 2, 2), (0, 1, 0))
    assert _tp_dp_grid(_Sub(root0, [2]), _Sub(root0, [1])) == [[0, 2], [1, 3]]


def test_flattened_dp_counts_row_major():
    # (dp_replicate, dp_shard, tp) = (2, 2, 2) with dp flattened over the first two dims
    root = _Root((2, 2, 2), (0, 0, 1))
    assert _tp_dp_grid(_Sub(root, [2]), _Sub(root, [0, 1])) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_meshes_of_different_roots_or_overlapping_are_refused():
    a, b = _Root((2, 2), (0, 0)), _Root((2, 2), (0, 0))
    with pytest.raises(ValueError, match="one DeviceMesh"):
        _tp_dp_grid(_Sub(a, [1]), _Sub(b, [0]))
    with pytest.raises(ValueError, match="overlap"):
        _tp_dp_grid(_Sub(a, [1]), _Sub(a, [1]))
