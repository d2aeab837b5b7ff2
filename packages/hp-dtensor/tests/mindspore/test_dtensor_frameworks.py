"""One test body, two frameworks: every redistribution between Shard(0), Shard(1), Replicate,
Partial(sum), Partial(avg) and Partial(max) on a 1-D mesh of 2 ranks, forward values and
gradients (the vector-Jacobian product with a known upstream gradient), and
distribute_tensor, against a numpy oracle; then the two frameworks' arrays against each other.

The body (``redistribution_body``) is framework-neutral: it gets an adapter that makes tensors
and takes gradients. Under torch it runs on 2 gloo ranks (hp_testing's pool); under MindSpore
on 2 CPU workers started by ``msrun`` (skipped where MindSpore is not installed: ``nox -s
tests_mindspore`` installs it). Values are integers in float32, so every comparison is exact.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.dirname(__file__))
from fw_adapters import FRAMEWORKS  # noqa: E402

HAVE_MS = importlib.util.find_spec("mindspore") is not None
SHAPE = (5, 7)  # uneven over 2 ranks on both dims
WORLD = 2
NAMES = ("S0", "S1", "R", "Psum", "Pavg", "Pmax")

pool2 = rank_pool_fixture(2)


def _placement(name):
    from hp_dtensor import Partial, Replicate, Shard

    return {
        "S0": Shard(0),
        "S1": Shard(1),
        "R": Replicate(),
        "Psum": Partial("sum"),
        "Pavg": Partial("avg"),
        "Pmax": Partial("max"),
    }[name]


def _ints(seed, shape=SHAPE):
    return np.random.default_rng(seed).integers(-8, 9, shape).astype(np.float32)


def _chunk(x, dim, rank, world=WORLD):
    size = x.shape[dim]
    step = -(-size // world)
    lo = min(rank * step, size)
    return np.take(x, range(lo, min(lo + step, size)), axis=dim)


def _local(x, name, rank, noise):
    """This rank's piece of ``x`` under placement ``name`` (Partial: an uneven decomposition)."""
    if name in ("S0", "S1"):
        return _chunk(x, int(name[1]), rank)
    if name == "Psum":
        return x - (WORLD - 1) * noise if rank == 0 else noise
    if name == "Pavg":
        return x + noise * (2 * rank - (WORLD - 1))
    if name == "Pmax":  # rank 0 holds the maximum; ties where the noise is 0
        return x - rank * np.abs(noise)
    return x


def _grad_local(g, name, rank, x, noise):
    """The local gradient that represents the global gradient ``g`` under placement ``name``
    (NOTE [Gradient representation] in hp_dtensor._redistribute); Partial(max): to the ranks
    holding the maximum, split evenly on ties."""
    if name in ("S0", "S1"):
        return _chunk(g, int(name[1]), rank)
    if name == "Pmax":
        locals_ = [_local(x, name, r, noise) for r in range(WORLD)]
        top = np.max(locals_, 0)
        count = sum((v == top).astype(np.float32) for v in locals_)
        return g * (locals_[rank] == top) / count
    return g / WORLD if name == "Pavg" else g


def redistribution_body(framework: str):
    """Every (src, dst) pair: ("ok", y_local, dx_local) or ("refused", error type)."""
    import hp_dtensor as hp

    fw = FRAMEWORKS[framework]
    mesh = hp.init_device_mesh("cpu", (WORLD,))
    assert mesh.framework == framework, (mesh.framework, framework)
    rank = mesh.get_coordinate()[0]
    x, noise, g = _ints(1), _ints(2), _ints(3)
    out = {}
    for s in NAMES:
        for d in NAMES:
            if s == d:
                continue
            src, dst = _placement(s), _placement(d)

            def f(v, src=src, dst=dst):
                dt = hp.DTensor.from_local(v, mesh, [src], shape=SHAPE)
                return dt.redistribute(mesh, [dst]).to_local()

            # the upstream gradient as the output's local gradient: a chunk of g for a shard,
            # the whole g for replicated and partial outputs
            dy = _chunk(g, int(d[1]), rank) if d in ("S0", "S1") else g
            try:
                out[s, d] = ("ok", *fw.vjp(f, _local(x, s, rank, noise), dy))
            except hp.HPDTensorError as e:
                out[s, d] = ("refused", type(e).__name__)
    for p in ("S0", "S1", "R"):
        dt = hp.distribute_tensor(fw.tensor(x), mesh, [_placement(p)])
        out["distribute", p] = ("ok", _to_numpy(dt.to_local()), tuple(dt.shape))
        out["full_tensor", p] = ("ok", _to_numpy(dt.full_tensor()), None)
    out["mixed"] = _mixed_refusal(hp, mesh, framework)
    return out


# -- the Llama-style block with TP=2 -----------------------------------------------------------
B, S, DIM, HEADS, KV, HIDDEN = 2, 8, 24, 4, 2, 42
COLWISE = ("wq", "wk", "wv", "w1", "w3")  # output features split: weight rows
ROWWISE = ("wo", "w2")  # input features split: weight columns


def _block_arrays():
    """Weights (by parameter name), input, RoPE tables and upstream gradient, from seeds."""
    rng = np.random.default_rng(7)
    hd = DIM // HEADS
    shapes = {"attention_norm.weight": (DIM,), "ffn_norm.weight": (DIM,), "w2.bias": (DIM,)}
    shapes.update({f"{n}.weight": (HEADS * hd, DIM) for n in ("wq",)})
    shapes.update({f"{n}.weight": (KV * hd, DIM) for n in ("wk", "wv")})
    shapes.update({"wo.weight": (DIM, HEADS * hd), "w2.weight": (DIM, HIDDEN)})
    shapes.update({f"{n}.weight": (HIDDEN, DIM) for n in ("w1", "w3")})
    w = {}
    for name, shape in sorted(shapes.items()):
        a = rng.standard_normal(shape).astype(np.float32)
        w[name] = (1 + 0.1 * a) if name.endswith("norm.weight") else 0.2 * a
    inv = 1.0 / 10000 ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.outer(np.arange(S, dtype=np.float32), inv)
    ang = np.concatenate([ang, ang], -1)[None, :, None, :]
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    g = rng.standard_normal((B, S, DIM)).astype(np.float32)
    return w, x, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), g


def _torch_block(w, x, cos, sin, g, mesh=None, plan=None, seq=False):
    """Output, parameter gradients and input gradient; with ``seq`` the block takes this rank's
    sequence shard as a Shard(1) DTensor and returns its local output."""
    import torch

    import hp_dtensor as hp
    from hp_dtensor.parallel import parallelize_module
    from hp_testing.models import Block

    block = Block(DIM, HEADS, KV, HIDDEN)
    block.load_state_dict({k: torch.tensor(v) for k, v in w.items()})
    if plan is not None:
        parallelize_module(block, mesh, plan)
    xt = torch.tensor(x, requires_grad=True)
    xin = hp.DTensor.from_local(xt, mesh, [hp.Shard(1)]) if seq else xt
    out = block(xin, torch.tensor(cos), torch.tensor(sin))
    out = out.to_local() if seq else out
    (out * torch.tensor(g)).sum().backward()
    grads = {}
    for name, p in block.named_parameters():
        gr = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[name] = gr.numpy()
    return out.detach().numpy(), grads, xt.grad.numpy()


def _ms_block(w, x, cos, sin, g, mesh=None, plan=None, seq=False):
    """As ``_torch_block``, on MindSpore."""
    import mindspore as ms
    from ms_llama import Block

    import hp_dtensor as hp
    from hp_dtensor.parallel import parallelize_module

    block = Block(DIM, HEADS, KV, HIDDEN)
    for name, p in block.parameters_and_names():
        p.set_data(ms.Tensor(w[name]))
    if plan is not None:
        parallelize_module(block, mesh, plan)
    params = block.trainable_params()
    c, s_, gt = ms.Tensor(cos), ms.Tensor(sin), ms.Tensor(g)

    def run(v):
        if not seq:
            return block(v, c, s_)
        return block(hp.DTensor.from_local(v, mesh, [hp.Shard(1)]), c, s_).to_local()

    def loss(v):
        return (run(v) * gt).sum()

    xt = ms.Tensor(x)
    out = run(xt).asnumpy()
    _, (dx, dws) = ms.value_and_grad(loss, grad_position=0, weights=params)(xt)
    return out, {p.name: d.asnumpy() for p, d in zip(params, dws)}, dx.asnumpy()


def tp_block_body(framework: str):
    """The block on one rank without parallelism (the reference) and with TP=2: outputs, every
    parameter's (local) gradient and the input gradient of both."""
    import hp_dtensor as hp
    from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = hp.init_device_mesh("cpu", (WORLD,))
    plan = {n: ColwiseParallel() for n in COLWISE} | {n: RowwiseParallel() for n in ROWWISE}
    run = {"torch": _torch_block, "mindspore": _ms_block}[framework]
    arrays = _block_arrays()
    return {"ref": run(*arrays), "tp": run(*arrays, mesh=mesh, plan=plan)}


def _check_grad_pieces(grads, ref_g, rank):
    """Each rank's gradient pieces: column-wise weights and biases split on dim 0, row-wise
    weights on dim 1, everything else whole."""
    assert grads.keys() == ref_g.keys()
    for name, gr in grads.items():
        mod, kind = name.split(".")
        want = ref_g[name]
        if mod in COLWISE:
            want = _chunk(want, 0, rank)
        elif mod in ROWWISE and kind == "weight":
            want = _chunk(want, 1, rank)
        np.testing.assert_allclose(gr, want, rtol=1e-5, atol=1e-5, err_msg=name)


def _check_block(results):
    """TP=2 against the one-rank reference: outputs, local gradient pieces, input gradient."""
    for rank, res in enumerate(results):
        (ref_out, ref_g, ref_dx), (out, grads, dx) = res["ref"], res["tp"]
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
        _check_grad_pieces(grads, ref_g, rank)


def sp_block_body(framework: str):
    """The block with TP=2 and sequence parallelism: norms on sequence shards
    (SequenceParallel), q/k/v/w1/w3 gathering the sequence, wo/w2 reduce-scattering it; the
    block takes and returns this rank's half of the sequence."""
    import hp_dtensor as hp
    from hp_dtensor import Shard
    from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    mesh = hp.init_device_mesh("cpu", (WORLD,))
    rank = mesh.get_coordinate()[0]
    plan = {n: SequenceParallel() for n in ("attention_norm", "ffn_norm")}
    plan |= {n: ColwiseParallel(input_layouts=Shard(1)) for n in COLWISE}
    # the residual stream stays a Shard(1) DTensor: the block reads its (global) shape
    plan |= {n: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for n in ROWWISE}
    run = {"torch": _torch_block, "mindspore": _ms_block}[framework]
    w, x, cos, sin, g = _block_arrays()
    local = (w, _chunk(x, 1, rank), cos, sin, _chunk(g, 1, rank))
    return {"ref": run(w, x, cos, sin, g), "sp": run(*local, mesh=mesh, plan=plan, seq=True)}


def _check_sp_block(results):
    for rank, res in enumerate(results):
        (ref_out, ref_g, ref_dx), (out, grads, dx) = res["ref"], res["sp"]
        np.testing.assert_allclose(out, _chunk(ref_out, 1, rank), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, _chunk(ref_dx, 1, rank), rtol=1e-5, atol=1e-5)
        _check_grad_pieces(grads, ref_g, rank)


# -- an embedding split column-wise; a biased row-wise linear with a sequence-sharded output ----
V, D, ROWS = 11, 8, 5


def _extra_arrays():
    rng = np.random.default_rng(5)
    f = np.float32
    return {
        "table": rng.standard_normal((V, D)).astype(f),
        "ids": rng.integers(0, V, (2, 6)).astype(np.int32),
        "g_emb": rng.standard_normal((2, 6, D)).astype(f),
        "w": rng.standard_normal((ROWS, D)).astype(f),
        "b": rng.standard_normal(ROWS).astype(f),
        "x": rng.standard_normal((2, 6, D)).astype(f),
        "g_row": rng.standard_normal((2, 6, ROWS)).astype(f),
    }


def _torch_extras(mesh, rank, a):
    import torch

    from hp_dtensor import Shard
    from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    emb = torch.nn.Embedding(V, D)
    emb.weight.data.copy_(torch.tensor(a["table"]))
    parallelize_module(emb, mesh, ColwiseParallel())
    out = emb(torch.tensor(a["ids"]).long())
    (out * torch.tensor(_chunk(a["g_emb"], 2, rank))).sum().backward()
    lin = torch.nn.Linear(D, ROWS)
    lin.weight.data.copy_(torch.tensor(a["w"]))
    lin.bias.data.copy_(torch.tensor(a["b"]))
    parallelize_module(lin, mesh, RowwiseParallel(output_layouts=Shard(1)))
    x = torch.tensor(_chunk(a["x"], 2, rank), requires_grad=True)
    y = lin(x)
    (y * torch.tensor(_chunk(a["g_row"], 1, rank))).sum().backward()
    return {
        "emb": out.detach().numpy(),
        "emb_grad": emb.weight.grad.to_local().numpy(),
        "row": y.detach().numpy(),
        "row_dw": lin.weight.grad.to_local().numpy(),
        "row_db": lin.bias.grad.to_local().numpy(),
        "row_dx": x.grad.numpy(),
    }


def _ms_extras(mesh, rank, a):
    import mindspore as ms

    from hp_dtensor import Shard
    from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    emb = ms.nn.Embedding(V, D)
    emb.embedding_table.set_data(ms.Tensor(a["table"]))
    parallelize_module(emb, mesh, ColwiseParallel())
    ids, g_emb = ms.Tensor(a["ids"]), ms.Tensor(_chunk(a["g_emb"], 2, rank))
    out = emb(ids)
    (table_grad,) = ms.grad(lambda i: (emb(i) * g_emb).sum(), None, emb.trainable_params())(ids)
    lin = ms.nn.Dense(D, ROWS)
    lin.weight.set_data(ms.Tensor(a["w"]))
    lin.bias.set_data(ms.Tensor(a["b"]))
    parallelize_module(lin, mesh, RowwiseParallel(output_layouts=Shard(1)))
    x, g_row = ms.Tensor(_chunk(a["x"], 2, rank)), ms.Tensor(_chunk(a["g_row"], 1, rank))
    y = lin(x)
    params = lin.trainable_params()
    dx, dws = ms.grad(lambda v: (lin(v) * g_row).sum(), 0, params)(x)
    grads = {p.name.split(".")[-1]: d.asnumpy() for p, d in zip(params, dws)}
    return {
        "emb": out.asnumpy(),
        "emb_grad": table_grad.asnumpy(),
        "row": y.asnumpy(),
        "row_dw": grads["weight"],
        "row_db": grads["bias"],
        "row_dx": dx.asnumpy(),
    }


def extras_body(framework: str):
    """ColwiseParallel on an embedding and RowwiseParallel(output_layouts=Shard(1)) on a
    biased linear: local outputs and gradients."""
    import hp_dtensor as hp

    mesh = hp.init_device_mesh("cpu", (WORLD,))
    run = {"torch": _torch_extras, "mindspore": _ms_extras}[framework]
    return run(mesh, mesh.get_coordinate()[0], _extra_arrays())


def _check_extras(results):
    a = _extra_arrays()
    full_emb = a["table"][a["ids"]]
    emb_grad = np.zeros((V, D), np.float32)
    np.add.at(emb_grad, a["ids"].reshape(-1), a["g_emb"].reshape(-1, D))
    row = a["x"] @ a["w"].T + a["b"]
    g = a["g_row"]
    dw, db, dx = np.einsum("bso,bsi->oi", g, a["x"]), g.sum((0, 1)), g @ a["w"]
    for rank, r in enumerate(results):
        close = dict(rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r["emb"], _chunk(full_emb, 2, rank), **close)
        np.testing.assert_allclose(r["emb_grad"], _chunk(emb_grad, 1, rank), **close)
        np.testing.assert_allclose(r["row"], _chunk(row, 1, rank), **close)
        np.testing.assert_allclose(r["row_dw"], _chunk(dw, 1, rank), **close)
        np.testing.assert_allclose(r["row_db"], db, **close)
        np.testing.assert_allclose(r["row_dx"], _chunk(dx, 2, rank), **close)


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_embedding_and_sequence_sharded_rowwise(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, extras_body, framework)
    _check_extras(results)


def _to_numpy(t):
    return t.asnumpy() if hasattr(t, "asnumpy") else t.detach().numpy()


def _mixed_refusal(hp, mesh, framework):
    """A tensor of the other framework on this mesh is refused with ShardingError."""
    if framework == "mindspore":
        import torch

        other = torch.zeros(2)
    elif HAVE_MS:
        import mindspore as ms

        other = ms.Tensor(np.zeros(2, np.float32))
    else:
        return "not checked (no MindSpore here)"
    try:
        hp.DTensor.from_local(other, mesh, [_placement("R")])
    except hp.ShardingError as e:
        if "device_mesh was built for" not in str(e):
            return f"refused for another reason: {e}"
        return "refused: " + str(e).split(":")[0]
    return "accepted"


def _check(results):
    """Compare every rank's arrays with the numpy oracle."""
    x, noise, g = _ints(1), _ints(2), _ints(3)
    refused = []
    for key, r0 in results[0].items():
        if key == "mixed":
            for res in results:
                assert res[key].startswith(("refused: ", "not checked")), res[key]
            continue
        if r0[0] == "refused":
            assert all(res[key] == r0 for res in results), key
            refused.append(key)
            continue
        if key[0] in ("distribute", "full_tensor"):
            p = key[1] if key[0] == "distribute" else "R"
            for rank, res in enumerate(results):
                np.testing.assert_array_equal(res[key][1], _local(x, p, rank, noise), str(key))
            continue
        s, d = key
        ys = [res[key][1] for res in results]
        dxs = [res[key][2] for res in results]
        if d == "Psum":
            np.testing.assert_array_equal(sum(ys), x, str(key))
        elif d == "Pavg":
            np.testing.assert_array_equal(sum(ys) / WORLD, x, str(key))
        elif d == "Pmax":
            np.testing.assert_array_equal(np.max(ys, 0), x, str(key))
        else:
            for rank, y in enumerate(ys):
                np.testing.assert_array_equal(y, _local(x, d, rank, noise), str(key))
        for rank, dx in enumerate(dxs):
            want = _grad_local(g, s, rank, x, noise)
            np.testing.assert_array_equal(dx, want, f"gradient {key} rank {rank}")
    assert not refused, f"every pair has a plan, yet these were refused: {refused}"


_RESULTS: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_every_redistribution_on_a_1d_mesh(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, redistribution_body, framework)
    _check(results)
    _RESULTS[framework] = results


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_llama_block_tp2_matches_one_rank(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, tp_block_body, framework)
    _check_block(results)
    _BLOCK[framework] = results


_BLOCK: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_llama_block_tp2_sequence_parallel_matches_one_rank(framework, request, tmp_path):
    results = run_framework(framework, request, tmp_path, sp_block_body, framework)
    _check_sp_block(results)
    _SP[framework] = results


_SP: dict[str, list] = {}


def test_sequence_parallel_block_same_in_both_frameworks():
    """TP + SP on the same weights and inputs: both frameworks' shards and gradients agree."""
    if len(_SP) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(WORLD):
        t, m = _SP["torch"][rank]["sp"], _SP["mindspore"][rank]["sp"]
        np.testing.assert_allclose(m[0], t[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(m[2], t[2], rtol=1e-5, atol=1e-5)
        for name in t[1]:
            np.testing.assert_allclose(m[1][name], t[1][name], rtol=1e-5, atol=1e-5)


def test_llama_block_same_in_both_frameworks():
    """The same weights and inputs through torch and MindSpore: outputs and gradients agree
    (different kernels: within float32 rounding)."""
    if len(_BLOCK) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(WORLD):
        for which in ("ref", "tp"):
            t, m = _BLOCK["torch"][rank][which], _BLOCK["mindspore"][rank][which]
            np.testing.assert_allclose(m[0], t[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(m[2], t[2], rtol=1e-5, atol=1e-5)
            assert m[1].keys() == t[1].keys()
            for name in t[1]:
                np.testing.assert_allclose(m[1][name], t[1][name], rtol=1e-5, atol=1e-5)


def test_both_frameworks_give_the_same_arrays():
    """Same inputs, same plans: the two frameworks' local results agree to the last bit."""
    if len(_RESULTS) < 2:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for rank in range(WORLD):
        a, b = _RESULTS["torch"][rank], _RESULTS["mindspore"][rank]
        assert a.keys() == b.keys()
        for key in a:
            if key == "mixed":
                continue
            assert a[key][0] == b[key][0], key
            for u, v in zip(a[key][1:], b[key][1:]):
                if isinstance(u, np.ndarray):
                    np.testing.assert_array_equal(u, v, str(key))
                else:
                    assert u == v, key
