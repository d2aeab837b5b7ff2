"""Single-process pieces: backend protocol, deferred-init context managers, the rule table."""

import torch
import torch.nn as nn

import hp_dtensor as hp
from hp_dtensor import Call, Partial, Replicate, Shard, TensorMeta
from hp_dtensor._backend import Platform
from hp_dtensor._backend._torch import TorchPlatform
from hp_dtensor._rules import get_sharding_rule


def test_torch_platform_implements_the_protocol():
    assert isinstance(TorchPlatform(), Platform)


def test_init_contexts_place_parameters():
    with hp.init_empty_weights():
        m = nn.Linear(3, 4)
    assert m.weight.device.type == "meta"
    with hp.init_on_device("cpu"):
        m = nn.Linear(3, 4)
    assert m.weight.device.type == "cpu"


def _call(name, metas, args=None, kwargs=None, mesh=(4,)):
    return Call(name, tuple(args if args is not None else metas), kwargs or {}, mesh, list(metas))


def test_rules_are_pure_and_pick_communication_free_strategies():
    S0, S1, R, P = (Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)
    mm = get_sharding_rule("mm")
    st = mm(_call("mm", [TensorMeta((8, 6), S1), TensorMeta((6, 4), S0)]))
    assert st.inputs == [None, None] and st.output == P
    st = mm(_call("mm", [TensorMeta((8, 6), S0), TensorMeta((6, 4), S0)]))
    assert st.output in (S0, P)  # one input must move; either plan is valid
    add = get_sharding_rule("add")
    st = add(_call("add", [TensorMeta((8, 6), P), TensorMeta((6,), R)]))
    assert st.inputs == [None, P] and st.output == P  # the replicated bias is partitioned
    s = get_sharding_rule("sum")
    st = s(_call("sum", [TensorMeta((8, 6), S0)], args=[TensorMeta((8, 6), S0), 1]))
    assert st.output == S0
    sm = get_sharding_rule("softmax")
    st = sm(_call("softmax", [TensorMeta((8, 6), S1)], args=[TensorMeta((8, 6), S1), -1]))
    assert st.inputs == [R] and st.output == R


def test_registry_accepts_user_rules():
    @hp.register_sharding_rule("my_op_for_test")
    def rule(call):
        return hp.Strategy([None], call.tensors[0].placements)

    assert "my_op_for_test" in hp.registered_ops()
    assert get_sharding_rule("my_op_for_test") is rule
    assert len(hp.registered_ops()) > 300


def test_no_framework_imports_in_the_neutral_core():
    import ast
    import pathlib

    root = pathlib.Path(hp.__file__).parent
    pure = ["_placement.py", "_shard_math.py", "_layout.py", "_plan.py"] + [
        str(p.relative_to(root)) for p in (root / "_rules").glob("*.py")
    ]
    for rel in pure:
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in ("torch", "mindspore", "torch_npu", "numpy"), rel
    assert torch.__version__  # the binding side may use torch
