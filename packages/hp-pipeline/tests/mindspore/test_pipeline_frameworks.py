"""Pipeline schedules on both frameworks with one test body: a Llama-style model of one
block per stage, GPipe, 1F1B and interleaved 1F1B on 2 and 4 ranks, three SGD steps, against
a one-process run of the whole model in the same framework (losses and every trained
parameter); then MindSpore against torch on the same weights and batches. The batch-size
refusal, and the MindSpore stage's refusals by name.

Torch runs on hp_testing's gloo ranks; MindSpore on msrun CPU workers (skipped where
MindSpore is not installed: ``nox -s tests_mindspore`` installs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

VOCAB, DIM, HEADS, KV, HIDDEN, SEQ = 23, 16, 4, 2, 24, 8
BATCH, MICRO, STEPS, LR = 8, 4, 3, 0.5
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # name -> stages per rank


def _schedules(pp: int) -> dict:
    return SCHEDULES


pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4)


def _weights(layers: int) -> dict[str, np.ndarray]:
    """The whole model's parameters under torch's ``TinyLlama`` names."""
    rng = np.random.default_rng(5)

    def mat(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    hd = DIM // HEADS
    w = {"tok.weight": rng.standard_normal((VOCAB, DIM)).astype(np.float32)}
    for k in range(layers):
        p = f"layers.{k}."
        w[p + "attention_norm.weight"] = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
        w[p + "wq.weight"] = mat(HEADS * hd, DIM)
        w[p + "wk.weight"] = mat(KV * hd, DIM)
        w[p + "wv.weight"] = mat(KV * hd, DIM)
        w[p + "wo.weight"] = mat(DIM, HEADS * hd)
        w[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
        w[p + "w1.weight"] = mat(HIDDEN, DIM)
        w[p + "w3.weight"] = mat(HIDDEN, DIM)
        w[p + "w2.weight"] = mat(DIM, HIDDEN)
        w[p + "w2.bias"] = (0.1 * rng.standard_normal(DIM)).astype(np.float32)
    w["norm.weight"] = np.ones(DIM, np.float32)
    w["out.weight"] = mat(VOCAB, DIM)
    return w


def _batches(batch: int = BATCH):
    rng = np.random.default_rng(9)
    return [
        (
            rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int32),
            rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int32),
        )
        for _ in range(STEPS)
    ]


def _rope():
    hd = DIM // HEADS
    inv = 1.0 / 10000 ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.outer(np.arange(SEQ, dtype=np.float32), inv)
    ang = np.concatenate([ang, ang], -1)[None, :, None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# -- torch -----------------------------------------------------------------------------------
def _torch_model(layers, lo=0, hi=None, first=True, last=True):
    import torch

    from hp_testing.models import LlamaStage, TinyLlama

    full = TinyLlama(VOCAB, DIM, layers, HEADS, KV, HIDDEN, SEQ)
    full.load_state_dict({k: torch.tensor(v) for k, v in _weights(layers).items()})
    if hi is None:
        return full, {n: n for n, _ in full.named_parameters()}
    st = LlamaStage(full, lo, hi, first, last)
    return st, st.names


def _torch_loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1).long())


def _torch_schedule(name, v, pp, rank):
    import torch

    import hp_pipeline as hpp

    n = pp * v
    mine = [s for s in range(n) if s % pp == rank]
    built = [_torch_model(n, s, s + 1, s == 0, s == n - 1) for s in mine]
    stages = [hpp.PipelineStage(m, s, n) for (m, _), s in zip(built, mine)]
    cls = {"gpipe": hpp.ScheduleGPipe, "1f1b": hpp.Schedule1F1B}.get(
        name, hpp.ScheduleInterleaved1F1B
    )
    sched = cls(stages, MICRO, _torch_loss)
    params = [p for m, _ in built for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for x, y in _batches():
        got = []
        sched.step(
            *((torch.tensor(x),) if 0 in mine else ()),
            **({"target": torch.tensor(y), "losses": got} if n - 1 in mine else {}),
        )
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(got)) / MICRO if got else None)
    trained = {names[k]: p.detach().numpy() for m, names in built for k, p in m.named_parameters()}
    return losses, trained


def _torch_reference(layers):
    import torch

    model, _ = _torch_model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = _torch_loss(model(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: p.detach().numpy() for k, p in model.named_parameters()}


# -- MindSpore -------------------------------------------------------------------------------
def _ms_cells():
    import mindspore as ms
    from mindspore import nn, ops

    sys.path.insert(
        0, str(Path(__file__).resolve().parents[3] / "hp-dtensor" / "tests" / "mindspore")
    )
    from ms_llama import Block, RMSNorm

    class Stage(nn.Cell):
        """Layers [lo, hi) of the model; the first embeds, the last norms and projects."""

        def __init__(self, lo, hi, first, last):
            super().__init__()
            self.lo, self.first, self.last = lo, first, last
            if first:
                self.tok = nn.Embedding(VOCAB, DIM)
            self.layers = nn.CellList([Block(DIM, HEADS, KV, HIDDEN) for _ in range(lo, hi)])
            if last:
                self.norm = RMSNorm(DIM)
                self.out = nn.Dense(DIM, VOCAB, has_bias=False)
            cos, sin = _rope()
            self.cos, self.sin = ms.Tensor(cos), ms.Tensor(sin)

        def construct(self, x):
            if self.first:
                x = self.tok(x)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            if self.last:
                x = self.out(self.norm(x))
            return x

        def torch_names(self) -> dict:
            """MindSpore parameter path -> the torch model's name."""
            out = {}
            for path, _ in self.parameters_and_names():
                name = path.replace("embedding_table", "weight")
                if name.startswith("layers."):
                    _, i, rest = name.split(".", 2)
                    name = f"layers.{self.lo + int(i)}.{rest}"
                out[path] = name
            return out

    def load(cell, layers):
        w = _weights(layers)
        for path, p in cell.parameters_and_names():
            p.set_data(ms.Tensor(w[cell.torch_names()[path]]))
        return cell

    def loss(logits, target):
        return ops.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    return Stage, load, loss


def _ms_schedule(name, v, pp, rank):
    import mindspore as ms
    from mindspore import nn

    import hp_pipeline as hpp

    Stage, load, loss = _ms_cells()
    n = pp * v
    mine = [s for s in range(n) if s % pp == rank]
    cells = [load(Stage(s, s + 1, s == 0, s == n - 1), n) for s in mine]
    stages = [hpp.PipelineStage(c, s, n) for c, s in zip(cells, mine)]
    cls = {"gpipe": hpp.ScheduleGPipe, "1f1b": hpp.Schedule1F1B}.get(
        name, hpp.ScheduleInterleaved1F1B
    )
    sched = cls(stages, MICRO, loss)
    # one optimizer per stage: MindSpore wants unique parameter names in one optimizer, and
    # each stage's cell names its blocks from 0
    opts = [nn.SGD(list(st.weights), learning_rate=LR) for st in stages]
    losses = []
    for x, y in _batches():
        got = []
        sched.step(
            *((ms.Tensor(x),) if 0 in mine else ()),
            **({"target": ms.Tensor(y), "losses": got} if n - 1 in mine else {}),
        )
        for opt, st in zip(opts, stages):
            opt(st.grads)
        assert len(sched.grads()) == len(sched.weights()) == sum(len(st.weights) for st in stages)
        losses.append(float(sum(float(g.asnumpy()) for g in got)) / MICRO if got else None)
    trained = {}
    for c in cells:
        names = c.torch_names()
        trained.update({names[k]: p.asnumpy() for k, p in c.parameters_and_names()})
    return losses, trained


def _ms_reference(layers):
    import mindspore as ms
    from mindspore import nn

    Stage, load, loss = _ms_cells()
    model = load(Stage(0, layers, True, True), layers)
    opt = nn.SGD(model.trainable_params(), learning_rate=LR)
    step = ms.value_and_grad(
        lambda x, y: loss(model(x), y), grad_position=None, weights=model.trainable_params()
    )
    losses = []
    for x, y in _batches():
        value, grads = step(ms.Tensor(x), ms.Tensor(y))
        opt(grads)
        losses.append(float(value.asnumpy()))
    names = model.torch_names()
    return losses, {names[k]: p.asnumpy() for k, p in model.parameters_and_names()}


def _refusal(framework, pp, rank):
    """A batch of 7 rows for 4 microbatches: every rank's error message (None: no error)."""
    import hp_pipeline as hpp

    if framework == "torch":
        import torch

        module, _ = _torch_model(pp, rank, rank + 1, rank == 0, rank == pp - 1)
        loss, tensor = _torch_loss, torch.tensor
    else:
        import mindspore as ms

        Stage, load, loss = _ms_cells()
        module, tensor = load(Stage(rank, rank + 1, rank == 0, rank == pp - 1), pp), ms.Tensor
    sched = hpp.Schedule1F1B(hpp.PipelineStage(module, rank, pp), MICRO, loss)
    x, y = _batches(BATCH - 1)[0]
    try:
        sched.step(
            *((tensor(x),) if rank == 0 else ()),
            **({"target": tensor(y)} if rank == pp - 1 else {}),
        )
    except hpp.PipelineError as e:
        return str(e)
    return None


def _ms_refused_arguments(pp, rank, mesh):
    """What a MindSpore stage or schedule cannot honour raises, naming it."""
    import hp_pipeline as hpp
    from hp_fsdp import fully_shard

    Stage, load, loss = _ms_cells()
    cell = Stage(rank, rank + 1, rank == 0, rank == pp - 1)
    out = []
    st = hpp.PipelineStage(cell, rank, pp)
    partly = Stage(rank, rank + 1, rank == 0, rank == pp - 1)
    fully_shard(partly.layers[0], mesh=mesh)  # the blocks only: nothing would reduce
    for make in (
        lambda: hpp.ScheduleZBV([st], MICRO, loss),
        lambda: hpp.Schedule1F1B(st, MICRO, loss, overlap_b_f=True),
        lambda: hpp.Schedule1F1B(st, MICRO, loss, record_timeline=True),
        lambda: hpp.PipelineStage(cell, rank, pp, activation_hooks=lambda i: None),
        lambda: hpp.PipelineStage(cell, pp, pp),
        lambda: hpp.PipelineStage(cell, rank, pp, device="cuda"),
        lambda: hpp.PipelineStage(cell, rank, pp, direct_weight_grads=False),
        lambda: hpp.PipelineSchedule(st, MICRO, loss),
        lambda: hpp.Schedule1F1B(hpp.PipelineStage(cell, 0, 1), MICRO, loss),
        lambda: hpp.PipelineStage(partly, rank, pp),
    ):
        try:
            make()
            out.append(None)
        except hpp.PipelineError as e:
            out.append(str(e))
    return out


# -- PP 2 x FSDP 2 -----------------------------------------------------------------------------
PP_FSDP = ("1f1b", 2)  # schedule, microbatches on each data-parallel replica (half the batch)


def _dp_rows(x, dp_rank: int):
    half = BATCH // 2
    return x[dp_rank * half : (dp_rank + 1) * half]


def _torch_pp_fsdp(mesh, pp_rank, dp_rank):
    import torch

    import hp_pipeline as hpp
    from hp_fsdp import fully_shard

    name, m = PP_FSDP
    st, names = _torch_model(2, pp_rank, pp_rank + 1, pp_rank == 0, pp_rank == 1)
    for layer in st.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(st, mesh=mesh["dp"])
    sched = hpp.Schedule1F1B(
        hpp.PipelineStage(st, pp_rank, 2, group=mesh.get_group("pp")), m, _torch_loss
    )
    opt = torch.optim.SGD(st.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        got = []
        x, y = torch.tensor(_dp_rows(x, dp_rank)), torch.tensor(_dp_rows(y, dp_rank))
        sched.step(
            *((x,) if pp_rank == 0 else ()), **({"target": y, "losses": got} if pp_rank else {})
        )
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(got)) / m if got else None)
    trained = {names[k]: p.full_tensor().detach().numpy() for k, p in st.named_parameters()}
    return losses, trained


def _ms_pp_fsdp(mesh, pp_rank, dp_rank):
    import mindspore as ms
    from mindspore import nn

    import hp_dtensor
    import hp_pipeline as hpp
    from hp_fsdp import fully_shard

    name, m = PP_FSDP
    Stage, load, loss = _ms_cells()
    cell = load(Stage(pp_rank, pp_rank + 1, pp_rank == 0, pp_rank == 1), 2)
    names = cell.torch_names()
    shapes = {k: tuple(p.shape) for k, p in cell.parameters_and_names()}
    for layer in cell.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(cell, mesh=mesh["dp"])
    stage = hpp.PipelineStage(cell, pp_rank, 2, group=mesh.get_group("pp"))
    assert stage.sharded
    # the optimizer holds the shards: half of each parameter's rows (padded)
    assert all(
        w.shape[0] == -(-shapes[k][0] // 2) for k, w in zip(shapes, stage.weights, strict=True)
    )
    sched = hpp.Schedule1F1B(stage, m, loss)
    opt = nn.SGD(list(stage.weights), learning_rate=LR)
    platform = hp_dtensor.get_platform()
    calls = {"all_gather_into": 0, "reduce_scatter_into": 0}

    def counted(op):
        real = getattr(platform, op)

        def run(*a, **k):
            calls[op] += 1
            return real(*a, **k)

        return run

    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step == 0:  # count the first step's collectives on the data-parallel mesh
            for op in calls:
                setattr(platform, op, counted(op))
        got = []
        x, y = ms.Tensor(_dp_rows(x, dp_rank)), ms.Tensor(_dp_rows(y, dp_rank))
        sched.step(
            *((x,) if pp_rank == 0 else ()), **({"target": y, "losses": got} if pp_rank else {})
        )
        assert [tuple(g.shape) for g in stage.grads] == [tuple(w.shape) for w in stage.weights]
        opt(stage.grads)
        losses.append(float(sum(float(g.asnumpy()) for g in got)) / m if got else None)
        if step == 0:
            for op in calls:
                delattr(platform, op)
            # two groups (the block, the stage's rest): each gathered once and reduced once
            # in the step, not once per microbatch
            assert calls == {"all_gather_into": 2, "reduce_scatter_into": 2}, calls
    # the whole parameters, gathered: each sharded cell of the tree gathers its group
    groups = [c for _, c in cell.cells_and_names() if hasattr(c, "unshard")]
    for c in groups:
        c.unshard()
    trained = {names[k]: p.asnumpy().copy() for k, p in cell.parameters_and_names()}
    for c in groups:
        c.reshard()
    assert {k: v.shape for k, v in trained.items()} == {names[k]: v for k, v in shapes.items()}
    # replicas given batches of different sizes (4 rows, 3 rows: 3 does not split in 2): the
    # second replica refuses, and the first must not wait for it in a gather: all raise
    x, y = _batches()[0]
    rows = 4 - dp_rank
    try:
        sched.step(
            *((ms.Tensor(x[:rows]),) if pp_rank == 0 else ()),
            **({"target": ms.Tensor(y[:rows])} if pp_rank else {}),
        )
        refusal = None
    except hpp.PipelineError as e:
        refusal = str(e)
    assert refusal is not None
    assert ("batch size 3" in refusal) if dp_rank else ("refused this step" in refusal), refusal
    assert not any(c._hp_fsdp.held or c._hp_fsdp.unsharded for c in groups)  # let go
    return losses, trained


def pp_fsdp_body(framework: str):
    """PP 2 x FSDP 2 on 4 ranks (mesh pp x dp): this rank's losses and the whole trained
    parameters of its stage; rank 0 adds the one-process reference of the same 8-row batches
    (each data-parallel replica trains on half of them)."""
    import hp_dtensor as hp

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    assert mesh.framework == framework
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    run, ref = {
        "torch": (_torch_pp_fsdp, _torch_reference),
        "mindspore": (_ms_pp_fsdp, _ms_reference),
    }[framework]
    out = {"run": run(mesh, pp_rank, dp_rank), "dp": dp_rank, "pp": pp_rank}
    if mesh.get_rank() == 0:
        out["ref"] = ref(2)
    return out


def pipeline_body(framework: str, pp: int):
    """Per schedule: (this rank's step losses, its trained parameters); the one-process
    reference's; and the batch-size refusal's message."""
    import hp_dtensor as hp

    mesh = hp.init_device_mesh("cpu", (pp,))
    assert mesh.framework == framework
    rank = mesh.get_coordinate()[0]
    run, ref = {
        "torch": (_torch_schedule, _torch_reference),
        "mindspore": (_ms_schedule, _ms_reference),
    }[framework]
    # the refusal: on 2 ranks, which hold the first and the last stage, both split the batch;
    # on 4, MindSpore's middle stages see no batch and learn of the refusal from the others
    # (torch's would wait on the first stage's activations: not run there)
    out = {
        "refusal": _refusal(framework, pp, rank) if pp == 2 or framework == "mindspore" else None
    }
    for name, v in _schedules(pp).items():
        out[name] = run(name, v, pp, rank)
        if "ref" + str(v) not in out:  # one reference per model depth
            out["ref" + str(v)] = ref(pp * v)
    if framework == "mindspore":
        out["refused"] = _ms_refused_arguments(pp, rank, mesh)
    return out


def _check(results, pp, framework):
    for name, v in _schedules(pp).items():
        ref_losses, ref_params = results[0]["ref" + str(v)]
        last = (pp * v - 1) % pp  # the rank of the last stage reports the losses
        np.testing.assert_allclose(results[last][name][0], ref_losses, rtol=1e-5, err_msg=name)
        seen = set()
        for r in results:
            for k, got in r[name][1].items():
                np.testing.assert_allclose(
                    got, ref_params[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}"
                )
                seen.add(k)
        assert seen == set(ref_params), (name, set(ref_params) - seen)
        # the steps moved the weights (a zero learning rate would pass vacuously)
        assert not np.allclose(
            ref_params["layers.0.wq.weight"], _weights(pp * v)["layers.0.wq.weight"]
        )
        assert ref_losses[-1] < ref_losses[0], ref_losses
    for k, r in enumerate(results if pp == 2 or framework == "mindspore" else ()):
        if k in (0, pp - 1):  # the first and last stages split a batch
            assert r["refusal"] and "batch size 7" in r["refusal"], r["refusal"]
            assert "n_microbatches=4" in r["refusal"]
        elif r["refusal"] is not None:  # a middle stage names the ranks that refused
            assert f"pipeline rank(s) [0, {pp - 1}] refused" in r["refusal"], r["refusal"]


_RESULTS: dict[tuple[str, int], list] = {}


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_pipeline_schedules_match_one_process(framework, pp, request, tmp_path):
    results = run_framework(
        framework, request, tmp_path, pipeline_body, framework, pp, pool=f"pool{pp}", workers=pp
    )
    _check(results, pp, framework)
    if framework == "mindspore":
        assert all(r["refusal"] for r in results)  # every rank stopped, none waits
        refused = results[0]["refused"]
        zbv, overlap, timeline, hooks, index, device, direct, base, few, partly = refused
        assert "ScheduleZBV" in zbv and "FULL_B" in zbv
        assert "overlap_b_f=True" in overlap
        assert "record_timeline=True" in timeline
        assert "activation_hooks" in hooks and "hp_offload" in hooks
        assert "stage_index" in index
        assert "device='cuda'" in device and "CPU" in device
        assert "direct_weight_grads=False" in direct
        assert "not the base class" in base and "Schedule1F1B" in base
        assert "num_stages=1" in few and f"multiple of {pp}" in few
        assert "layers.0" in partly and "apply fully_shard to the stage's cell" in partly
    _RESULTS[(framework, pp)] = results


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_same_in_both_frameworks(pp):
    """The same weights and batches: losses and trained parameters agree across frameworks."""
    if ("torch", pp) not in _RESULTS or ("mindspore", pp) not in _RESULTS:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    t, m = _RESULTS[("torch", pp)], _RESULTS[("mindspore", pp)]
    for name in _schedules(pp):
        for rank in range(pp):
            tl, ml = t[rank][name][0], m[rank][name][0]
            if tl[0] is not None:
                np.testing.assert_allclose(ml, tl, rtol=1e-5, err_msg=name)
            for k, want in t[rank][name][1].items():
                np.testing.assert_allclose(
                    m[rank][name][1][k], want, rtol=1e-4, atol=1e-5, err_msg=f"{name} {k}"
                )


_PP_FSDP: dict[str, list] = {}


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_pp2_fsdp2_matches_one_process(framework, request, tmp_path):
    """Each stage sharded over its data-parallel pair: the losses (the replicas' mean) and every
    gathered parameter equal the one-process run on the whole batch."""
    results = run_framework(
        framework, request, tmp_path, pp_fsdp_body, framework, pool="pool4", workers=4
    )
    ref_losses, ref_params = results[0]["ref"]
    last = [r["run"][0] for r in results if r["pp"] == 1]
    np.testing.assert_allclose(np.mean(last, axis=0), ref_losses, rtol=1e-5)
    assert not np.allclose(last[0], last[1])  # the replicas saw different rows
    seen = set()
    for r in results:
        for k, got in r["run"][1].items():
            np.testing.assert_allclose(got, ref_params[k], rtol=1e-5, atol=1e-6, err_msg=k)
            seen.add(k)
    assert seen == set(ref_params)
    assert not np.allclose(ref_params["layers.0.wq.weight"], _weights(2)["layers.0.wq.weight"])
    _PP_FSDP[framework] = results


def test_pp2_fsdp2_same_in_both_frameworks():
    if set(_PP_FSDP) != {"torch", "mindspore"}:
        pytest.skip("needs both frameworks' runs in this session (nox -s tests_mindspore)")
    for t, m in zip(_PP_FSDP["torch"], _PP_FSDP["mindspore"]):
        if t["run"][0][0] is not None:
            np.testing.assert_allclose(m["run"][0], t["run"][0], rtol=1e-5)
        for k, want in t["run"][1].items():
            np.testing.assert_allclose(m["run"][1][k], want, rtol=1e-4, atol=1e-5, err_msg=k)
