"""cuda_graphs=True: a stage's forward and backward replayed from CUDA graphs give the losses
and gradients of the eager stage (CUDA only), and what cannot be graphed is refused up front."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_pipeline import (
    MetaStep,
    PipelineError,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleZBV,
    add_communication,
    v_placement,
    zbv_steps,
)
from hp_pipeline import MetaStepType as T

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm, self.up = nn.RMSNorm(d), nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = Block(d)

    def forward(self, ids):
        return self.block(self.emb(ids))


def _loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


class Scaled(nn.Module):
    """A loss with a parameter of its own (a learnt temperature), outside every stage."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, out, y):
        return F.cross_entropy(out.float().flatten(0, 1) * self.t, y.flatten())


class First(nn.Module):
    """Stage 0 of the folded V: passes its integer input on beside the activation (an output
    that wants no gradient)."""

    def __init__(self, head, body):
        super().__init__()
        self.head, self.body = head, body

    def forward(self, ids):
        return self.body(self.head(ids)), ids


class Second(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b
        self.unused = nn.Linear(2, 2)  # reached by no backward: its .grad must stay None

    def forward(self, h, ids):
        return self.b(self.a(h) + (ids[..., None] == 0).to(h.dtype))


class Whole(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, ids):
        return self.second(*self.first(ids))


class Checkpointed(nn.Module):
    """A block under activation checkpointing: its backward reruns its forward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _models(device, ckpt: bool = False):
    torch.manual_seed(0)
    wrap = Checkpointed if ckpt else (lambda b: b)
    return [
        Head().to(device),
        nn.Sequential(wrap(Block()), Block()).to(device),
        wrap(Block()).to(device),
        nn.Sequential(Block(), nn.Linear(32, 50)).to(device),
    ]


def _train(
    schedule: str,
    graphs: bool,
    amp: list[bool],
    m: int = 4,
    device: str = "cuda",
    ckpt: bool = False,
):
    """``len(amp)`` AdamW steps on one process (step ``i`` under bf16 autocast when
    ``amp[i]``); returns the losses, the first step's gradients, the final parameters and the
    schedule."""
    dev = torch.device(device)
    mods = _models(dev, ckpt)
    loss = Scaled().to(dev)
    if schedule.startswith("zbv"):  # the V folded onto one rank
        halves = First(*mods[:2]), Second(*mods[2:]).to(dev)
        stages = [
            PipelineStage(h, i, 2, device=dev, cuda_graphs=graphs) for i, h in enumerate(halves)
        ]
        sched = ScheduleZBV(stages, m, loss_fn=loss)
        # on one rank build_schedule merges every B + W: keep them apart (zbv), or merge the
        # even microbatches' only (zbv_mixed: each stage takes both kinds of backward)
        steps = []
        for st in zbv_steps(1, m)[0]:
            even = schedule == "zbv_mixed" and st.microbatch % 2 == 0
            if even and st.type is T.W:
                continue
            steps.append(
                MetaStep(T.FULL_B, st.stage, st.microbatch) if even and st.type is T.B else st
            )
        sched.steps = add_communication({0: steps}, v_placement(1))[0]
        kinds = {(s.stage, s.type.name) for s in sched.steps}
        assert {(0, "B"), (0, "W"), (1, "B"), (1, "W")} <= kinds
        assert ((0, "FULL_B") in kinds) == (schedule == "zbv_mixed")
        mods = list(halves)
    else:  # the same model as one stage
        model = Whole(First(*mods[:2]), Second(*mods[2:]).to(dev))
        mods = [model]
        stages = [PipelineStage(model, 0, 1, device=dev, cuda_graphs=graphs)]
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        sched = cls(stages[0], m, loss_fn=loss)
    params = [p for mod in [*mods, loss] for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(1)
    losses, first_grads = [], None
    for bf16 in amp:
        ids = torch.randint(0, 50, (2 * m, 8), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            got = []
            sched.step(ids, target=ids, losses=got)
        losses.append(torch.stack(got).float().cpu())
        if first_grads is None:
            first_grads = [None if p.grad is None else p.grad.cpu() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first_grads, [p.detach().cpu() for p in params], sched


def _compare(ref, got, bf16: bool):
    tol = dict(rtol=2e-2, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(ref[0], got[0]):  # losses
        torch.testing.assert_close(b, a, **tol)
    for a, b in zip(ref[1], got[1]):  # the first step's gradients, before AdamW evens them
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, **tol)
    for a, b in zip(ref[2], got[2]):  # parameters after the last step
        torch.testing.assert_close(b, a, **tol)


@cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv", "zbv_mixed"])
@pytest.mark.parametrize("bf16", [False, True])
def test_graphed_stage_matches_eager(schedule, bf16):
    """Same losses, first-step gradients (a loss parameter's included; None for a parameter
    no backward reaches) and parameters after three AdamW steps (``zero_grad(set_to_none=
    True)`` between them), graphed or not; fp32 agrees to rounding. ``zbv_mixed`` has stages
    taking FULL_B for some microbatches and B + W for others."""
    ref = _train(schedule, False, [bf16] * 3)
    got = _train(schedule, True, [bf16] * 3)
    _compare(ref, got, bf16)
    sched = got[3]
    # one slot per microbatch in flight: GPipe holds all 4, 1F1B on one rank 1
    slots = sum(st.graphs.slots for st in sched.stages.values())
    if schedule.startswith("zbv"):
        assert 2 <= slots <= 4 * 2  # no more than the microbatches, per stage
    else:
        assert slots == {"gpipe": 4, "1f1b": 1}[schedule]
    assert got[1][-3] is None and got[2][-3] is not None  # Second.unused.weight: never reached


@cuda
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_graphed_checkpointed_blocks_match_eager(schedule):
    """Activation checkpointing inside a graphed stage: the recompute is captured into the
    backward graphs (ZBV: W's recompute, in its GraphExecGroup, into the W graph)."""
    ref = _train(schedule, False, [False] * 3, ckpt=True)
    got = _train(schedule, True, [False] * 3, ckpt=True)
    _compare(ref, got, False)


@cuda
def test_a_new_autocast_state_captures_new_slots():
    """fp32, bf16, fp32: the bf16 step captures its own slot; the third step reuses the
    first's. Results equal the eager stage's throughout."""
    ref = _train("1f1b", False, [False, True, False])
    got = _train("1f1b", True, [False, True, False])
    _compare(ref, got, True)
    assert got[3].stages[0].graphs.slots == 2


@cuda
def test_gradients_accumulate_across_steps_without_zero_grad():
    """Without zero_grad the graphs keep adding into the same .grad: two steps' gradients
    equal twice one step's (the same batch twice, no optimizer step)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(Head(), Block(), nn.Linear(32, 50)).to(dev)
    sched = Schedule1F1B(PipelineStage(model, 0, 1, device=dev, cuda_graphs=True), 2, loss_fn=_loss)
    ids = torch.randint(0, 50, (4, 8), device=dev)
    sched.step(ids, target=ids)
    once = [p.grad.clone() for p in model.parameters()]
    sched.step(ids, target=ids)
    for g, p in zip(once, model.parameters()):
        torch.testing.assert_close(p.grad, 2 * g)
    # a .grad replaced by the user is taken over, not lost
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sched.step(ids, target=ids)
    for g, p in zip(once, model.parameters()):
        torch.testing.assert_close(p.grad, 1 + g)


@cuda
def test_a_parameter_unfrozen_after_capture_accumulates_over_microbatches():
    """A new requires_grad state captures new slots, and the newly trainable weight's graph
    adds into a fixed .grad over the 4 microbatches (as the eager stage's gradients show);
    while frozen its .grad stays None."""

    def run(graphs: bool):
        dev = torch.device("cuda")
        torch.manual_seed(0)
        model = nn.Sequential(Head(), Block(), nn.Linear(32, 50)).to(dev)
        st = PipelineStage(model, 0, 1, device=dev, cuda_graphs=graphs)
        sched = Schedule1F1B(st, 4, loss_fn=_loss)
        ids = torch.randint(0, 50, (8, 8), device=dev)
        out = []
        for frozen in (True, False):
            model[2].weight.requires_grad_(not frozen)
            sched.step(ids, target=ids)
            out.append([None if p.grad is None else p.grad.cpu() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        return out, st

    ref, _ = run(False)
    got, st = run(True)
    assert st.graphs.slots == 2
    assert got[0][-2] is None  # the frozen weight
    for a_step, b_step in zip(ref, got):
        for a, b in zip(a_step, b_step):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_cuda_graphs_refuse_a_cpu_stage():
    with pytest.raises(PipelineError, match="cuda_graphs=True: stage 0 is on cpu"):
        PipelineStage(Block(), 0, 1, device="cpu", cuda_graphs=True)


def test_cuda_graphs_refuse_tensor_subclass_parameters_and_activation_hooks():
    class Sub(torch.Tensor):
        pass

    mod = Block()
    mod.p = nn.Parameter(torch.Tensor._make_subclass(Sub, torch.zeros(2), True))
    # the device check comes first; skip it to reach the others
    st = PipelineStage(mod, 0, 1, device="cpu")
    st.device = torch.device("cuda", 0)
    from hp_pipeline._graphs import check_graphable

    with pytest.raises(PipelineError, match="stage 0's parameter 'p' is a Sub"):
        check_graphable(st)
    st = PipelineStage(Block(), 0, 1, device="cpu", activation_hooks=lambda mb: None)
    st.device = torch.device("cuda", 0)
    with pytest.raises(PipelineError, match="activation_hooks"):
        check_graphable(st)


def test_cuda_graphs_refuse_a_ddp_module(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from hp_pipeline._graphs import check_graphable

        st = PipelineStage(nn.parallel.DistributedDataParallel(Block()), 0, 1, device="cpu")
        st.device = torch.device("cuda", 0)
        with pytest.raises(PipelineError, match="DistributedDataParallel"):
            check_graphable(st)
    finally:
        dist.destroy_process_group()


def test_cuda_graphs_refuse_threaded_b_f():
    st = [PipelineStage(Block(), i, 2, device="cpu") for i in range(2)]
    st[0].graphs = object()  # as a graphed stage would have
    with pytest.raises(PipelineError, match="threaded_b_f=True with cuda_graphs"):
        ScheduleZBV(st, 4, loss_fn=_loss, overlap_b_f=True, threaded_b_f=True)


def test_cuda_graphs_refuse_hooks():
    """Python hooks would run once, at capture: refused before any step."""
    from hp_pipeline._graphs import check_graphable

    mod = nn.Sequential(Block(), Block())
    mod[1].register_forward_hook(lambda *a: None)
    st = PipelineStage(mod, 0, 1, device="cpu")
    st.device = torch.device("cuda", 0)
    with pytest.raises(PipelineError, match="module '1' has _forward_hooks"):
        check_graphable(st)
    mod = Block()
    mod.up.weight.register_hook(lambda g: g)
    st = PipelineStage(mod, 0, 1, device="cpu")
    st.device = torch.device("cuda", 0)
    with pytest.raises(PipelineError, match="parameter 'up.weight' has gradient hooks"):
        check_graphable(st)


def _cpu_graphed(first: bool):
    from hp_pipeline._graphs import StageGraphs

    st = PipelineStage(Block(), 0 if first else 1, 2, device="cpu")
    st.graphs = StageGraphs(st)  # what cuda_graphs=True makes, on a CUDA device
    return st


def test_graphed_inputs_are_checked_before_any_capture():
    with pytest.raises(PipelineError, match="input 1 is a list"):
        _cpu_graphed(False).forward_one_chunk(0, (torch.zeros(2, 32), [1, 2]))
    with pytest.raises(PipelineError, match="keyword inputs"):
        _cpu_graphed(False).forward_one_chunk(0, (torch.zeros(2, 32),), {"mask": 1})
    with pytest.raises(PipelineError, match="first stage's inputs want a gradient"):
        _cpu_graphed(True).forward_one_chunk(0, (torch.zeros(2, 32, requires_grad=True),))


@pytest.mark.parametrize("schedule", ["zbv", "zbv_mixed"])
def test_the_hand_made_schedules_train_as_1f1b_does(schedule):
    """The folded-V step lists above are sound without graphs too (CPU): the same losses,
    gradients and parameters as 1F1B's, an unused parameter's .grad None."""
    ref = _train("1f1b", False, [False] * 2, device="cpu")
    got = _train(schedule, False, [False] * 2, device="cpu")
    _compare(ref, got, False)


def test_graphed_stages_of_one_schedule_share_gradient_buffers():
    """A parameter two stages share (tied embeddings on ZBV's rank 0): one .grad buffer, so
    neither stage re-points .grad away from what the other adds into (CPU: the bookkeeping
    only, no graphs run)."""
    from hp_pipeline._graphs import StageGraphs

    first, last = Block(), Block()
    last.up.weight = first.up.weight  # tied
    stages = [PipelineStage(first, 0, 2, device="cpu"), PipelineStage(last, 1, 2, device="cpu")]
    for st in stages:
        st.graphs = StageGraphs(st)
    ScheduleZBV(stages, 4, loss_fn=_loss)
    assert stages[0].graphs.grads is stages[1].graphs.grads
    w = first.up.weight
    for st in stages:
        st.graphs.used = [w]
    stages[0].graphs.begin()
    buf = w.grad
    buf += 1  # what stage 0's graphs add
    stages[1].graphs.begin()  # stage 1 starts later in the step
    assert w.grad is buf and bool((w.grad == 1).all())
    w.grad = None  # zero_grad(set_to_none=True)
    stages[1].graphs.begin()
    assert w.grad is buf and bool((w.grad == 0).all())


def test_a_parameter_replaced_out_of_place_after_capture_is_an_error():
    from hp_pipeline._graphs import StageGraphs

    st = PipelineStage(Block(), 0, 1, device="cpu")
    st.graphs = g = StageGraphs(st)
    g.ptrs = {n: p.data_ptr() for n, p in st.module.named_parameters()}  # as at capture
    g.begin()  # unchanged: fine
    with torch.no_grad():
        st.module.up.weight.copy_(torch.ones_like(st.module.up.weight))  # in place: fine
    g.begin()
    st.module.up.weight.data = torch.zeros(64, 32)
    with pytest.raises(PipelineError, match="'up.weight' moved to new memory"):
        g.begin()
