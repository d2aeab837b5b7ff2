"""Parallel styles refuse a mesh of the other framework before touching the module (every
style goes through the same check)."""

import types

import pytest
import torch.nn as nn

from hp_dtensor import MeshError
from hp_dtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


@pytest.mark.parametrize(
    "style", [ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput()]
)
def test_torch_module_with_a_mindspore_mesh_is_refused(style):
    mesh = types.SimpleNamespace(ndim=1, framework="mindspore")
    lin = nn.Linear(4, 4)
    with pytest.raises(MeshError, match="torch module but the mesh was built for 'mindspore'"):
        style.validate(lin, mesh, "fc")
    assert not hasattr(lin.weight, "placements")  # nothing moved
