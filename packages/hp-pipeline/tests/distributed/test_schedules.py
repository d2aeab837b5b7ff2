"""Every schedule on 2 and 4 gloo ranks against one process (losses, gradients, parameters over
3 SGD steps), with and without overlap, with FSDP inside the stages, and against
torch.distributed.pipelining on the same split."""

import pytest
import torch
import torch.distributed as dist
from pp_model import SEQ, batches, loss_fn, make_model, reference, split

import hp_dtensor as hp
from hp_fsdp import fully_shard
from hp_pipeline import (
    PipelineError,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBV,
    build_schedule,
)
from hp_testing.pytest_plugin import rank_pool_fixture

pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4)

OURS = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "zbv": (ScheduleZBV, 2),
}
STEPS, LR = 3, 0.5


def _run(
    name,
    m,
    batch,
    *,
    overlap_p2p=False,
    overlap_b_f=False,
    threaded=False,
    fsdp=False,
    impl="ours",
    cuda_graphs=False,
    declare=None,
):
    """On every rank: build this rank's stages, run STEPS steps; return (losses per step on
    the last stage's rank, gradients of the last step, parameters after) by full-model name.
    ``cuda_graphs``: on this rank's GPU (NCCL), every stage graphed."""
    if fsdp:
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        group, dp_mesh = mesh.get_group("pp"), mesh["dp"]
        rank, pp = mesh.get_local_rank("pp"), 2
        dp_rank, dp = mesh.get_local_rank("dp"), 2
    else:
        group, rank, pp, dp_rank, dp = None, dist.get_rank(), dist.get_world_size(), 0, 1
    cls, v = OURS[name]
    n_stages = pp * v
    placement = build_schedule(name, pp, m)[1]
    mine = [s for s in range(n_stages) if placement[s] == rank]
    every = split(make_model(n_stages), n_stages)
    mods = {s: every[s] for s in mine}
    dev = torch.device("cuda", rank) if cuda_graphs else None
    if dev is not None:
        torch.cuda.set_device(dev)
        mods = {s: mod.to(dev) for s, mod in mods.items()}
    if fsdp:
        for mod in mods.values():
            for layer in mod.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(mod, mesh=dp_mesh)
    if impl == "ours":
        stages = [
            PipelineStage(mods[s], s, n_stages, group=group, device=dev, cuda_graphs=cuda_graphs)
            for s in mine
        ]
        sched = cls(
            stages if v > 1 else stages[0],
            m,
            loss_fn=loss_fn,
            overlap_p2p=overlap_p2p,
            overlap_b_f=overlap_b_f,
            threaded_b_f=threaded,
        )
        if declare is not None:  # every stage receives this (microbatch, seq, dim) float32
            sched.declare_input_shapes({s: [(declare, torch.float32)] for s in range(1, n_stages)})
            import hp_pipeline._runtime as rt

            def no_header(h):  # a declared channel carries none: reading one is a bug
                raise AssertionError("a shape header was read on a declared channel")

            parse_header, rt._parse_header = rt._parse_header, no_header
    else:
        import torch.distributed.pipelining as tp

        tcls = {
            "gpipe": tp.ScheduleGPipe,
            "1f1b": tp.Schedule1F1B,
            "interleaved_1f1b": tp.ScheduleInterleaved1F1B,
            "zbv": tp.ScheduleZBVZeroBubble,
        }[name]
        stages = [tp.PipelineStage(mods[s], s, n_stages, torch.device("cpu")) for s in mine]
        sched = tcls(stages if v > 1 else stages[0], m, loss_fn=loss_fn)
    params = [p for mod in mods.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    out_losses = []
    for x, y in batches(STEPS, batch * dp):
        x, y = x.chunk(dp)[dp_rank].to(dev), y.chunk(dp)[dp_rank].to(dev)
        opt.zero_grad()
        losses = []
        args = (x,) if 0 in mods else ()
        kw = {"target": y, "losses": losses} if n_stages - 1 in mods else {}
        sched.step(*args, **kw)
        out_losses.append([float(v) for v in losses])
        grads = {
            mods[s].names[n]: _full(p.grad)
            for s in mine
            for n, p in mods[s].named_parameters()
            if p.grad is not None
        }
        opt.step()
    final = {
        mods[s].names[n]: _full(p.detach()) for s in mine for n, p in mods[s].named_parameters()
    }
    if threaded:  # the helper thread did run backwards
        assert sched._helper is not None
    if declare is not None:  # this worker runs other tests next
        rt._parse_header = parse_header
    return out_losses, grads, final


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t.detach().cpu().clone()


def _check(results, name, m, batch, dp=1):
    pp = len(results) // dp
    v = OURS[name][1]
    ref_losses, ref_grads, ref_params = reference(pp * v, batches(STEPS, batch * dp), LR)
    step_losses = [r[0] for r in results if r[0] and r[0][0]]
    assert len(step_losses) == dp
    for k in range(STEPS):
        got = sum(sum(sl[k]) / m for sl in step_losses) / dp
        assert got == pytest.approx(ref_losses[k], rel=1e-5), (k, got, ref_losses[k])
    seen = set()
    for _, grads, params in results:
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-4, atol=1e-5, msg=n)
            seen.add(n)
    assert seen == set(ref_params), set(ref_params) - seen


@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_two_ranks_match_one_process(pool2, name, overlap_p2p):
    m, batch = 4, 8
    _check(pool2.run(_run, name, m, batch, overlap_p2p=overlap_p2p), name, m, batch)


@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_four_ranks_match_one_process(pool4, name, overlap_p2p):
    m, batch = 8, 8
    _check(pool4.run(_run, name, m, batch, overlap_p2p=overlap_p2p), name, m, batch)


@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_zbv_with_fewer_microbatches_than_the_v(pool2, overlap_p2p):
    """m = 1 < 2 * pp - 1: with overlap_p2p both ranks once read a shape header that the other
    would send only after its own header read, and hung on the first step."""
    m, batch = 1, 2
    _check(pool2.run(_run, "zbv", m, batch, overlap_p2p=overlap_p2p), "zbv", m, batch)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv"])
@pytest.mark.parametrize("threaded", [False, True])
def test_overlap_b_f_matches_one_process(pool2, name, threaded):
    """Fused backward + forward steps, also with the backward on a helper thread while the
    forward runs (``threaded_b_f``): same losses, gradients and parameters."""
    m, batch = 4, 8
    got = pool2.run(_run, name, m, batch, overlap_b_f=True, overlap_p2p=True, threaded=threaded)
    _check(got, name, m, batch)


def test_threaded_zbv_on_four_ranks_matches_one_process(pool4):
    """ZBV on 4 ranks (8 stages) with the backwards of B + F pairs and the W steps on the
    helper thread: W of one stage beside a FULL_B or another W of the same rank."""
    m, batch = 8, 16
    got = pool4.run(_run, "zbv", m, batch, overlap_b_f=True, threaded=True)
    _check(got, "zbv", m, batch)


def _grad_writers_never_overlap():
    """Run ZBV with threaded_b_f where the helper thread's W would meet this thread's FULL_B
    (rank 0 ends with ``3W7 ... 0FULL_B6``), each write made slow; return the (start, end,
    thread) of every weight-gradient write on this rank (a FULL_B's backward, a W)."""
    import threading
    import time

    import hp_pipeline._stage as stage_mod

    rank, m = dist.get_rank(), 8
    placement = build_schedule("zbv", 2, m)[1]
    mine = [s for s in range(4) if placement[s] == rank]
    every = split(make_model(4), 4)
    stages = [PipelineStage(every[s], s, 4) for s in mine]
    spans, depth = [], threading.local()

    def slow(fn):
        def run(*a, **k):
            outer = getattr(depth, "n", 0) == 0
            depth.n = getattr(depth, "n", 0) + 1
            t = time.perf_counter()
            if outer:
                time.sleep(0.02)  # a W still writing .grad while a FULL_B would set it
            try:
                return fn(*a, **k)
            finally:
                depth.n -= 1
                if outer:
                    spans.append((t, time.perf_counter(), threading.get_ident()))

        return run

    real_w = stage_mod.PipelineStage.__dict__["_weight_grads"]  # the staticmethod itself
    real_backward = torch.autograd.backward
    stage_mod.PipelineStage._weight_grads = staticmethod(slow(real_w.__func__))
    torch.autograd.backward = slow(real_backward)
    try:
        sched = ScheduleZBV(stages, m, loss_fn=loss_fn, overlap_b_f=True, threaded_b_f=True)
        x, y = batches(1, 8)[0]
        sched.step(*((x,) if 0 in mine else ()), **({"target": y} if 3 in mine else {}))
    finally:
        stage_mod.PipelineStage._weight_grads = real_w
        torch.autograd.backward = real_backward
    return spans


def test_threaded_weight_gradient_writes_never_overlap(pool2):
    """FULL_B and W write .grad (set it when unset, add into it): with threaded_b_f they run
    on two threads, one at a time."""
    for spans in pool2.run(_grad_writers_never_overlap):
        assert len({tid for *_, tid in spans}) == 2, "both threads wrote gradients"
        spans.sort()
        for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
            assert start >= end, spans


def _ddp_stage():
    from torch.nn.parallel import DistributedDataParallel as DDP

    return (
        PipelineStage(DDP(torch.nn.Linear(4, 4)), 0, 2).direct_weight_grads,
        PipelineStage(torch.nn.Linear(4, 4), 0, 2).direct_weight_grads,
    )


def test_ddp_stages_keep_autograd_weight_gradients(pool2):
    """DDP's reducer hooks each parameter's AccumulateGrad node: a stage holding a DDP module
    leaves every weight gradient to autograd."""
    assert pool2.run(_ddp_stage) == [(False, True)] * 2


@pytest.mark.parametrize("name", list(OURS))
def test_pp2_x_fsdp2_matches_one_process(pool4, name):
    m, batch = 4, 4
    _check(pool4.run(_run, name, m, batch, fsdp=True), name, m, batch, dp=2)


@pytest.mark.parametrize("name", list(OURS))
def test_same_as_torch_pipelining(pool2, name):
    m, batch = 4, 8
    ours = pool2.run(_run, name, m, batch)
    theirs = pool2.run(_run, name, m, batch, impl="torch")
    for (lo, go, po), (lt, gt, pt) in zip(ours, theirs):
        assert len(lo) == len(lt)
        for a, b in zip(lo, lt):
            assert a == pytest.approx(b, rel=1e-5)
        assert go.keys() == gt.keys() and po.keys() == pt.keys()
        for n in go:
            torch.testing.assert_close(go[n], gt[n], rtol=1e-4, atol=1e-6, msg=n)
        for n in po:
            torch.testing.assert_close(po[n], pt[n], rtol=1e-4, atol=1e-6, msg=n)


def _bad_batch():
    n_stages = dist.get_world_size()
    rank = dist.get_rank()
    mod = split(make_model(n_stages), n_stages)[rank]
    sched = Schedule1F1B(PipelineStage(mod, rank, n_stages), 4, loss_fn=loss_fn)
    x, y = batches(1, 6)[0]
    try:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
    except PipelineError as e:
        return str(e)
    return None


def test_indivisible_batch_is_a_clear_error_on_every_rank(pool2):
    msgs = pool2.run(_bad_batch)
    for msg in msgs:
        assert msg is not None and "n_microbatches=4" in msg and "batch size 6" in msg


def _count_fsdp_collectives(name):
    """PP 2 x FSDP 2: how many all-gathers and reduce-scatters each group runs per step."""
    import hp_fsdp._group as G

    counts = {"gather": {}, "reduce": {}}
    orig_copy, orig_reduce = G.ParamGroup._copy_out, G.ParamGroup._start_reduce

    def copy_out(self, *a, **k):
        counts["gather"][self.index] = counts["gather"].get(self.index, 0) + 1
        return orig_copy(self, *a, **k)

    def start_reduce(self, *a, **k):
        counts["reduce"][self.index] = counts["reduce"].get(self.index, 0) + 1
        return orig_reduce(self, *a, **k)

    G.ParamGroup._copy_out, G.ParamGroup._start_reduce = copy_out, start_reduce
    try:
        _run(name, 4, 4, fsdp=True)
    finally:
        G.ParamGroup._copy_out, G.ParamGroup._start_reduce = orig_copy, orig_reduce
    return counts


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_fsdp_stages_gather_and_reduce_once_per_step(pool4, name):
    for counts in pool4.run(_count_fsdp_collectives, name):
        assert counts["gather"] and set(counts["gather"].values()) == {STEPS}, counts
        assert counts["reduce"] and set(counts["reduce"].values()) == {STEPS}, counts


def _timeline_run(name, outdir):
    import os

    from hp_pipeline import plot_timeline, to_chrome_trace

    rank, pp = dist.get_rank(), dist.get_world_size()
    cls, v = OURS[name]
    n_stages = pp * v
    placement = build_schedule(name, pp, 4)[1]
    every = split(make_model(n_stages), n_stages)
    mine = [s for s in range(n_stages) if placement[s] == rank]
    stages = [PipelineStage(every[s], s, n_stages) for s in mine]
    sched = cls(stages if v > 1 else stages[0], 4, loss_fn=loss_fn, record_timeline=True)
    x, y = batches(1, 8)[0]
    sched.step(*((x,) if 0 in mine else ()), **({"target": y} if n_stages - 1 in mine else {}))
    events = sched.timeline
    gathered = [None] * pp
    dist.all_gather_object(gathered, events)
    allev = [e for evs in gathered for e in evs]
    if rank == 0:
        to_chrome_trace(allev, os.path.join(outdir, "trace.json"))
        plot_timeline(allev, os.path.join(outdir, "timeline.png"))
    return [str(e.step) for e in events], sched.bubble_fraction(), [str(s) for s in sched.steps]


def test_timeline_of_a_real_run(pool2, tmp_path):
    import json

    for steps_run, bubble, steps in pool2.run(_timeline_run, "1f1b", str(tmp_path)):
        assert [x for x in steps_run if not x.startswith("wait ")] == steps  # one per step
        assert 0.0 <= bubble < 1.0
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert "0F0" in names and "1FULL_B3" in names
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _wrong_stage():
    rank = dist.get_rank()
    mod = split(make_model(2), 2)[1 - rank]
    try:
        Schedule1F1B(PipelineStage(mod, 1 - rank, 2), 4, loss_fn=loss_fn)
    except PipelineError as e:
        return str(e)


def test_stage_on_the_wrong_rank_is_a_clear_error(pool2):
    msgs = pool2.run(_wrong_stage)
    assert "rank 0 must hold stages [0]" in msgs[0]
    assert "rank 1 must hold stages [1]" in msgs[1]


@pytest.mark.parametrize("name", list(OURS))
def test_declared_input_shapes_match_one_process(pool2, name):
    """declare_input_shapes: no header travels, the receive buffers come from the declaration,
    and the step is still the one-process reference."""
    m, batch = 4, 8
    _check(pool2.run(_run, name, m, batch, declare=(2, SEQ, 16)), name, m, batch)


def test_declared_input_shapes_are_checked():
    """Arguments first; then, on a fake process group of 2 (nothing arrives, as in hp-plan's
    dry run), a stage whose output differs from what its successor was declared to receive
    raises before sending."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    mods = split(make_model(2), 2)
    solo = ScheduleInterleaved1F1B(
        [PipelineStage(mods[0], 0, 2), PipelineStage(mods[1], 1, 2)], 2, loss_fn=loss_fn
    )
    for bad, match in (
        ([], "give a dict"),
        ({0: [((2, 8, 16), torch.float32)]}, "stages 1 .. 1"),
        ({"1": [((2, 8, 16), torch.float32)]}, "int stage indices"),
        ({2: [((2, 8, 16), torch.float32)]}, "stages 1 .. 1"),
        ({1: [(2, 8, 16)]}, "not a list of"),
        ({1: [((2, 8, 16), "float32")]}, "cannot travel"),
    ):
        with pytest.raises(PipelineError, match=match):
            solo.declare_input_shapes(bad)
    x, y = batches(1, 4)[0]
    solo.step(x, target=y)
    with pytest.raises(PipelineError, match="before the first step"):
        solo.declare_input_shapes({1: [((2, SEQ, 16), torch.float32)]})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        sched = Schedule1F1B(PipelineStage(mods[0], 0, 2), 2, loss_fn=loss_fn)
        sched.declare_input_shapes({1: [((2, SEQ, 15), torch.float32)]})
        with pytest.raises(PipelineError, match=r"stage 0 sends .* stage 1 was declared"):
            sched.step(x)
    finally:
        hp.destroy_process_group(barrier=False)


def test_stage_arguments_are_checked():
    mod = split(make_model(2), 2)[0]
    with pytest.raises(PipelineError, match="stage_index"):
        PipelineStage(mod, 2, 2)
    with pytest.raises(PipelineError, match="num_stages"):
        PipelineStage(mod, 0, 0)
    with pytest.raises(PipelineError, match="nn.Module"):
        PipelineStage(lambda x: x, 0, 1)


def test_threaded_b_f_needs_overlap_b_f_and_plain_stages():
    mod = split(make_model(1), 1)[0]
    with pytest.raises(PipelineError, match="pass overlap_b_f=True"):
        Schedule1F1B(PipelineStage(mod, 0, 1), 2, loss_fn=loss_fn, threaded_b_f=True)

    class Sharded(torch.nn.Sequential):  # what fully_shard's modules offer (ShardedModule)
        def unshard(self, async_op=False): ...
        def reshard(self): ...
        def set_requires_gradient_sync(self, flag, *, recurse=True): ...
        def set_reshard_after_forward(self, flag, *, recurse=True): ...
        def set_reshard_after_backward(self, flag, *, recurse=True): ...
        def reduce_gradients(self): ...

    sharded = Sharded(split(make_model(1), 1)[0])
    with pytest.raises(PipelineError, match="threaded_b_f=True with sharded stages"):
        Schedule1F1B(
            PipelineStage(sharded, 0, 1), 2, loss_fn=loss_fn, overlap_b_f=True, threaded_b_f=True
        )


def _given_shapes(shape):
    import warnings

    rank = dist.get_rank()
    mod = split(make_model(2), 2)[rank]
    given = (torch.empty(shape),) if rank == 1 else None
    sched = Schedule1F1B(PipelineStage(mod, rank, 2, input_args=given), 2, loss_fn=loss_fn)
    x, y = batches(1, 4)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == 1 else {}))
    return [str(w.message) for w in caught if "input_args" in str(w.message)]


def test_given_input_shapes_are_checked_against_what_arrives(pool2):
    assert pool2.run(_given_shapes, (2, 8, 16)) == [[], []]  # microbatch 2 x seq 8 x dim 16
    msgs = pool2.run(_given_shapes, (2, 8, 15))  # wrong: warned, and the step still completes
    assert msgs[0] == [] and len(msgs[1]) == 1
    assert (
        "input_args shapes [(2, 8, 15)] differ from what stage 0 sends [(2, 8, 16)]" in msgs[1][0]
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
@pytest.mark.parametrize("name", list(OURS))
def test_two_gpus_with_cuda_graphs_match_one_process(name):
    """Every stage graphed, on 2 GPUs over NCCL: the same losses, gradients and parameters as
    the one-process CPU reference."""
    from hp_testing import run_ranks

    m, batch = 4, 8
    results = run_ranks(
        _run, 2, args=(name, m, batch), kwargs={"cuda_graphs": True}, backend="nccl", timeout=180
    )
    _check(results, name, m, batch)
