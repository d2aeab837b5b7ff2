"""CUDA graphs for a pipeline stage (``PipelineStage(cuda_graphs=True)``).

With small microbatches a stage's step is bound by the host: each forward and backward launches
hundreds of kernels through Python and autograd, and the device waits between them. Here each
microbatch's forward and backward (FULL_B, or B and W) are replays of graphs captured once.

A *slot* holds one set of graphs with its own memory pool, its static inputs, outputs and
gradients. A microbatch takes a free slot at its forward and gives it back after its last
backward step, so a stage captures as many slots as it ever has microbatches in flight (1F1B:
at most ``pp - rank``), and each slot's activations stay where its capture put them. Slots are
per input signature, autocast state, grad mode, the modules' training flags, the parameters'
``requires_grad`` flags and backward kind; new ones are captured on first need.

Parameters' gradients: the graphs add into fixed ``.grad`` tensors. Whenever a stage has
nothing in flight it points the ``.grad`` of every parameter a backward reached at its buffer
(zeroed if the optimizer set it to None, filled from it if something else replaced it), so
``zero_grad(set_to_none=True)`` keeps working; the stages of one schedule share the buffers.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ._errors import PipelineError

if TYPE_CHECKING:
    from ._stage import PipelineStage

FULL, SPLIT = "full", "split"


@dataclass(eq=False)
class _Slot:
    """One in-flight microbatch's graphs and static tensors."""

    key: tuple
    kind: str  # FULL: forward + FULL_B graphs; SPLIT: forward + B + W graphs
    pool: object
    args: list  # static inputs (tensors copied in before each forward replay)
    outs: list[torch.Tensor] = field(default_factory=list)
    gouts: list[torch.Tensor | None] = field(default_factory=list)  # per floating output
    dx: list[torch.Tensor] = field(default_factory=list)
    f: torch.cuda.CUDAGraph | None = None
    b: torch.cuda.CUDAGraph | None = None  # FULL_B, or B
    w: torch.cuda.CUDAGraph | None = None


def check_graphable(stage: PipelineStage) -> None:
    """Raise a PipelineError when ``stage`` cannot run from CUDA graphs (before any step)."""
    idx = stage.stage_index
    if stage.device.type != "cuda":
        raise PipelineError(
            f"cuda_graphs=True: stage {idx} is on {stage.device}; CUDA graphs need a CUDA "
            "device (pass device='cuda:N', or leave cuda_graphs off)"
        )
    if stage.sharded:
        raise PipelineError(
            f"cuda_graphs=True: stage {idx} is sharded (fully_shard): its gathers change "
            "where parameters live between steps; leave cuda_graphs off for sharded stages"
        )
    if stage.activation_hooks is not None:
        raise PipelineError(
            f"cuda_graphs=True: stage {idx} has activation_hooks, which would run once at "
            "capture and never again; pass one or the other"
        )
    ddp = torch.nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in stage.module.modules()):
        raise PipelineError(
            f"cuda_graphs=True: stage {idx} holds a DistributedDataParallel module, whose "
            "reducer hooks would run once at capture and never again; reduce the gradients "
            "after the step instead (or leave cuda_graphs off)"
        )
    for name, m in stage.module.named_modules():
        hooks = [
            h
            for h in (
                "_forward_pre_hooks",
                "_forward_hooks",
                "_backward_pre_hooks",
                "_backward_hooks",
            )
            if getattr(m, h, None)
        ]
        if hooks:
            raise PipelineError(
                f"cuda_graphs=True: stage {idx}'s module {name or '(root)'!r} has "
                f"{', '.join(hooks)}: Python hooks would run once, at capture, and never "
                "again; remove them or leave cuda_graphs off"
            )
    for name, p in stage.module.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise PipelineError(
                f"cuda_graphs=True: stage {idx}'s parameter {name!r} has gradient hooks, which "
                "would run once, at capture; remove them or leave cuda_graphs off"
            )
        if type(p) not in (torch.Tensor, nn.Parameter):
            raise PipelineError(
                f"cuda_graphs=True: stage {idx}'s parameter {name!r} is a "
                f"{type(p).__name__}; graphs take plain tensors only (tensor parallelism "
                "inside a stage communicates in its forward)"
            )


@contextmanager
def _quiet_capture(g: torch.cuda.CUDAGraph, pool, stream):
    """``torch.cuda.graph``, without its warning for an empty graph: a first stage's B (no
    input gradient to compute) or a W with nothing left captures none, and replays as such."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield


class StageGraphs:
    """The captured slots of one stage, and its parameters' fixed gradient buffers."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.free: dict[tuple, list[_Slot]] = {}  # (kind, key) -> slots not in use
        self.slots = 0  # captured so far
        self.kinds: dict[int, str] = {}  # microbatch -> FULL or SPLIT (set by the runtime)
        self.stepping = False  # inside a schedule's step (begin() ran at its start)
        self.used: list[torch.Tensor] | None = None  # parameters a backward reached
        self.grads: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its .grad buffer
        self.state: tuple = ()  # training and requires_grad flags, baked into a capture
        self.ptrs: dict[str, int] = {}  # parameters' addresses the graphs read
        self.stream: torch.cuda.Stream | None = None

    # -- per step -----------------------------------------------------------------------------
    def start_step(self, kinds: dict[int, str]) -> None:
        """A schedule's step begins: each microbatch's backward kind (FULL or SPLIT), and
        :meth:`begin` once for the whole step rather than whenever the stage empties."""
        self.kinds = kinds
        self.stepping = True
        self.begin()

    def end_step(self) -> None:
        """The step is over (or failed): direct calls after it take B + W slots and begin
        again whenever the stage has nothing in flight."""
        self.kinds = {}
        self.stepping = False

    def begin(self) -> None:
        """Before a stage's first forward with nothing in flight: fixed ``.grad`` buffers in
        place, and the module state a capture depends on read once."""
        mod = self.stage.module
        self.state = (
            tuple(m.training for m in mod.modules()),
            tuple(p.requires_grad for p in mod.parameters()),
        )
        if self.ptrs:
            self._check_storage()
        self.attach_grads()

    def _check_storage(self) -> None:
        """The graphs read parameters where they were at capture: one replaced out of place
        since (``.data =``, ``load_state_dict(assign=True)``, ``.to(...)``) is an
        error, not a silent read of the old memory."""
        for name, t in self._tensors():
            if self.ptrs.get(name) != t.data_ptr():
                raise PipelineError(
                    f"cuda_graphs=True: stage {self.stage.stage_index}'s {name!r} moved to new "
                    "memory after its graphs were captured (replaced out of place); update it "
                    "in place instead (copy_, load_state_dict without assign=True)"
                )

    def _tensors(self):
        # parameters only: a buffer made anew in forward (a rotary cache grown for a longer
        # sequence) is the module's business, and a new shape captures anew anyway
        return list(self.stage.module.named_parameters())

    def attach_grads(self) -> None:
        """Point the ``.grad`` of every parameter this stage's backward reaches at its buffer,
        the one the graphs add into: zeroed where ``.grad`` is None, copied into where another
        tensor took its place. Parameters it never reaches keep ``.grad`` as it is (None)."""
        zero = []
        with torch.no_grad():
            for p in self.used or ():
                if not p.requires_grad:  # frozen since: its .grad stays the optimizer's business
                    continue
                buf = self.grads.get(p)
                if buf is None:
                    buf = self.grads[p] = torch.empty_like(p, memory_format=torch.contiguous_format)
                g = p.grad
                if g is buf:
                    continue
                if g is None:
                    zero.append(buf)
                else:
                    buf.copy_(g)
                p.grad = buf
            if zero:
                torch._foreach_zero_(zero)

    # -- slots --------------------------------------------------------------------------------
    def _key(self, args: tuple) -> tuple:
        sig = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                sig.append((tuple(a.shape), a.dtype, a.device))
                continue
            try:
                hash(a)
            except TypeError:
                raise PipelineError(
                    f"cuda_graphs=True: stage {self.stage.stage_index}'s input {i} is a "
                    f"{type(a).__name__}, which cannot be part of a graph's key; pass tensors "
                    "(a non-tensor input is baked into the graph, one capture per value)"
                ) from None
            sig.append(a)
        amp = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        return tuple(sig), amp, torch.is_grad_enabled(), self.state

    def _take(self, args: tuple, kind: str) -> _Slot:
        key = self._key(args)
        # a slot captured for B and W also serves a FULL_B (it replays both)
        for k in (kind, SPLIT) if kind == FULL else (kind,):
            free = self.free.get((k, key))
            if free:
                return free.pop()
        return self._capture(key, kind, args)

    def _give_back(self, slot: _Slot) -> None:
        self.free.setdefault((slot.kind, slot.key), []).append(slot)

    def _capture(self, key: tuple, kind: str, args: tuple) -> _Slot:
        """Capture a new slot's graphs, after one eager run of the same work on the capture
        stream (handles and workspaces made lazily cannot be made during a capture). The eager
        run writes into fresh gradients, set aside afterwards; the first one also tells which
        parameters the backward reaches."""
        st = self.stage
        check_graphable(st)  # hooks or wrappers added since the stage was made
        if self.stream is None:
            self.stream = torch.cuda.Stream(st.device)
        slot = _Slot(
            key,
            kind,
            torch.cuda.graph_pool_handle(),
            [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args],
        )
        tag = -1 - self.slots  # the stage's eager methods keep the capture's state under it
        self.slots += 1
        amp_on, amp_dtype = key[1]
        params = [p for p in st.module.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        bufs = list(st.module.buffers())
        kept_bufs = [b.clone() for b in bufs]  # BatchNorm statistics, counters
        cur = torch.cuda.current_stream(st.device)
        self.stream.wait_stream(cur)
        try:
            for p in params:
                p.grad = None
            with (
                torch.cuda.stream(self.stream),
                torch.autocast("cuda", dtype=amp_dtype, enabled=amp_on, cache_enabled=False),
            ):
                self._run(tag, slot, capture=False)
            # grows with each capture: a parameter unfrozen since (a new state, a new slot)
            reached = [p for p in params if p.grad is not None]
            self.used = list(dict.fromkeys([*(self.used or ()), *reached]))
        finally:
            cur.wait_stream(self.stream)
            with torch.no_grad():  # the warm-up's module state changes are undone
                for b, v in zip(bufs, kept_bufs):
                    b.copy_(v)
            for p, g in zip(params, kept):
                p.grad = g
            st._chunks.pop(tag, None)
        self.attach_grads()  # the graphs add into these: they must exist when captured
        self.ptrs = {name: t.data_ptr() for name, t in self._tensors()}
        # autocast's cast cache would hand one capture's casts to the next: off while capturing
        try:
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_on, cache_enabled=False):
                self._run(tag, slot, capture=True)
        except Exception as e:
            st._chunks.pop(tag, None)
            raise PipelineError(
                f"cuda_graphs=True: capturing stage {st.stage_index}'s graphs failed ({e}); "
                "a graphed module must not synchronise with the host (.item(), .cpu(), "
                "data-dependent shapes) or communicate"
            ) from e
        return slot

    def _run(self, tag: int, slot: _Slot, *, capture: bool) -> None:
        st = self.stage

        def graph():
            if not capture:
                return None, nullcontext()
            g = torch.cuda.CUDAGraph()
            return g, _quiet_capture(g, slot.pool, self.stream)

        f, ctx = graph()
        with ctx:
            outs = st._forward(tag, tuple(slot.args), {})
        floats = [o for o in outs if o.is_floating_point()]
        gouts = [torch.zeros_like(o) if o.requires_grad else None for o in floats]
        b, ctx = graph()
        with ctx:
            if slot.kind == FULL:
                dx = st._backward_full(tag, tuple(gouts))
            else:
                dx = st._backward_input(tag, tuple(gouts))
        w = None
        if slot.kind == SPLIT:
            w, ctx = graph()
            with ctx:
                st._backward_weight(tag)
        if capture:
            slot.f, slot.b, slot.w = f, b, w
            slot.outs, slot.gouts, slot.dx = list(outs), gouts, list(dx)

    # -- what the stage's methods do with graphs ----------------------------------------------
    def forward(self, mb: int, args: tuple, kwargs: dict | None):
        """Replay a slot's forward on ``args``; returns copies of its outputs (the last
        stage's want a gradient, for the loss) and the slot."""
        st = self.stage
        if kwargs:
            raise PipelineError(
                f"cuda_graphs=True: stage {st.stage_index} got keyword inputs "
                f"{sorted(kwargs)}; a graphed stage takes positional tensors only"
            )
        if st.is_first and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise PipelineError(
                "cuda_graphs=True: the first stage's inputs want a gradient, which a graph "
                "(fed by copies) cannot pass back; detach them or leave cuda_graphs off"
            )
        if not st._chunks and not self.stepping:  # called by hand, not by a schedule
            self.begin()
        slot = self._take(args, self.kinds.get(mb, SPLIT))
        try:
            with torch.no_grad():
                for s, a in zip(slot.args, args):
                    if isinstance(s, torch.Tensor):
                        s.copy_(a)
            slot.f.replay()
            outs = []
            for o in slot.outs:
                c = o.detach().clone()
                outs.append(c.requires_grad_() if st.is_last and o.requires_grad else c)
        except BaseException:
            self._give_back(slot)  # no chunk holds it yet
            raise
        return outs, slot

    def backward(self, slot: _Slot, loss, outs, grads) -> list[torch.Tensor]:
        """Replay the slot's FULL_B or B graph from ``grads`` (or, on the last stage, from
        ``loss``'s gradient at the outputs; parameters inside the loss get theirs as without
        graphs); returns copies of the input gradients."""
        floats = [o for o in outs if o.is_floating_point()]
        if loss is not None:
            with self.stage.grad_lock:
                torch.autograd.backward([loss])
            grads = [o.grad if o.requires_grad else None for o in floats]
        elif grads is None:
            raise PipelineError(
                f"stage {self.stage.stage_index}: backward without gradients or a loss"
            )
        grads = list(grads)
        grads += [None] * (len(slot.gouts) - len(grads))
        with torch.no_grad():
            for sg, g in zip(slot.gouts, grads):
                if sg is not None:
                    if g is None:
                        sg.zero_()
                    else:
                        sg.copy_(g)
        slot.b.replay()
        return [d.clone() for d in slot.dx]
