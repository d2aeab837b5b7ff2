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

import os
import sys
import warnings

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.dirname(__file__))
from fw_adapters import FRAMEWORKS  # noqa: E402

pool2 = rank_pool_fixture(2)

B, S, DIM, HEADS, HIDDEN, VOCAB = 2, 4, 8, 2, 12, 10
NAMES = ("emb", "g", "out", "w1", "w2", "w3", "wk", "wo", "wq", "wv")
COLWISE = ("wq", "wk", "wv", "w1", "w3", "out")  # weight rows split: Shard(0)
ROWWISE = ("wo", "w2")  # weight columns split: Shard(1)


def _arrays():
    rng = np.random.default_rng(3)
    shapes = {n: (DIM, DIM) for n in ("wq", "wk", "wv", "wo")}
    shapes.update(w1=(HIDDEN, DIM), w3=(HIDDEN, DIM), w2=(DIM, HIDDEN), g=(DIM,))
    shapes.update(emb=(VOCAB, DIM), out=(VOCAB, DIM))
    w = {n: (0.3 * rng.standard_normal(shapes[n])).astype(np.float32) for n in NAMES}
    w["g"] = 1 + w["g"]
    w["emb"] = 3 * w["emb"]
    ids = rng.integers(0, VOCAB, (B, S)).astype(np.int64)
    targets = rng.integers(0, VOCAB, (B, S)).astype(np.int64)
    hd = DIM // HEADS
    ang = np.outer(np.arange(S), 1.0 / 100 ** (np.arange(0, hd, 2) / hd))
    ang = np.concatenate([ang, ang], -1).astype(np.float32)
    return w, ids, targets, np.cos(ang), np.sin(ang)


def _model(o, ids, targets, cos, sin, w):
    """Loss of a one-block Llama-style model; ``o`` is the ops namespace, ``w`` the weights by
    name: embedding, RMSNorm (by hand, then rms_norm), attention with rotary embeddings, SwiGLU,
    layer_norm, logits, cross-entropy."""
    hd = DIM // HEADS
    x = o.embedding(ids, w["emb"])
    h = x * o.rsqrt(o.mean(x * x, -1, True) + 1e-6) * w["g"]

    def heads(name, rope):
        t = o.transpose(o.reshape(o.linear(h, w[name]), (B, S, HEADS, hd)), 1, 2)
        if rope:  # rotate_half by slicing and concatenation
            half = o.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
            t = t * cos + half * sin
        return t

    q, k, v = heads("wq", True), heads("wk", True), heads("wv", False)
    p = o.softmax(o.matmul(q, o.transpose(k, 2, 3)) * hd**-0.5, -1)
    a = o.reshape(o.transpose(o.matmul(p, v), 1, 2), (B, S, DIM))
    x = x + o.linear(a, w["wo"])
    h = o.rms_norm(x, (DIM,), w["g"], 1e-6)
    y = x + o.linear(o.silu(o.linear(h, w["w1"])) * o.linear(h, w["w3"]), w["w2"])
    logits = o.reshape(
        o.linear(o.layer_norm(y, (DIM,), w["g"], None, 1e-5), w["out"]), (B * S, VOCAB)
    )
    return o.cross_entropy(logits, o.reshape(targets, (B * S,)))


def _configs():
    """Placements of the weights and of the inputs (ids, targets, cos, sin) per config."""
    from hp_dtensor import Replicate, Shard

    tp = {n: Shard(0) for n in COLWISE} | {n: Shard(1) for n in ROWWISE}
    tp.update(g=Replicate(), emb=Shard(0))  # the embedding table split by vocabulary rows
    dp = dict.fromkeys(NAMES, Replicate())
    return {
        "tp": (tp, (Replicate(), Replicate())),  # logits and loss split by vocabulary
        "dp": (dp, (Shard(0), Shard(0))),  # samples split: the loss mean counts every rank's
    }


def ops_body(framework: str):
    """The model on whole tensors and on DTensors (two configs); a Partial(avg) mean and an
    uneven split; the mixed-argument error."""
    import hp_dtensor as hp
    from hp_dtensor import Replicate, Shard

    fw = FRAMEWORKS[framework]
    o = fw.ops()
    mesh = hp.init_device_mesh("cpu", (2,))
    w, ids, targets, cos, sin = _arrays()
    data = [fw.tensor(a) for a in (ids, targets, cos, sin)]

    def whole(*ws):
        return _model(o, *data, dict(zip(NAMES, ws)))

    out = {"ref": fw.grads(whole, [w[n] for n in NAMES])}
    for cfg, (pl, (ids_pl, tgt_pl)) in _configs().items():
        shards = [hp.distribute_tensor(fw.tensor(w[n]), mesh, [pl[n]]) for n in NAMES]
        locs = [fw.numpy(d.to_local()) for d in shards]
        ins = (ids_pl, tgt_pl, Replicate(), Replicate())
        din = [hp.distribute_tensor(t, mesh, [p]).to_local() for t, p in zip(data, ins)]

        def par(*ls, pl=pl, din=din, ins=ins):
            W = {n: hp.DTensor.from_local(loc, mesh, [pl[n]]) for n, loc in zip(NAMES, ls)}
            D = [hp.DTensor.from_local(t, mesh, [p]) for t, p in zip(din, ins)]
            return _model(o, *D, W).full_tensor()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[cfg] = fw.grads(par, locs)
        out[cfg, "fallbacks"] = [str(c.message) for c in caught if "gathered" in str(c.message)]

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
    d = hp.DTensor.from_local(fw.tensor(w["wq"]), mesh, [Replicate()])
    try:
        o.matmul(d, fw.tensor(w["wq"]))
        out["mixed"] = None
    except hp.HPDTensorError as e:
        out["mixed"] = type(e).__name__
    return out


def _chunk(a, dim, rank):
    return np.array_split(a, 2, axis=dim)[rank]


def _check(results):
    configs = _configs()
    for rank, res in enumerate(results):
        ref_loss, ref_g = res["ref"]
        for cfg, (pl, _) in configs.items():
            loss, g = res[cfg]
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=cfg)
            for name, got, want in zip(NAMES, g, ref_g):
                sharded = [p.dim for p in (pl[name],) if type(p).__name__ == "Shard"]
                if sharded:
                    want = _chunk(want, sharded[0], rank)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=(cfg, name))
            assert res[cfg, "fallbacks"] == [], res[cfg, "fallbacks"]
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
def test_llama_model_on_dtensor_ops_matches_whole_tensors(framework, request, tmp_path):
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
        for key in ("ref", "tp", "dp", ("split", 4), ("split", 5)):
            np.testing.assert_allclose(m[key][0], t[key][0], rtol=1e-5, err_msg=str(key))
            for a, b in zip(m[key][1], t[key][1]):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(key))


# -- shard_module with Layout plans: the same plan on a torch module and a MindSpore cell ------
def _mlp_arrays():
    rng = np.random.default_rng(11)
    w = {
        "norm": (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32),
        "w1": (0.3 * rng.standard_normal((HIDDEN, DIM))).astype(np.float32),
        "w2": (0.3 * rng.standard_normal((DIM, HIDDEN))).astype(np.float32),
    }
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    g = rng.standard_normal((B, S, DIM)).astype(np.float32)
    return w, x, g


def _mlp(o, x, norm, w1, w2):
    h = x * o.rsqrt(o.mean(x * x, -1, True) + 1e-6) * norm
    return x + o.linear(o.silu(o.linear(h, w1)), w2)


def _torch_mlp(w, x, g, plan=None):
    import torch

    o = FRAMEWORKS["torch"].ops()

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for n, a in w.items():
                self.register_parameter(n, torch.nn.Parameter(torch.tensor(a)))

        def forward(self, v):
            return _mlp(o, v, self.norm, self.w1, self.w2)

    model = MLP()
    if plan is not None:
        from hp_dtensor import shard_module

        shard_module(model, plan)
    xt = torch.tensor(x, requires_grad=True)
    out = model(xt)
    (out * torch.tensor(g)).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numpy()
    return out.detach().numpy(), grads, xt.grad.numpy()


def _ms_mlp(w, x, g, plan=None):
    import mindspore as ms
    from mindspore import nn

    o = FRAMEWORKS["mindspore"].ops()

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm = ms.Parameter(ms.Tensor(w["norm"]), name="norm")
            self.w1 = ms.Parameter(ms.Tensor(w["w1"]), name="w1")
            self.w2 = ms.Parameter(ms.Tensor(w["w2"]), name="w2")

        def construct(self, v):
            return _mlp(o, v, self.norm, self.w1, self.w2)

    model = MLP()
    if plan is not None:
        from hp_dtensor import shard_module

        shard_module(model, plan)
    params = model.trainable_params()
    gt = ms.Tensor(g)

    def loss(v):
        return (model(v) * gt).sum()

    xt = ms.Tensor(x)
    out = model(xt).asnumpy()
    _, (dx, dws) = ms.value_and_grad(loss, grad_position=0, weights=params)(xt)
    return out, {p.name: d.asnumpy() for p, d in zip(params, dws)}, dx.asnumpy()


def shard_module_body(framework: str):
    """The MLP whole (the reference) and under a Layout plan: outputs, local gradients, input
    gradient; then the plan errors."""
    import hp_dtensor as hp
    from hp_dtensor import Layout

    hp.init_device_mesh("cpu", (2,))
    lay = Layout((2,), ("tp",))
    rep3 = lay("None", "None", "None")
    plan = {
        "parameter": {"w1": lay("tp", "None"), "w2": lay("None", "tp"), "norm": lay("None")},
        "forward": {"input": (rep3,), "output": (rep3,), "use_local_output": True},
    }
    run = {"torch": _torch_mlp, "mindspore": _ms_mlp}[framework]
    w, x, g = _mlp_arrays()
    out = {"ref": run(w, x, g), "sharded": run(w, x, g, plan)}
    for key, bad in {
        "unknown": {"parameter": {"w9": lay("tp", "None")}},
        "rank": {"parameter": {"w1": lay("tp")}},
        "keys": {"params": {}},
    }.items():
        try:
            run(w, x, g, bad)
            out[key] = None
        except hp.HPDTensorError as e:
            out[key] = (type(e).__name__, str(e))
    return out


def _check_shard_module(results):
    for rank, res in enumerate(results):
        (ref_out, ref_g, ref_dx), (o, gr, dx) = res["ref"], res["sharded"]
        np.testing.assert_allclose(o, ref_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gr["w1"], _chunk(ref_g["w1"], 0, rank), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gr["w2"], _chunk(ref_g["w2"], 1, rank), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gr["norm"], ref_g["norm"], rtol=1e-5, atol=1e-6)
        assert res["unknown"][0] == "LayoutError" and "'w9'" in res["unknown"][1]
        assert res["rank"][0] == "LayoutError" and "has 1 dims" in res["rank"][1]
        assert res["keys"][0] == "LayoutError" and "params" in res["keys"][1]


_SHARD: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_shard_module_layout_plan_matches_whole_model(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, shard_module_body, framework)
    _check_shard_module(results)
    _SHARD[framework] = results


def test_shard_module_same_in_both_frameworks():
    """The same plan on the same weights: both frameworks' outputs and local gradients agree."""
    if len(_SHARD) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(2):
        t, m = _SHARD["torch"][rank]["sharded"], _SHARD["mindspore"][rank]["sharded"]
        np.testing.assert_allclose(m[0], t[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m[2], t[2], rtol=1e-5, atol=1e-6)
        for name in t[1]:
            np.testing.assert_allclose(m[1][name], t[1][name], rtol=1e-4, atol=1e-6)


# -- review cases: scalar operands, plain loss targets, padded vocabulary-split lookups,
# -- SequenceParallel over sub-cells with an uneven sequence and after a failed forward -------
def x_extras():
    return np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32)


def extras_body(framework: str):
    import hp_dtensor as hp
    from hp_dtensor import Replicate, Shard
    from hp_dtensor.parallel import SequenceParallel, parallelize_module

    fw = FRAMEWORKS[framework]
    o = fw.ops()
    mesh = hp.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    rng = np.random.default_rng(5)
    x = x_extras()
    rng.standard_normal((6, 4))  # keep the stream where it was
    table = rng.standard_normal((VOCAB, 4)).astype(np.float32)
    ids = np.array([[0, 3, 7], [9, 0, 5]], dtype=np.int64)
    tgt = np.array([1, 0, 3, 2, 1, 0], dtype=np.int64)
    out = {}

    # a 0-d tensor (a learnt scale) times a row-split tensor; its gradient sums every row
    def scaled(xl, s):
        d = hp.DTensor.from_local(xl, mesh, [Shard(0)])
        return o.mean(o.mul(d, s) * d).full_tensor()

    out["scale"] = fw.grads(scaled, [_chunk(x, 0, rank), np.float32(1.5)])
    out["scale_ref"] = fw.grads(lambda v, s: o.mean(o.mul(v, s) * v), [x, np.float32(1.5)])

    # a loss on row-split logits with plain (whole) targets, taken as replicated
    t = fw.tensor(tgt)

    def loss_plain_targets(xl):
        return o.cross_entropy(hp.DTensor.from_local(xl, mesh, [Shard(0)]), t).full_tensor()

    out["ce"] = fw.grads(loss_plain_targets, [_chunk(x, 0, rank)])
    out["ce_ref"] = fw.grads(lambda v: o.cross_entropy(v, t), [x])

    # a vocabulary-split table with a padding row (no gradient for it)
    idt = fw.tensor(ids)

    def lookup(wl):
        w = hp.DTensor.from_local(wl, mesh, [Shard(0)])
        ids_d = hp.DTensor.from_local(idt, mesh, [Replicate()])
        e = o.embedding(ids_d, w, 7)
        return o.mean(e * e).full_tensor()

    out["emb"] = fw.grads(lookup, [_chunk(table, 0, rank)])
    out["emb_ref"] = fw.grads(lambda w: o.mean(o.embedding(idt, w, 7) ** 2), [table])

    # SequenceParallel on a wrapper whose child holds the weight; 5 positions over 2 ranks;
    # a forward that raises first must leave the parameters as they were
    seq = rng.standard_normal((1, 5, 4)).astype(np.float32)
    gw = (1 + 0.1 * rng.standard_normal(4)).astype(np.float32)
    net = _sp_net(framework, o, gw)
    parallelize_module(net, mesh, SequenceParallel())
    net.inner.fail = True
    try:
        net(hp.distribute_tensor(fw.tensor(seq), mesh, [Shard(1)]))
    except RuntimeError:
        pass
    net.inner.fail = False
    out["param_kept"] = type(net.inner.weight).__name__

    def run_sp(v):
        y = net(hp.distribute_tensor(v, mesh, [Shard(1)]))
        return (y * y).sum().full_tensor()

    # PrepareModuleInputOutput: a row-split input gathered for the module, its output split
    # again and handed back as the local piece
    from hp_dtensor.parallel import PrepareModuleInputOutput

    dbl = _doubler(framework)
    style = PrepareModuleInputOutput(
        input_layouts=Shard(0),
        desired_input_layouts=Replicate(),
        use_local_input=True,
        output_layouts=Replicate(),
        desired_output_layouts=Shard(0),
        use_local_output=True,
    )
    parallelize_module(dbl, mesh, style)
    y = dbl(fw.tensor(_chunk(x, 0, rank)))
    out["prepare"] = (fw.numpy(y), dbl.seen)
    out["sp"] = _param_grads(framework, run_sp, fw.tensor(seq), net)
    ref = _sp_net(framework, o, gw)
    out["sp_ref"] = _param_grads(framework, lambda v: (ref(v) ** 2).sum(), fw.tensor(seq), ref)
    return out


def _sp_net(framework, o, gw):
    """A wrapper cell/module around a norm that owns the weight."""
    if framework == "torch":
        import torch

        class Norm(torch.nn.Module):
            fail = False

            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.tensor(gw))

            def forward(self, v):
                if self.fail:
                    raise RuntimeError("failing on purpose")
                return o.rms_norm(v, (4,), self.weight, 1e-6)

        class Wrap(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = Norm()

            def forward(self, v):
                return self.inner(v)

        return Wrap()
    import mindspore as ms
    from mindspore import nn

    class Norm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fail = False
            self.weight = ms.Parameter(ms.Tensor(gw), name="weight")

        def construct(self, v):
            if self.fail:
                raise RuntimeError("failing on purpose")
            return o.rms_norm(v, (4,), self.weight, 1e-6)

    class Wrap(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = Norm()

        def construct(self, v):
            return self.inner(v)

    return Wrap()


def _doubler(framework):
    """A module returning twice its input and remembering the shape it was given."""
    if framework == "torch":
        import torch

        class Double(torch.nn.Module):
            def forward(self, v):
                self.seen = tuple(v.shape)
                return v * 2

        return Double()
    from mindspore import nn

    class Double(nn.Cell):
        def construct(self, v):
            self.seen = tuple(v.shape)
            return v * 2

    return Double()


def _param_grads(framework, f, v, net):
    """f(v) and its gradients with respect to ``net``'s parameters (whole; DTensors gathered)."""
    if framework == "torch":
        params = list(net.parameters())
        y = f(v)
        y.backward()
        return float(y), [
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).numpy()
            for p in params
        ]
    import mindspore as ms

    y, gs = ms.value_and_grad(f, grad_position=None, weights=net.trainable_params())(v)
    return float(y.asnumpy()), [g.asnumpy() for g in gs]


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_scalars_plain_targets_padding_and_sequence_parallel_cells(framework, request, tmp_path):
    for rank, res in enumerate(run_framework(framework, request, tmp_path, extras_body, framework)):
        for key in ("scale", "ce", "emb"):
            (v, g), (rv, rg) = res[key], res[key + "_ref"]
            np.testing.assert_allclose(v, rv, rtol=1e-5, err_msg=key)
            local = [_chunk(rg[0], 0, rank)] + [a for a in rg[1:]]
            for a, b in zip(g, local):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=key)
        assert res["param_kept"] in ("Parameter", "DTensor"), res["param_kept"]
        y, seen = res["prepare"]
        assert seen == (6, 4), seen  # the module saw the whole, gathered input
        np.testing.assert_array_equal(y, 2 * _chunk(x_extras(), 0, rank))
        (v, g), (rv, rg) = res["sp"], res["sp_ref"]
        np.testing.assert_allclose(v, rv, rtol=1e-5)
        np.testing.assert_allclose(g[0], rg[0], rtol=1e-5, atol=1e-6)
