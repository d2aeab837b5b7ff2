"""fully_shard on both frameworks with one test body: an MLP (uneven rows, and a last layer
with fewer rows than ranks) sharded per layer and at the root, 5 SGD steps on 2 ranks, each
rank on its half of the batch, with an evaluation forward between steps, against a
one-process reference of the same framework; then torch against MindSpore on the same weights
and data. A gradient scaling factor of 2 with half the learning rate must give the same steps.

Torch runs on hp_testing's gloo ranks; MindSpore on 2 CPU workers under msrun (skipped where
MindSpore is not installed: ``nox -s tests_mindspore`` installs it).
"""

from __future__ import annotations

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

IN, HID, OUT, BATCH, STEPS, LR = 12, 16, 7, 8, 5, 0.1
WORLD = 2
LAYERS = ("0", "2", "4", "6")  # the Linear / Dense positions in the sequential model

pool2 = rank_pool_fixture(2)


def _arrays():
    rng = np.random.default_rng(11)
    shapes = {"0": (HID, IN), "2": (HID, HID), "4": (OUT, HID), "6": (1, OUT)}
    w = {}
    for k, (o, i) in shapes.items():
        w[f"{k}.weight"] = (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
        w[f"{k}.bias"] = (0.1 * rng.standard_normal(o)).astype(np.float32)
    data = [
        (
            rng.standard_normal((BATCH, IN)).astype(np.float32),
            rng.standard_normal((BATCH, 1)).astype(np.float32),
        )
        for _ in range(STEPS)
    ]
    return w, data


def _torch_run(mesh, rank):
    import torch
    import torch.nn as nn

    from hp_fsdp import fully_shard

    w, data = _arrays()

    def make():
        m = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU())
        m.extend([nn.Linear(HID, OUT), nn.ReLU(), nn.Linear(OUT, 1)])
        m.load_state_dict({k: torch.tensor(v) for k, v in w.items()})
        return m

    model, ref = make(), make()
    for k in LAYERS:
        fully_shard(model[int(k)], mesh=mesh)
        model[int(k)].set_gradient_scaling_factor(2.0)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR / 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    losses, ref_losses, evals = [], [], []
    for x, y in data:
        x, y = torch.tensor(x), torch.tensor(y)
        with torch.no_grad():  # evaluation between steps: the current weights
            evals.append(float((model(x) - ref(x)).abs().max()))
        loss = ((model(x[mine]) - y[mine]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    shards = {k: p.to_local().detach().numpy() for k, p in model.named_parameters()}
    full = {k: p.detach().numpy() for k, p in ref.named_parameters()}
    return losses, ref_losses, shards, full, evals


def _ms_run(mesh, rank):
    import mindspore as ms
    from mindspore import nn

    from hp_fsdp import fully_shard, parallelize_value_and_grad

    w, data = _arrays()

    def make():
        m = nn.SequentialCell(
            [nn.Dense(IN, HID), nn.ReLU(), nn.Dense(HID, HID), nn.ReLU(), nn.Dense(HID, OUT)]
            + [nn.ReLU(), nn.Dense(OUT, 1)]
        )
        for p in m.trainable_params():
            p.set_data(ms.Tensor(w[p.name]))
        return m

    model, ref = make(), make()
    for k in LAYERS:
        fully_shard(model[int(k)], mesh=mesh)
        model[int(k)].set_gradient_scaling_factor(2.0)
    fully_shard(model, mesh=mesh)
    opt = nn.SGD(model.trainable_params(), learning_rate=LR / 2)
    ref_opt = nn.SGD(ref.trainable_params(), learning_rate=LR)

    def loss_of(net):
        return lambda x, y: ((net(x) - y) ** 2).mean()

    step = parallelize_value_and_grad(loss_of(model), weights=model.trainable_params())
    ref_step = ms.value_and_grad(loss_of(ref), grad_position=None, weights=ref.trainable_params())
    mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    losses, ref_losses, evals = [], [], []
    for x, y in data:
        xt = ms.Tensor(x)  # evaluation between steps: the current weights
        evals.append(float(np.abs((model(xt) - ref(xt)).asnumpy()).max()))
        loss, grads = step(ms.Tensor(x[mine]), ms.Tensor(y[mine]))
        opt(grads)
        ref_loss, ref_grads = ref_step(ms.Tensor(x), ms.Tensor(y))
        ref_opt(ref_grads)
        losses.append(float(loss.asnumpy()))
        ref_losses.append(float(ref_loss.asnumpy()))
    shards = {p.name: p.asnumpy() for p in model.trainable_params()}
    full = {p.name: p.asnumpy() for p in ref.trainable_params()}
    # between steps the gathered copies are released: reading one gives its zero placeholder
    groups = [model[int(k)]._hp_fsdp for k in LAYERS] + [model._hp_fsdp]
    held = [fp.name for g in groups for fp in g.full_params if np.any(fp.asnumpy() != 0)]
    return losses, ref_losses, shards, full, evals, held


def fsdp_mlp_body(framework: str):
    """(per-step local losses, reference losses, this rank's parameter shards, reference
    parameters) after training."""
    import hp_dtensor as hp

    mesh = hp.init_device_mesh("cpu", (WORLD,))
    assert mesh.framework == framework
    rank = mesh.get_coordinate()[0]
    return {"torch": _torch_run, "mindspore": _ms_run}[framework](mesh, rank)


def _check(results):
    losses = np.mean([r[0] for r in results], 0)  # equal halves: the mean is the batch loss
    ref_losses = results[0][1]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, want in results[0][3].items():
        # shards stack on dim 0 (MindSpore's are zero-padded to equal rows: cut the padding)
        got = np.concatenate([r[2][name] for r in results], 0)
        np.testing.assert_allclose(got[: want.shape[0]], want, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(got[want.shape[0] :], 0)
    for r in results:  # an evaluation forward sees the weights of the last step
        assert max(r[4]) < 1e-5, r[4]
        if len(r) > 5:  # MindSpore: no gathered parameter stays allocated after a step
            assert r[5] == [], f"still holding gathered values: {r[5]}"
    # the steps changed something (the test would pass vacuously with a zero learning rate)
    w, _ = _arrays()
    assert not np.allclose(results[0][3]["4.weight"], w["4.weight"])


_RESULTS: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_fully_shard_mlp_matches_one_process(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, fsdp_mlp_body, framework)
    _check(results)
    _RESULTS[framework] = results


def test_fully_shard_same_in_both_frameworks():
    """The same weights and batches: losses and trained parameters agree across frameworks."""
    if len(_RESULTS) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(WORLD):
        t, m = _RESULTS["torch"][rank], _RESULTS["mindspore"][rank]
        np.testing.assert_allclose(m[0], t[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m[1], t[1], rtol=1e-5, atol=1e-6)
        for name in t[2]:
            rows = t[2][name].shape[0]  # MindSpore's shards may carry zero rows of padding
            np.testing.assert_allclose(m[2][name][:rows], t[2][name], rtol=1e-5, atol=1e-6)
