"""Ops on DTensors decided by the shared sharding rules, in both frameworks, one test body.

A Llama-style block (RMSNorm, attention with heads split, SwiGLU MLP) is written once against
an ops namespace: ``torch`` functions for torch DTensors (dispatched by ``__torch_function__``),
``hp_dtensor.ms_ops`` for MindSpore ones. Its weights are DTensors (column-split q/k/v/w1/w3,
row-split wo/w2, replicated norm weight), its input replicated; every op between them is
placed by the rule registered under the op's name. Loss and gradients (input and every local
weight shard) are compared with the same block on whole tensors in the same process, then
across the frameworks. No op may take the gather fallback. Uneven shards, which the MindSpore
path gathers, are checked for values and gradients too, and mixing DTensors with plain tensors
is refused.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

pool2 = rank_pool_fixture(2)

B, S, DIM, HEADS, HIDDEN = 2, 4, 8, 2, 12
NAMES = ("g", "w1", "w2", "w3", "wk", "wo", "wq", "wv")
COLWISE = ("wq", "wk", "wv", "w1", "w3")  # weight rows split: Shard(0)
ROWWISE = ("wo", "w2")  # weight columns split: Shard(1)


def _arrays():
    rng = np.random.default_rng(3)
    shapes = {n: (DIM, DIM) for n in ("wq", "wk", "wv", "wo")}
    shapes.update(w1=(HIDDEN, DIM), w3=(HIDDEN, DIM), w2=(DIM, HIDDEN), g=(DIM,))
    w = {n: (0.3 * rng.standard_normal(shapes[n])).astype(np.float32) for n in NAMES}
    w["g"] = 1 + w["g"]
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    return w, x


def _block(o, x, w):
    """Scalar loss of one block; ``o`` is the ops namespace, ``w`` the weights by name."""
    hd = DIM // HEADS
    h = x * o.rsqrt(o.mean(x * x, -1, True) + 1e-6) * w["g"]

    def heads(name):
        return o.transpose(o.reshape(o.linear(h, w[name]), (B, S, HEADS, hd)), 1, 2)

    q, k, v = heads("wq"), heads("wk"), heads("wv")
    p = o.softmax(o.matmul(q, o.transpose(k, 2, 3)) * hd**-0.5, -1)
    a = o.reshape(o.transpose(o.matmul(p, v), 1, 2), (B, S, DIM))
    x = x + o.linear(a, w["wo"])
    y = x + o.linear(o.silu(o.linear(x, w["w1"])) * o.linear(x, w["w3"]), w["w2"])
    return o.mean(y * y)


def _placements():
    from hp_dtensor import Replicate, Shard

    pl = {n: Shard(0) for n in COLWISE} | {n: Shard(1) for n in ROWWISE}
    pl["g"] = Replicate()
    return pl


class _Torch:
    @staticmethod
    def ops():
        import torch
        import torch.nn.functional as F

        return types.SimpleNamespace(
            rsqrt=torch.rsqrt, mean=torch.mean, linear=F.linear, reshape=torch.reshape,
            transpose=torch.transpose, softmax=F.softmax, matmul=torch.matmul, silu=F.silu,
        )  # fmt: skip

    @staticmethod
    def grads(f, arrays):
        """f's value and the gradients of all its arguments."""
        import torch

        ts = [torch.tensor(a, requires_grad=True) for a in arrays]
        y = f(*ts)
        y.backward()
        return y.detach().numpy(), [t.grad.numpy() for t in ts]

    @staticmethod
    def tensor(a):
        import torch

        return torch.tensor(a)

    @staticmethod
    def numpy(t):
        return t.detach().numpy()


class _MindSpore:
    @staticmethod
    def ops():
        import hp_dtensor

        return hp_dtensor.ms_ops

    @staticmethod
    def grads(f, arrays):
        import mindspore as ms

        ts = [ms.Tensor(a) for a in arrays]
        y, gs = ms.value_and_grad(f, grad_position=tuple(range(len(ts))))(*ts)
        if isinstance(gs, ms.Tensor):  # one position: MindSpore returns the tensor itself
            gs = (gs,)
        return y.asnumpy(), [g.asnumpy() for g in gs]

    @staticmethod
    def tensor(a):
        import mindspore as ms

        return ms.Tensor(a)

    @staticmethod
    def numpy(t):
        return t.asnumpy()


def ops_body(framework: str):
    """The block on whole tensors and on DTensors; an uneven case; the mixed-argument error."""
    import hp_dtensor as hp
    from hp_dtensor import Replicate, Shard

    fw = {"torch": _Torch, "mindspore": _MindSpore}[framework]
    o = fw.ops()
    mesh = hp.init_device_mesh("cpu", (2,))
    w, x = _arrays()
    pl = _placements()
    whole = [x] + [w[n] for n in NAMES]
    out = {"ref": fw.grads(lambda xv, *ws: _block(o, xv, dict(zip(NAMES, ws))), whole)}
    locs = [
        fw.numpy(hp.distribute_tensor(fw.tensor(w[n]), mesh, [pl[n]]).to_local()) for n in NAMES
    ]

    def par(xv, *ls):
        X = hp.DTensor.from_local(xv, mesh, [Replicate()])
        W = {n: hp.DTensor.from_local(loc, mesh, [pl[n]]) for n, loc in zip(NAMES, ls)}
        return _block(o, X, W).full_tensor()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["dtensor"] = fw.grads(par, [x] + locs)
    out["fallbacks"] = [str(c.message) for c in caught if "gathered" in str(c.message)]

    # a mean over a split dim (a Partial(avg) result) on 4 rows over 2 ranks; on 5 rows torch
    # places the ops by their rules and MindSpore gathers (with a warning)
    rank = mesh.get_coordinate()[0]
    for rows in (4, 5):
        u = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) / 7
        top = (rows + 1) // 2

        def split(v, rows=rows):
            d = hp.DTensor.from_local(v, mesh, [Shard(0)], shape=(rows, 3))
            return o.mean(o.silu(d) * d - 1.0).full_tensor()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["split", rows] = fw.grads(split, [u[:top] if rank == 0 else u[top:]])
            out["whole", rows] = fw.grads(lambda v: o.mean(o.silu(v) * v - 1.0), [u])
        out["gathered", rows] = any("unevenly" in str(c.message) for c in caught)
    out["framework"] = framework
    d = hp.DTensor.from_local(fw.tensor(x), mesh, [Replicate()])
    try:
        o.matmul(d, fw.tensor(w["wq"]))
        out["mixed"] = None
    except hp.HPDTensorError as e:
        out["mixed"] = type(e).__name__
    return out


def _chunk(a, dim, rank):
    return np.array_split(a, 2, axis=dim)[rank]


def _check(results):
    for rank, res in enumerate(results):
        (ref_loss, ref_g), (loss, g) = res["ref"], res["dtensor"]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        np.testing.assert_allclose(g[0], ref_g[0], rtol=1e-5, atol=1e-6, err_msg="input")
        for i, name in enumerate(NAMES, 1):
            want = ref_g[i]
            if name in COLWISE:
                want = _chunk(want, 0, rank)
            elif name in ROWWISE:
                want = _chunk(want, 1, rank)
            np.testing.assert_allclose(g[i], want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert res["fallbacks"] == [], res["fallbacks"]
        for rows in (4, 5):
            (uv, ug), (rv, rg) = res["split", rows], res["whole", rows]
            top = (rows + 1) // 2
            np.testing.assert_allclose(uv, rv, rtol=1e-6)
            np.testing.assert_allclose(ug[0], rg[0][:top] if rank == 0 else rg[0][top:], rtol=1e-5)
        # MindSpore's path gathers uneven inputs (and says so); torch's rules place them
        assert not res["gathered", 4]
        assert res["gathered", 5] == (res["framework"] == "mindspore")
        assert res["mixed"] == "ShardingError", res["mixed"]


_RESULTS: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_llama_block_on_dtensor_ops_matches_whole_tensors(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, ops_body, framework)
    _check(results)
    _RESULTS[framework] = results


def test_dtensor_ops_same_in_both_frameworks():
    """Same weights, same placements: the two frameworks' losses and local gradients agree
    within float32 rounding (different kernels)."""
    if len(_RESULTS) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(2):
        t, m = _RESULTS["torch"][rank], _RESULTS["mindspore"][rank]
        for key in ("ref", "dtensor", ("split", 4), ("split", 5)):
            np.testing.assert_allclose(m[key][0], t[key][0], rtol=1e-5, err_msg=str(key))
            for a, b in zip(m[key][1], t[key][1]):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(key))
