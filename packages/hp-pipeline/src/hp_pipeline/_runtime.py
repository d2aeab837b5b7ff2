"""Running a schedule: split the batch, execute each rank's step list, move activations and
gradients between ranks, compute the loss, gather or shard stages once per step."""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from hp_dtensor import all_gather_json, get_platform

from ._errors import PipelineTypeError, check_bool, check_int
from ._graphs import FULL, SPLIT
from ._ir import MetaStep, MetaStepType, Placement, Schedule, ScheduleError
from ._position import check_stage_list, stages_per_rank
from ._schedules import build_schedule
from ._sim import channel, simulate
from ._stage import PipelineError, PipelineStage, ShardedModule
from ._timeline import TimelineEvent, bubble_fraction

__all__ = [
    "BatchDimSpec",
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZBV",
    "split_microbatches",
]

T = MetaStepType
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
]
_HEADER = 64  # int64 slots of the shape header sent with a channel's first transfer


@dataclass(frozen=True)
class BatchDimSpec:
    """Which dimension of each input is the batch (split into microbatches).

    ``args`` is one dim for every positional tensor, or one per position (None: not split,
    passed whole to every microbatch); ``kwargs`` the same per keyword. Applies to ``target``
    too (its dim is ``target_dim``).
    """

    args: int | tuple[int | None, ...] = 0
    kwargs: dict[str, int | None] = field(default_factory=dict)
    target_dim: int = 0

    def __post_init__(self) -> None:
        fn = "BatchDimSpec"
        dims = self.args if isinstance(self.args, tuple) else (self.args,)
        if isinstance(self.args, list):
            raise PipelineTypeError(
                f"{fn}: args={self.args!r} is a list: give an int, or a tuple with one int "
                f"(or None) per input, e.g. {tuple(self.args)!r}"
            )
        for i, d in enumerate(dims):
            if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
                at = f"args[{i}]" if isinstance(self.args, tuple) else "args"
                raise PipelineTypeError(
                    f"{fn}: {at}={d!r} is a {type(d).__name__}: give a batch dim (int) or None"
                )
        if not isinstance(self.kwargs, dict):
            raise PipelineTypeError(
                f"{fn}: kwargs={self.kwargs!r} is a {type(self.kwargs).__name__}: give a dict "
                "{name: batch dim or None}"
            )
        for k, d in self.kwargs.items():
            if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
                raise PipelineTypeError(
                    f"{fn}: kwargs[{k!r}]={d!r} is a {type(d).__name__}: give a batch dim (int) "
                    "or None"
                )
        if isinstance(self.target_dim, bool) or not isinstance(self.target_dim, int):
            raise PipelineTypeError(
                f"{fn}: target_dim={self.target_dim!r} is a {type(self.target_dim).__name__}: "
                "give an int"
            )


def _split_one(x, n: int, dim: int | None, what: str):
    if dim is None or not isinstance(x, torch.Tensor):
        return [x] * n
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise PipelineError(
            f"{what} has shape {tuple(x.shape)}: batch dim {dim} is out of range; set "
            "batch_spec=BatchDimSpec(...) to its batch dim (or None: not split)"
        )
    size = x.shape[dim]
    if size % n:
        raise PipelineError(
            f"{what} has batch size {size} on dim {dim}, not divisible by n_microbatches={n}; "
            f"use a batch that is a multiple of {n} or another n_microbatches"
        )
    return list(torch.chunk(x, n, dim=dim))


def split_microbatches(
    args: tuple, kwargs: dict, n: int, spec: BatchDimSpec | None = None
) -> list[tuple[tuple, dict]]:
    """Split ``args``/``kwargs`` into ``n`` microbatches along the spec's batch dims."""
    fn = "split_microbatches"
    if not isinstance(args, (tuple, list)):
        raise PipelineTypeError(
            f"{fn}: args is a {type(args).__name__}: give a tuple of inputs, e.g. (x,)"
        )
    if not isinstance(kwargs, dict):
        raise PipelineTypeError(f"{fn}: kwargs is a {type(kwargs).__name__}: give a dict")
    check_int(n, "n", fn, low=1)
    _check_spec(spec, fn)
    spec = spec or BatchDimSpec()
    dims = spec.args if isinstance(spec.args, tuple) else (spec.args,) * len(args)
    if len(dims) != len(args):
        raise PipelineError(f"batch_spec.args has {len(dims)} dims for {len(args)} inputs")
    cols = [_split_one(a, n, d, f"input {i}") for i, (a, d) in enumerate(zip(args, dims))]
    kcols = {k: _split_one(v, n, spec.kwargs.get(k, 0), f"input {k!r}") for k, v in kwargs.items()}
    return [(tuple(c[i] for c in cols), {k: v[i] for k, v in kcols.items()}) for i in range(n)]


def _check_spec(spec, fn: str) -> None:
    if spec is not None and not isinstance(spec, BatchDimSpec):
        raise PipelineTypeError(
            f"{fn}: batch_spec={spec!r} is a {type(spec).__name__}: give a BatchDimSpec, e.g. "
            "BatchDimSpec(args=0), or None"
        )


# -- channels ---------------------------------------------------------------------------------
_CHANNEL_GROUPS: dict[tuple[int, int, str], object] = {}  # the platform's groups
_TAGS = {"F": 1, "B": 2}


def _make_channel_groups(
    group, steps: Schedule, placement: Placement, device: torch.device
) -> None:
    """NCCL: create the process group of every (source, destination, kind) channel the
    schedule uses, once, so each channel has its own communicator and stream (see
    :func:`hp_pipeline.channel`). Pipeline groups differ across data-parallel replicas, so
    every rank shares its channels (global ranks, as JSON) with all, and all create the union
    in sorted order. Collective over the world. Each communicator is created here, not on its
    first transfer.

    Other backends (gloo) match a receive to a send by peer and tag, in order: one tag per
    channel kind over the pipeline group already keeps the channels independent.
    """
    platform = _platform(device)
    if platform.group_backend(group) != "nccl":
        return
    mine = set()
    for rank_steps in steps.values():
        for st in rank_steps:
            if st.is_comm:
                src, dst, kind = channel(st, placement)
                mine.add((_global(group, src), _global(group, dst), kind))
    everyone = all_gather_json(sorted(mine), device=device, platform=platform)
    wanted = sorted({tuple(k) for ks in everyone for k in ks})
    me = platform.get_rank()
    for key in wanted:
        if key not in _CHANNEL_GROUPS:
            pg = _CHANNEL_GROUPS[key] = platform.new_group(sorted({key[0], key[1]}), distinct=True)
            if me in key[:2]:
                # NCCL creates a communicator, and connects a pair of ranks, on first use, and
                # both ends must take part: done in the middle of a step, that handshake blocks
                # a host while its peer may be waiting on this rank's device (see
                # order_transfers). One small transfer per channel does both here, in the same
                # (sorted) order on every rank.
                x = torch.zeros(1, device=device)
                peer = key[1] if me == key[0] else key[0]
                sends, recvs = ([(x, peer)], []) if me == key[0] else ([], [(x, peer)])
                for w in platform.batch_p2p(sends, recvs, pg, tag=_TAGS[key[2]]):
                    w.wait()


def _platform(device):
    """The platform serving ``device``'s type (torch's, or a backend registered for it)."""
    return get_platform(torch.device(device).type)


def _global(group, r: int) -> int:
    return get_platform().group_ranks(group)[r] if group is not None else r


def _check_threaded(stages: Sequence[PipelineStage], overlap_b_f: bool, sharded: bool) -> None:
    """What ``threaded_b_f=True`` needs, checked before anything runs."""
    if not overlap_b_f:
        raise PipelineError(
            "threaded_b_f=True runs the backward of each OVERLAP_B_F step on a helper "
            "thread: pass overlap_b_f=True too (it makes those steps)"
        )
    if sharded:
        raise PipelineError(
            "threaded_b_f=True with sharded stages: fully_shard's hooks keep per-process "
            "state that a forward and a backward on two threads would race on; leave "
            "threaded_b_f off for them"
        )
    for st in stages:
        for name, p in st.module.named_parameters():
            if type(p) not in (torch.Tensor, nn.Parameter):
                raise PipelineError(
                    f"threaded_b_f=True: stage {st.stage_index}'s parameter {name!r} is a "
                    f"{type(p).__name__} (tensor or sequence parallelism inside the stage): "
                    "its collectives in the backward (helper thread) and in the forward (this "
                    "thread) would meet the other ranks' in a different order; leave "
                    "threaded_b_f off for such stages"
                )


class PipelineSchedule:
    """Runs a named schedule over this rank's stages. See the subclasses.

    ``loss_fn(output, target)`` runs on the last stage per microbatch (divided by
    ``n_microbatches`` when ``scale_grads``). ``overlap_p2p`` posts each RECV one compute step
    early; ``overlap_b_f`` fuses a backward with the next forward of another microbatch into
    one OVERLAP_B_F step. ``threaded_b_f`` (with ``overlap_b_f``) runs that backward on a
    helper thread while this thread runs the forward: where the host, not the device, limits
    a step (small layers, Python-heavy models), two threads launch kernels at once. Stages must
    then not communicate inside themselves (tensor-subclass parameters and sharded stages are
    refused), and a forward that draws random numbers must not meet a checkpoint recompute
    (``preserve_rng_state`` sets the process's generators while it reruns); see the README.
    ``batch_spec`` says which dims to split; ``record_timeline`` records each step's start and
    end (synchronising the device around each, and keeping W on this thread).
    """

    name = ""

    def __new__(cls, stages=None, *args, **kwargs):
        """Stages over MindSpore cells get the MindSpore binding's schedule of this name
        (``hp_pipeline._backend``), with the same arguments; torch stages this class."""
        first = stages[0] if isinstance(stages, (list, tuple)) and stages else stages
        if getattr(first, "framework", None) == "mindspore":
            from ._backend._mindspore import MSPipelineSchedule

            return MSPipelineSchedule(cls.name, stages, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        *,
        scale_grads: bool = True,
        overlap_p2p: bool = False,
        overlap_b_f: bool = False,
        threaded_b_f: bool = False,
        batch_spec: BatchDimSpec | None = None,
        record_timeline: bool = False,
    ) -> None:
        fn = type(self).__name__
        stages = check_stage_list(stages, PipelineStage, fn)
        check_int(n_microbatches, "n_microbatches", fn, low=1)
        if loss_fn is not None and not callable(loss_fn):
            raise PipelineTypeError(
                f"{fn}: loss_fn={loss_fn!r} is a {type(loss_fn).__name__}, not callable: give "
                "a function (output, target) -> loss, or None on ranks without the last stage"
            )
        for arg, v in (
            ("scale_grads", scale_grads),
            ("overlap_p2p", overlap_p2p),
            ("overlap_b_f", overlap_b_f),
            ("threaded_b_f", threaded_b_f),
            ("record_timeline", record_timeline),
        ):
            check_bool(v, arg, fn)
        _check_spec(batch_spec, fn)
        self.stages = {s.stage_index: s for s in stages}
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.batch_spec = batch_spec
        self.record_timeline = record_timeline
        self.timeline: list[TimelineEvent] = []
        group = stages[0].group
        self.group = group
        platform = self.platform = _platform(stages[0].device)
        self.pp = platform.get_world_size(group) if platform.is_initialized() else 1
        self.rank = platform.get_rank(group) if platform.is_initialized() else 0
        sharded = any(s.sharded for s in stages)
        if threaded_b_f and any(st.graphs is not None for st in stages):
            raise PipelineError(
                "threaded_b_f=True with cuda_graphs stages: a graph replay costs the host "
                "next to nothing, so there is nothing for a second thread to hide; pass one "
                "or the other"
            )
        graphed = [st for st in stages if st.graphs is not None]
        if len(graphed) > 1:
            # a parameter two stages share (tied embeddings on ZBV's rank 0) must have one
            # .grad buffer, or each stage would re-point .grad at its own and lose the other's
            shared: dict = {}
            for st in graphed:
                shared.update(st.graphs.grads)
                st.graphs.grads = shared
        if threaded_b_f:
            _check_threaded(stages, overlap_b_f, sharded)
            # whatever writes .grad (FULL_B, W, B's whole-backward fallback) holds one lock:
            # two threads must not both find .grad unset, or add into it at once
            lock = threading.Lock()
            for st in stages:
                st.grad_lock = lock
        self.threaded_b_f = threaded_b_f
        self._helper: ThreadPoolExecutor | None = None
        self.steps_all, self.placement = build_schedule(
            self.name,
            self.pp,
            n_microbatches,
            stages_per_rank=stages_per_rank(stages[0].num_stages, self.pp, fn),
            overlap_p2p=overlap_p2p,
            overlap_b_f=overlap_b_f,
            shard_steps=sharded,
        )
        if len(self.placement) != stages[0].num_stages:
            raise PipelineError(
                f"{type(self).__name__} on {self.pp} ranks runs {len(self.placement)} stages; "
                f"the stages say num_stages={stages[0].num_stages}"
            )
        mine = sorted(s for s, r in self.placement.items() if r == self.rank)
        if sorted(self.stages) != mine:
            raise PipelineError(
                f"rank {self.rank} must hold stages {mine} for {type(self).__name__}, "
                f"got {sorted(self.stages)}"
            )
        if loss_fn is None and any(s.is_last for s in stages):
            raise PipelineError("loss_fn is required on the rank that holds the last stage")
        # invalid, or deadlocks even if hosts block now and then: raise
        simulate(self.steps_all, self.placement, n_microbatches, host_sync=True)
        self.steps: list[MetaStep] = self.steps_all[self.rank]
        if platform.is_initialized():
            _make_channel_groups(group, self.steps_all, self.placement, stages[0].device)
        # shapes of the tensors arriving at each stage: a header travels with each channel's
        # first transfer (the first step); stages given input_args check it
        self._in_meta: dict[int, list[tuple[torch.Size, torch.dtype]]] = {}
        self._sent_meta: dict[int, bool] = {}
        self._declared_out: dict[int, list[tuple[torch.Size, torch.dtype]]] = {}
        self._stepped = False  # declare_input_shapes only before the first step

    # -- public -------------------------------------------------------------------------------
    def declare_input_shapes(self, shapes: dict) -> None:
        """Declare, before the first step, the tensors (``[(shape, dtype), ...]``) each stage
        receives from the stage before it, for ``shapes``' stages 1 .. n-1. A declared channel
        carries no header: this rank's declared stages allocate their receive buffers from the
        declaration, and its stages that feed a declared stage send no header and check their
        outputs against it (a mismatch raises). Every rank must declare the same stages, as a
        header sent to a rank that declared would never be read, and a declaring sender's
        first transfer would be read as a header by a rank that did not. What ``hp-plan
        dry-run`` uses: torch's fake process group delivers nothing, so no header could be
        read. On a real group a sender whose outputs differ from the declaration raises on its
        rank alone (its peer then waits on a transfer that never comes): declare what the
        stages send."""
        if not isinstance(shapes, dict):
            raise PipelineTypeError(
                f"declare_input_shapes: shapes is a {type(shapes).__name__}: give a dict "
                "{stage: [(shape, dtype), ...]}"
            )
        if self._stepped:
            raise PipelineError("declare_input_shapes: call it before the first step")
        n = len(self.placement)
        clean = {}
        for stage, meta in shapes.items():
            if isinstance(stage, bool) or not isinstance(stage, int):
                raise PipelineTypeError(
                    f"declare_input_shapes: stage {stage!r} is a {type(stage).__name__}: give "
                    "int stage indices"
                )
            if not 0 < stage < n:
                raise PipelineError(
                    f"declare_input_shapes: stage {stage!r}: give stages 1 .. {n - 1} (stage 0 "
                    "takes the step's inputs)"
                )
            try:
                clean[stage] = [(torch.Size(sh), dt) for sh, dt in meta]
            except (TypeError, ValueError):
                raise PipelineTypeError(
                    f"declare_input_shapes: stage {stage}: {meta!r} is not a list of "
                    "(shape, dtype) pairs"
                ) from None
            for _, dt in clean[stage]:
                if dt not in _DTYPES:
                    raise PipelineTypeError(
                        f"declare_input_shapes: stage {stage}: dtype {dt!r} cannot travel "
                        f"between stages (use one of {list(_DTYPES)})"
                    )
        for stage, meta in clean.items():
            if stage in self.stages:
                self._in_meta[stage] = meta
            if stage - 1 in self.stages:
                self._sent_meta[stage - 1] = True
                self._declared_out[stage - 1] = meta

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """One pipelined forward and backward of a batch.

        The rank holding the first stage passes the inputs, the rank holding the last stage
        ``target`` (and optionally ``losses``, a list that receives each microbatch's loss);
        other ranks call ``step()``. Returns the last stage's outputs concatenated over the
        microbatches on the rank that holds it, else None.
        """
        if losses is not None and not isinstance(losses, list):
            raise PipelineTypeError(
                f"{type(self).__name__}.step: losses is a {type(losses).__name__}: give a list "
                "(it receives each microbatch's loss), or None"
            )
        m = self.n_microbatches
        first = self.stages.get(0)
        last = self.stages.get(len(self.placement) - 1)
        mbs = split_microbatches(args, kwargs, m, self.batch_spec) if first else None
        if first is None and (args or kwargs):
            raise PipelineError(f"rank {self.rank} holds no first stage: pass no inputs")
        targets = None
        if last is not None:
            if target is None:
                raise PipelineError(f"rank {self.rank} holds the last stage: pass target=")
            spec = self.batch_spec or BatchDimSpec()
            targets = _split_one(target, m, spec.target_dim, "target")
        self._stepped = True
        run = _Run(self, mbs, targets)
        try:
            run.execute()
        except BaseException:
            for s in self.stages.values():
                s.clear()
            raise
        if last is not None:
            if losses is not None:
                losses.extend(run.losses[i] for i in range(m))
            outs = [run.outputs[i] for i in range(m)]
            return torch.cat(outs, dim=0) if outs and isinstance(outs[0], torch.Tensor) else None
        return None

    def bubble_fraction(self) -> float:
        """The measured bubble of the last recorded step on this rank (``record_timeline``)."""
        return bubble_fraction(self.timeline)

    @property
    def schedule(self) -> Schedule:
        """Every rank's step list (the IR this runtime executes)."""
        return self.steps_all

    def helper_thread(self) -> ThreadPoolExecutor:
        """The one helper thread of ``threaded_b_f`` (made on first use, on this rank's
        device)."""
        if self._helper is None:
            dev = next(iter(self.stages.values())).device

            def init():
                if dev.type == "cuda":
                    torch.cuda.set_device(dev)

            self._helper = ThreadPoolExecutor(
                1, thread_name_prefix="hp_pipeline_backward", initializer=init
            )
            weakref.finalize(self, self._helper.shutdown, wait=False)
        return self._helper


class _Run:
    """The state of one ``step``."""

    def __init__(self, sched: PipelineSchedule, mbs, targets) -> None:
        self.s = sched
        self.platform = sched.platform
        self.mbs = mbs
        self.targets = targets
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.recv: dict[tuple, tuple[list, list[torch.Tensor]]] = {}  # key -> (works, buffers)
        self.sends: list = []  # (works, the tensor they read), until waited
        self.local_f: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> outputs of stage-1
        self.local_b: dict[tuple[int, int], list] = {}  # (stage, mb) -> grads from stage+1
        self.input_grads: dict[tuple[int, int], list] = {}  # (stage, mb) -> grads to send
        self.buffers: dict[tuple, list[torch.Tensor]] = {}  # RECV key -> allocated by prepare
        self.headers: dict[int, torch.Tensor] = {}  # stage -> its first SEND_F's header
        self.events: list[TimelineEvent] = []
        self.on_helper: list = []  # futures of the W steps handed to the helper thread
        self.t0 = time.perf_counter()

    # -- the loop -----------------------------------------------------------------------------
    def execute(self) -> None:
        try:
            self._execute()
        finally:  # the step ends, or fails, only when the helper thread is idle
            wait_futures(self.on_helper)
            for st in self.s.stages.values():
                if st.graphs is not None:
                    st.graphs.end_step()
        for f in self.on_helper:
            f.result()

    def _execute(self) -> None:
        s = self.s
        rec = s.record_timeline
        # graphed stages: which backward each microbatch's graphs are captured for
        kinds = {i: {} for i, st in s.stages.items() if st.graphs is not None}
        if kinds:
            for step in s.steps:
                for part in step.parts():
                    if part.stage in kinds and part.type in (T.B, T.FULL_B):
                        kinds[part.stage][part.microbatch] = SPLIT if part.type is T.B else FULL
            for i, k in kinds.items():
                s.stages[i].graphs.start_step(k)
        cuda = any(st.device.type == "cuda" for st in s.stages.values())
        prev = None
        for k, step in enumerate(s.steps):
            if step.is_comm and (prev is None or not prev.is_comm):
                self.prepare(s.steps, k)
            prev = step
            if rec:
                if cuda:
                    torch.cuda.synchronize()
                if step.is_compute:  # the wait for this step's inputs is not compute
                    t = time.perf_counter()
                    self.wait_inputs(step)
                    if cuda:
                        torch.cuda.synchronize()
                    self.record(f"wait {step}", t, "wait")
            t = time.perf_counter()
            self.run_step(step)
            if step.is_compute and self.sends:
                self.reap_sends()
            if rec:
                if cuda and step.is_compute:
                    torch.cuda.synchronize()
                self.record(str(step), t, "compute" if step.is_compute else "comm")
        for works, _ in self.sends:
            for w in works:
                w.wait()
        self.sends.clear()
        if self.recv:  # pragma: no cover - check_schedule makes every RECV have a consumer
            raise ScheduleError(f"rank {s.rank}: received but never used: {sorted(self.recv)}")
        if rec:
            s.timeline = self.events

    def prepare(self, steps: Sequence[MetaStep], k: int) -> None:
        """Allocate the receive buffers and headers of the comm steps from ``k`` to the next
        compute step before any of them is posted. An allocation can stop the host until the
        device is idle, and once a transfer is posted the device may wait on the peer; the
        schedule is only safe against such stops at compute steps (see ``order_transfers``)."""
        s = self.s
        while k < len(steps) and steps[k].is_comm:
            step = steps[k]
            k += 1
            st = s.stages[step.stage]
            if step.type is T.SEND_F and not s._sent_meta.get(step.stage):
                self.headers[step.stage] = _header(st.outputs(step.microbatch), st.device)
                continue
            if step.type is T.SEND_F and step.stage in s._declared_out:
                got = [(o.shape, o.dtype) for o in st.outputs(step.microbatch)]
                if got != s._declared_out[step.stage]:
                    raise PipelineError(
                        f"stage {step.stage} sends {got}, stage {step.stage + 1} was declared "
                        f"to receive {s._declared_out[step.stage]} (declare_input_shapes)"
                    )
                continue
            if step.type is T.RECV_B:  # a gradient for every floating-point output
                outs = st.outputs(step.microbatch)
                meta = [(o.shape, o.dtype) for o in outs if o.is_floating_point()]
            elif step.type is T.RECV_F and step.stage in s._in_meta:
                meta = s._in_meta[step.stage]
            else:  # a SEND, or a RECV_F whose shapes its header brings (post_recv)
                continue
            self.buffers[(step.type, step.stage, step.microbatch)] = _empty(meta, st.device)

    def record(self, label: str, t: float, kind: str) -> None:
        now = time.perf_counter()
        self.events.append(TimelineEvent(self.s.rank, label, t - self.t0, now - self.t0, kind))

    def wait_inputs(self, step: MetaStep) -> None:
        """Wait for the transfers the compute ``step`` consumes (timeline recording only)."""
        for part in step.parts():
            kind = T.RECV_F if part.type is T.F else T.RECV_B
            key = (kind, part.stage, part.microbatch)
            got = self.recv.get(key)
            if got is not None:
                for w in got[0]:
                    w.wait()
                self.recv[key] = ([], got[1])  # a gloo recv must not be waited on twice

    def run_step(self, step: MetaStep) -> None:
        t = step.type
        if t is T.F:
            self.forward(step.stage, step.microbatch)
        elif t is T.FULL_B or t is T.B:
            self.backward(step.stage, step.microbatch, full=t is T.FULL_B)
        elif t is T.W:
            st = self.s.stages[step.stage]
            if self.s.threaded_b_f and not self.s.record_timeline:
                # nothing later in the step reads weight gradients: the helper thread takes W
                # while this thread goes on (a recorded timeline keeps W where it is)
                self.on_helper.append(
                    self.on_helper_thread(st, st.backward_weight, step.microbatch)
                )
            else:
                st.backward_weight(step.microbatch)
        elif t is T.OVERLAP_B_F:
            if self.s.threaded_b_f:
                self.backward_beside_forward(step)
            else:
                self.backward(step.stage, step.microbatch, full=step.backward is T.FULL_B)
                self.forward(step.fused.stage, step.fused.microbatch)
        elif t is T.SEND_F:
            outs = self.s.stages[step.stage].outputs(step.microbatch)
            self.send(step, [o.detach() for o in outs])
        elif t is T.SEND_B:
            grads = self.input_grads.pop((step.stage, step.microbatch))
            self.send(step, grads)
        elif t is T.RECV_F or t is T.RECV_B:
            self.post_recv(step)
        elif t is T.UNSHARD:
            st = self.s.stages[step.stage]
            if st.sharded:  # gathered once per step: keep it until RESHARD, reduce there
                st.module.set_reshard_after_forward(False)
                st.module.set_reshard_after_backward(False)
                st.module.set_requires_gradient_sync(False)
                for m in _sharded_modules(st.module):
                    m.unshard()
        elif t is T.RESHARD:
            st = self.s.stages[step.stage]
            if st.sharded:
                st.module.reduce_gradients()
                st.module.set_requires_gradient_sync(True)
                st.module.set_reshard_after_forward(None)  # fully_shard's default again
                st.module.set_reshard_after_backward(True)
                for m in _sharded_modules(st.module):
                    m.reshard()
        else:  # pragma: no cover
            raise ScheduleError(f"cannot run {step}")

    # -- compute ------------------------------------------------------------------------------
    def forward(self, stage_idx: int, mb: int) -> None:
        st = self.s.stages[stage_idx]
        kwargs = {}
        if st.is_first:
            args, kwargs = self.mbs[mb]
        elif (stage_idx, mb) in self.local_f:
            args = self.local_f.pop((stage_idx, mb))
        else:
            args = tuple(self.take_recv((T.RECV_F, stage_idx, mb)))
        outs = st.forward_one_chunk(mb, args, kwargs)
        nxt = stage_idx + 1
        if st.is_last:
            out = outs[0] if len(outs) == 1 else outs
            loss = self.s.loss_fn(out, self.targets[mb])
            self.losses[mb] = loss.detach()
            self.outputs[mb] = out.detach() if isinstance(out, torch.Tensor) else out
            st.set_loss(mb, loss / self.s.n_microbatches if self.s.scale_grads else loss)
        elif self.s.placement[nxt] == self.s.rank:
            self.local_f[(nxt, mb)] = tuple(o.detach() for o in outs)

    def backward(self, stage_idx: int, mb: int, *, full: bool) -> None:
        st = self.s.stages[stage_idx]
        grads = self.output_grads(stage_idx, mb)
        dx = st.backward_full(mb, grads) if full else st.backward_input(mb, grads)
        self.place_input_grads(stage_idx, mb, dx)

    def backward_beside_forward(self, step: MetaStep) -> None:
        """OVERLAP_B_F with ``threaded_b_f``: the backward on the helper thread (autograd's
        engine runs it without the GIL), the forward here at the same time; both launch onto
        this thread's current stream. The pipeline's sends and receives stay on this thread.
        (W steps go to the helper thread too, see ``run_step``.)"""
        stage_idx, mb = step.stage, step.microbatch
        st = self.s.stages[stage_idx]
        grads = self.output_grads(stage_idx, mb)
        fn = st.backward_full if step.backward is T.FULL_B else st.backward_input
        fut = self.on_helper_thread(st, fn, mb, grads)
        try:
            self.forward(step.fused.stage, step.fused.microbatch)
        except BaseException:
            wait_futures([fut])  # never leave the backward running on a failed step
            raise
        self.place_input_grads(stage_idx, mb, fut.result())

    def on_helper_thread(self, st: PipelineStage, fn, *args):
        """Run ``fn(*args)`` on the helper thread, on this thread's current stream and under
        this thread's autocast state (a backward run here inherits it, so one run there
        must too)."""
        kind = st.device.type
        stream = torch.cuda.current_stream(st.device) if kind == "cuda" else None
        amp = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)

        def run():
            with (
                torch.cuda.stream(stream) if stream is not None else nullcontext(),
                torch.autocast(kind, dtype=amp[1], enabled=amp[0]),
            ):
                return fn(*args)

        return self.s.helper_thread().submit(run)

    def output_grads(self, stage_idx: int, mb: int):
        """The gradients arriving at ``stage_idx``'s outputs for ``mb`` (None on the last)."""
        if self.s.stages[stage_idx].is_last:
            return None
        key = (stage_idx, mb)
        if key in self.local_b:
            return self.local_b.pop(key)
        return self.take_recv((T.RECV_B, stage_idx, mb))

    def place_input_grads(self, stage_idx: int, mb: int, dx) -> None:
        """Hand ``dx`` to the previous stage: kept here if it is on this rank, else sent."""
        if self.s.stages[stage_idx].is_first:
            return
        prev = stage_idx - 1
        if self.s.placement[prev] == self.s.rank:
            self.local_b[(prev, mb)] = dx
        else:
            self.input_grads[(stage_idx, mb)] = dx

    # -- communication ------------------------------------------------------------------------
    def _peer(self, step: MetaStep):
        src, dst, kind = channel(step, self.s.placement)
        g_src, g_dst = _global(self.s.group, src), _global(self.s.group, dst)
        sending = step.type in (T.SEND_F, T.SEND_B)
        pg = _CHANNEL_GROUPS.get((g_src, g_dst, kind), self.s.group)
        return pg, (g_dst if sending else g_src), _TAGS[kind]

    def reap_sends(self) -> None:
        """Wait for, and let go of, the sends whose transfers are done (their tensors are
        freed here rather than at the step's end); the others stay."""
        left = []
        for works, x in self.sends:
            done = all(getattr(w, "is_completed", lambda: False)() for w in works)
            if done:
                for w in works:
                    w.wait()
            else:
                left.append((works, x))
        self.sends = left

    def send(self, step: MetaStep, tensors) -> None:
        pg, peer, tag = self._peer(step)
        out = []
        if step.type is T.SEND_F and not self.s._sent_meta.get(step.stage):
            out.append(self.headers.pop(step.stage))  # made by prepare
            self.s._sent_meta[step.stage] = True
        out += [x.contiguous() for x in tensors]
        for x in out:  # one transfer per call: see hp_pipeline._sim on channels
            works = self.platform.batch_p2p([(x, peer)], [], pg, tag=tag)
            # the tensor is held with its works until they are waited: at the next compute
            # step once they are done (reap_sends), else at the step's end. The lifetime is
            # then the runtime's on every backend (a gloo work holds its tensor until waited,
            # a fake group's not at all, which hp-plan dry-run would otherwise undercount)
            self.sends.append((works, x))

    def post_recv(self, step: MetaStep) -> None:
        pg, peer, tag = self._peer(step)
        st = self.s.stages[step.stage]
        key = (step.type, step.stage, step.microbatch)
        bufs = self.buffers.pop(key, None)
        if bufs is None and step.stage in self.s._in_meta:  # after a header read in this run
            bufs = _empty(self.s._in_meta[step.stage], st.device)
        if bufs is None:  # the first RECV_F of a stage: learn the shapes from the header
            header = torch.empty(_HEADER, dtype=torch.int64, device=st.device)
            for w in self.platform.batch_p2p([], [(header, peer)], pg, tag=tag):
                w.wait()
            meta = self.s._in_meta[step.stage] = _parse_header(header)
            if st.device.type == "cuda":  # order_transfers counts this as a full stop
                torch.cuda.synchronize(st.device)
            given = st.input_meta
            got = [tuple(x[0]) for x in meta]
            if given is not None and [tuple(x[0]) for x in given] != got:
                # a warning, not an error: only this rank knows, and raising here would
                # leave the sending rank waiting for a gradient that never comes
                warnings.warn(
                    f"stage {st.stage_index}: input_args shapes "
                    f"{[tuple(x[0]) for x in given]} differ from what stage "
                    f"{st.stage_index - 1} sends {got}; using the latter",
                    stacklevel=2,
                )
            bufs = _empty(meta, st.device)
        works = []
        for b in bufs:
            works += self.platform.batch_p2p([], [(b, peer)], pg, tag=tag)
        self.recv[key] = (works, bufs)

    def take_recv(self, key) -> list[torch.Tensor]:
        works, bufs = self.recv.pop(key)
        for w in works:
            w.wait()
        return bufs


def _sharded_modules(module) -> list:
    return [m for m in module.modules() if isinstance(m, ShardedModule)]


def _empty(meta, device) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dt, device=device) for shape, dt in meta]


def _header(tensors, device) -> torch.Tensor:
    vals = [len(tensors)]
    for x in tensors:
        vals += [_DTYPES.index(x.dtype), x.dim(), *x.shape]
    if len(vals) > _HEADER:
        raise PipelineError("stage outputs too many or too high-dimensional tensors to describe")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return h.to(device)


def _parse_header(h: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    vals = h.tolist()
    n, k, out = vals[0], 1, []
    for _ in range(n):
        dt, nd = vals[k], vals[k + 1]
        out.append((torch.Size(vals[k + 2 : k + 2 + nd]), _DTYPES[dt]))
        k += 2 + nd
    return out


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards; one stage per rank."""

    name = "gpipe"


class Schedule1F1B(PipelineSchedule):
    """1F1B: one forward, one backward in the steady state; at most ``pp - r`` microbatches
    in flight on rank ``r``."""

    name = "1f1b"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: several stages per rank (stage ``s`` on rank ``s % pp``); needs
    ``n_microbatches % pp == 0``."""

    name = "interleaved_1f1b"


class ScheduleZBV(PipelineSchedule):
    """Zero-bubble V: two stages per rank (``r`` and ``2*pp - 1 - r``), input and weight
    gradients split so weight gradients fill the bubbles."""

    name = "zbv"
