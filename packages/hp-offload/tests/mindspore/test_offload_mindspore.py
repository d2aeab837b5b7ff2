"""hp_offload's checkpoint and swap on MindSpore cells, in one process (PyNative, CPU).

A stack of Llama-style blocks (``ms_llama.Block``, hp-dtensor's MindSpore test model), each
followed by a probe: the block's output times a tensor of ones made with
``Tensor.from_numpy``, so MindSpore's autograd saves a tensor whose memory is a numpy array
we can watch through a weakref. Without checkpoint or swap the graph holds every probe from
forward to backward (the control); with either it must hold none. Gradients must equal the
run without them.

Skipped where MindSpore is not installed (``nox -s tests_mindspore`` installs it).
"""

from __future__ import annotations

import gc
import math
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (nox -s tests_mindspore)")

from mindspore import nn  # noqa: E402

from hp_offload import (  # noqa: E402
    CheckpointPolicy,
    OffloadError,
    OffloadTypeError,
    OffloadUnsupportedError,
    SwapManager,
    SwapPolicy,
    checkpoint,
    checkpoint_wrapper,
    swap,
    swap_wrapper,
)

# the MindSpore Llama block of hp-dtensor's MindSpore tests (one model for every package)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "hp-dtensor" / "tests" / "mindspore"))
from ms_llama import Block  # noqa: E402

B, S, DIM, HEADS, KV, HIDDEN, LAYERS = 2, 8, 32, 4, 2, 48, 3
TOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _cpu():
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)


class Probe(nn.Cell):
    """``x * ones``, the ones a numpy array of ours: the autograd graph saves it (the
    gradient of ``x`` needs it), so the array lives as long as the graph holds the tensor."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def construct(self, x):
        arr = np.ones(x.shape, np.float32)
        self.seen.append(weakref.ref(arr))
        return x * ms.Tensor.from_numpy(arr)


class Layer(nn.Cell):
    def __init__(self, seen):
        super().__init__()
        self.block = Block(DIM, HEADS, KV, HIDDEN)
        self.probe = Probe(seen)

    def construct(self, x, cos, sin):
        return self.probe(self.block(x, cos, sin))


class Net(nn.Cell):
    def __init__(self, seen):
        super().__init__()
        self.layers = nn.CellList([Layer(seen) for _ in range(LAYERS)])

    def construct(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def _weights():
    rng = np.random.default_rng(5)
    net = Net([])
    return {
        p.name: (0.2 * rng.standard_normal(p.shape)).astype(np.float32)
        for p in net.get_parameters()
    }


def _data():
    rng = np.random.default_rng(7)
    hd = DIM // HEADS
    ang = np.arange(S)[:, None] / 10000 ** (np.arange(hd // 2) / (hd // 2))[None]
    ang = np.concatenate([ang, ang], -1)[None, :, None].astype(np.float32)
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    return ms.Tensor(x), ms.Tensor(np.cos(ang)), ms.Tensor(np.sin(ang))


WEIGHTS = None


def _net():
    global WEIGHTS
    if WEIGHTS is None:
        WEIGHTS = _weights()
    seen: list = []
    net = Net(seen)
    for p in net.get_parameters():
        p.set_data(ms.Tensor(WEIGHTS[p.name]))
    return net, seen


def _step(net, seen, forward=None):
    """Loss and gradients of ``net``; also how many probes of this forward are still alive
    between forward and backward."""
    x, cos, sin = _data()
    held = {}

    def loss_fn(x):
        seen.clear()
        out = (forward or net)(x, cos, sin)
        mine = list(seen)  # this forward's probes (a recompute adds its own later)
        gc.collect()
        held["probes"] = sum(r() is not None for r in mine)
        held["made"] = len(mine)
        return (out * out).mean()

    params = net.trainable_params()
    loss, grads = ms.value_and_grad(loss_fn, None, params)(x)
    named = {p.name: g.asnumpy() for p, g in zip(params, grads)}
    return float(loss.asnumpy()), named, held


def _reference():
    net, seen = _net()
    return _step(net, seen)


def _close(got, ref):
    loss, grads, _ = got
    rloss, rgrads, _ = ref
    assert abs(loss - rloss) <= TOL
    assert grads.keys() == rgrads.keys()
    for name in rgrads:
        diff = float(np.abs(grads[name] - rgrads[name]).max())
        assert diff <= TOL, f"{name}: gradient differs by {diff}"


def test_reference_holds_every_probe():
    """The control: without checkpoint or swap the graph keeps each layer's probe."""
    _, _, held = _reference()
    assert held == {"probes": LAYERS, "made": LAYERS}


def test_checkpoint_wrapper_full():
    ref = _reference()
    net, seen = _net()
    names = [p.name for p in net.get_parameters()]
    for i in range(LAYERS):
        net.layers[i] = checkpoint_wrapper(net.layers[i], policy=CheckpointPolicy())
    assert [p.name for p in net.get_parameters()] == names  # names as before wrapping
    assert net.layers[0].block is net.layers[0]._checkpoint_wrapped_module.block
    got = _step(net, seen)
    _close(got, ref)
    assert got[2] == {"probes": 0, "made": LAYERS}  # none held between forward and backward
    got2 = _step(net, seen)  # a second step works the same
    _close(got2, ref)


def test_checkpoint_function():
    ref = _reference()
    net, seen = _net()

    def forward(x, cos, sin):
        for layer in net.layers:
            x = checkpoint(layer, x, cos, sin)
        return x

    got = _step(net, seen, forward)
    _close(got, ref)
    assert got[2]["probes"] == 0


def test_swap_wrapper():
    ref = _reference()
    net, seen = _net()
    manager = SwapManager()
    for i in range(LAYERS):
        net.layers[i] = swap_wrapper(net.layers[i], manager=manager)
    device_after_forward = {}

    base = net.construct

    def forward(x, cos, sin):
        out = base(x, cos, sin)
        device_after_forward["bytes"] = manager.stats.device_bytes
        device_after_forward["out"] = manager.stats.bytes_out
        return out

    got = _step(net, seen, forward)
    _close(got, ref)
    assert got[2] == {"probes": 0, "made": LAYERS}
    # every saved activation left for the host during forward and came back in backward
    assert device_after_forward["bytes"] == 0
    assert device_after_forward["out"] >= LAYERS * B * S * DIM * 4
    stats = manager.step()
    assert stats.bytes_in == stats.bytes_out == device_after_forward["out"]
    assert stats.tensors_out > 3 * LAYERS
    assert stats.transfers_out == LAYERS  # all small here: one fused transfer per region
    pooled = manager.pooled_bytes
    _close(_step(net, seen, forward), ref)  # the pool serves the next step: no new buffers
    manager.step()
    assert manager.pooled_bytes == pooled


def test_region_on_mindspore_swaps_and_refuses_what_it_cannot():
    """SwapManager.region(framework="mindspore") around the whole forward swaps what the
    graph saves (a torch region would see none of it); marking tensors is refused by name."""
    from hp_offload import swap_tensor_wrapper
    from hp_offload.errors import OffloadTypeError, OffloadUnsupportedError

    ref = _reference()
    net, seen = _net()
    manager = SwapManager()

    def forward(x, cos, sin):
        with manager.region(framework="mindspore"):
            return net(x, cos, sin)

    _close(_step(net, seen, forward), ref)
    stats = manager.step()
    assert stats.bytes_out >= LAYERS * B * S * DIM * 4 and stats.bytes_in == stats.bytes_out
    with pytest.raises(OffloadUnsupportedError, match="only_marked"):
        with manager.region(framework="mindspore", only_marked=True):
            pass
    with pytest.raises(OffloadTypeError, match="framework"):
        with manager.region(framework="jax"):
            pass
    with pytest.raises(OffloadUnsupportedError, match="marking MindSpore tensors"):
        swap_tensor_wrapper(ms.Tensor(np.ones(3, np.float32)), manager=manager)


def test_swap_without_fusion_and_mixed_with_checkpoint():
    """Each tensor its own transfer (fuse_below=0); layer 0 swapped, the others checkpointed,
    through the functional forms."""
    ref = _reference()
    net, seen = _net()
    manager = SwapManager()

    def forward(x, cos, sin):
        x = swap(net.layers[0], x, cos, sin, manager=manager, policy=SwapPolicy(fuse_below=0))
        for layer in list(net.layers)[1:]:
            x = checkpoint(layer, x, cos, sin)
        return x

    got = _step(net, seen, forward)
    _close(got, ref)
    assert got[2]["probes"] == 0
    stats = manager.step()
    assert stats.transfers_out == stats.tensors_out > 3
    assert stats.bytes_in == stats.bytes_out


def test_swap_min_bytes_keeps_small_tensors():
    """Tensors under min_bytes stay on the device: the probe (B*S*DIM floats) is held."""
    ref = _reference()
    net, seen = _net()
    manager = SwapManager()
    big = B * S * DIM * 4 + 1
    for i in range(LAYERS):
        net.layers[i] = swap_wrapper(net.layers[i], manager=manager, policy=SwapPolicy(big))
    got = _step(net, seen)
    _close(got, ref)
    assert got[2]["probes"] == LAYERS  # the check can fail: kept tensors are seen as held
    manager.step()


def test_selective_is_refused_by_name():
    net, _ = _net()
    sel = CheckpointPolicy(mode="selective")
    with pytest.raises(OffloadUnsupportedError, match="mode='selective'.*MindSpore"):
        checkpoint_wrapper(net.layers[0], policy=sel)
    x, cos, sin = _data()
    with pytest.raises(OffloadUnsupportedError, match="selective"):
        checkpoint(net.layers[0], x, cos, sin, policy=sel)


def test_wrong_arguments():
    x, _, _ = _data()
    with pytest.raises(OffloadTypeError, match="nn.Cell"):
        checkpoint_wrapper(x)
    with pytest.raises(OffloadTypeError, match="nn.Cell"):
        swap_wrapper(x)
    net, _ = _net()
    with pytest.raises(OffloadTypeError, match="use_reentrant"):
        checkpoint(net.layers[0], x, x, x, use_reentrant=True)
    assert math.isfinite(_reference()[0])


def _checkpointed(net) -> list[bool]:
    """Per layer: whether a checkpoint wrapper holds it."""
    return [hasattr(layer, "_checkpoint_wrapped_module") for layer in net.layers]


def test_offload_plan_on_cells():
    """apply_offload_plan on a cell: a range checkpointed, one layer swapped, by name; the
    gradients equal the plain run's and no probe is held between forward and backward."""
    from hp_offload import OffloadPlan, apply_offload_plan

    ref = _reference()
    net, seen = _net()
    manager = SwapManager()
    plan = OffloadPlan({"layers.0-1": "checkpoint", "layers.2": SwapPolicy(fuse_below=0)})
    assert plan.resolve(net) == {
        "layers.0": "checkpoint",
        "layers.1": "checkpoint",
        "layers.2": SwapPolicy(fuse_below=0),
    }
    assert apply_offload_plan(net, plan, manager=manager) is net
    assert _checkpointed(net) == [True, True, False]
    got = _step(net, seen)
    _close(got, ref)
    assert got[2] == {"probes": 0, "made": LAYERS}
    stats = manager.step()
    assert stats.tensors_out > 3 and stats.bytes_in == stats.bytes_out  # layer 2 swapped
    # every=2: only every second matched layer; a selective policy is refused by name
    net, seen = _net()
    apply_offload_plan(net, OffloadPlan({"layers.*": CheckpointPolicy(every=2)}))
    assert _checkpointed(net) == [True, False, True]
    got = _step(net, seen)
    _close(got, ref)
    assert got[2]["probes"] == 1  # the one layer left alone holds its probe (can fail)
    with pytest.raises(OffloadUnsupportedError, match="selective"):
        apply_offload_plan(_net()[0], OffloadPlan({"layers.0": CheckpointPolicy("selective")}))
    with pytest.raises(OffloadError, match="matches no module"):
        OffloadPlan({"blocks.*": "checkpoint"}).resolve(_net()[0])


def test_offload_plan_wraps_a_shared_cell_under_each_name():
    """MindSpore lists a shared cell once; the plan still wraps it wherever it sits."""
    from hp_offload import OffloadPlan, apply_offload_plan

    class Tied(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = Block(DIM, HEADS, KV, HIDDEN)
            self.b = self.a

        def construct(self, x, cos, sin):
            return self.b(self.a(x, cos, sin), cos, sin)

    net = Tied()
    assert OffloadPlan({"*": "checkpoint"}).resolve(net).keys() == {"a", "b"}
    apply_offload_plan(net, OffloadPlan({"*": "checkpoint"}))
    assert net.a is net.b and hasattr(net.a, "_checkpoint_wrapped_module")


def test_graph_mode_is_refused():
    """What the binding cannot do raises a typed error naming it, never runs silently."""
    net, _ = _net()
    x, cos, sin = _data()
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(OffloadUnsupportedError, match="graph mode"):
            checkpoint(net.layers[0], x, cos, sin)
        with pytest.raises(OffloadUnsupportedError, match="graph mode"):
            swap(net.layers[0], x, cos, sin, manager=SwapManager())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
