import pytest

from hp_dtensor import Layout, LayoutError, Partial, Replicate, Shard


def test_call_syntax_and_placements():
    lay = Layout((2, 2), ("dp", "tp"))
    assert lay("dp", "None").to_placements() == (Shard(0), Replicate())
    assert lay("None", "tp").to_placements() == (Replicate(), Shard(1))
    assert lay(("dp", "tp"), "None").to_placements() == (Shard(0), Shard(0))
    assert lay("tp", "dp").to_placements() == (Shard(1), Shard(0))
    assert lay("None", "None").with_partial("tp").to_placements() == (Replicate(), Partial())


def test_layout_is_immutable_value():
    base = Layout((2, 4), ("dp", "tp"))
    bound = base("dp", "tp")
    assert base.tensor_map is None and bound.tensor_map == (("dp",), ("tp",))
    assert bound == Layout((2, 4), ("dp", "tp"))("dp", "tp")
    assert hash(bound) == hash(Layout((2, 4), ("dp", "tp"))("dp", "tp"))


def test_round_trips():
    lay = Layout((2, 2, 2), ("dp", "cp", "tp"), rank_list=range(7, -1, -1))(("dp", "cp"), "tp")
    assert Layout.from_dict(lay.to_dict()) == lay
    again = Layout.from_placements(
        lay.mesh_shape, lay.alias_names, lay.to_placements(), 2, lay.rank_list
    )
    assert again == lay
    p = Layout((2,), ("tp",))("None").with_partial("tp", "max")
    assert Layout.from_dict(p.to_dict()).to_placements() == (Partial("max"),)


def test_errors_name_the_problem():
    lay = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(LayoutError, match="'xx'.*not a mesh axis"):
        lay("xx", "None")
    with pytest.raises(LayoutError, match="'dp' is used by tensor dims 0 and 1"):
        lay("dp", "dp")
    with pytest.raises(LayoutError, match="not in mesh order"):
        lay(("tp", "dp")).to_placements()
    with pytest.raises(LayoutError, match="one name per axis"):
        Layout((2, 2), ("dp",))
    with pytest.raises(LayoutError, match="unique"):
        Layout((2, 2), ("dp", "dp"))
    with pytest.raises(LayoutError, match="not bound"):
        lay.to_placements()
    with pytest.raises(LayoutError, match="rank_list"):
        Layout((2, 2), ("a", "b"), rank_list=[0, 1, 2])
