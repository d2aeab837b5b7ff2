"""Pipeline stages over MindSpore cells (PyNative mode), run by the same named schedules as on
torch: GPipe, 1F1B and interleaved 1F1B.

A stage's forward of a microbatch runs its cell and keeps the inputs; its backward (FULL_B:
the input and the weight gradients at once) reruns that forward under ``mindspore.vjp`` and
applies the output gradient, adding the weight gradients into the stage's ``grads``. PyNative
MindSpore keeps one differentiated graph at a time (a second ``mindspore.vjp`` before the
first's backward fails with "Can not find top cell"), and a pipeline has several microbatches
between forward and backward: so each stage recomputes its forward once per microbatch, and
holds only its inputs in between (as full activation checkpointing of the stage would). The
last stage differentiates ``loss_fn(cell(x), target)`` with the seed ``1 / n_microbatches``
(``scale_grads``), or 1. A cell that draws random numbers (dropout) draws them again in the
rerun: run such cells with their randomness off, or fixed by the cell itself.

Transfers go through hp-dtensor's platform (``batch_p2p``). On CPU MindSpore has no
point-to-point kernels and the platform builds each message from a broadcast in the group of
its two ranks, which holds both until both are there: each rank therefore runs the program of
:func:`hp_pipeline._sim.blocking_program`, its steps with its messages between them in one
order every rank shares. The first message of each channel is preceded by a small header
(shapes and dtypes); later ones reuse it.

Not here (refused by name): ZBV and split input / weight backwards (B and W), overlapping a
backward with a forward, the helper thread, CUDA graphs, recorded timelines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import mindspore as ms
import numpy as np
from mindspore import ops

from hp_dtensor import get_platform

from .._errors import PipelineError, PipelineTypeError, check_bool, check_int
from .._ir import MetaStepType
from .._position import StagePosition, check_stage_index, check_stage_list, stages_per_rank
from .._schedules import build_schedule
from .._sim import Message, blocking_program

__all__ = ["MSPipelineSchedule", "MSPipelineStage", "ShardedCell"]

T = MetaStepType
_HEADER = 32  # int32s: [count, (dtype code, ndim, *shape) per tensor]
_DTYPES = [ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int64, ms.int32, ms.bool_]
_REFUSED = {  # schedule argument -> why MindSpore stages cannot honour it
    "overlap_p2p": "messages are blocking broadcasts on MindSpore's CPU backend: "
    "nothing to post early",
    "overlap_b_f": "the fused backward + forward step is torch-only",
    "threaded_b_f": "the helper-thread backward is torch-only",
    "record_timeline": "timelines are recorded by the torch runtime only",
}


_SCHEDULES = {  # schedule name -> its class, for messages
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
_DEVICES = {"cpu": "CPU", "npu": "Ascend", "ascend": "Ascend", "cuda": "GPU", "gpu": "GPU"}


@runtime_checkable
class ShardedCell(Protocol):
    """What a stage's cell must offer to be gathered once per step and have its gradients
    reduced once per step (``hp_fsdp.fully_shard`` cells do; hp-pipeline needs nothing else
    from hp-fsdp): see hp-fsdp's MindSpore binding."""

    def hold_gathered(self, flag: bool) -> None: ...  # noqa: D102
    def gathered_parameters(self, weights) -> list: ...  # noqa: D102
    def reduce_gradients(self, weights, grads) -> list: ...  # noqa: D102


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class MSPipelineStage(StagePosition):
    """Stage ``stage_index`` of ``num_stages`` over a MindSpore ``nn.Cell`` (what
    ``PipelineStage(cell, ...)`` builds). ``group`` is the pipeline group (None: the whole
    world; else a group name the platform knows, e.g. ``mesh.get_group("pp")``).

    After a schedule's ``step``, ``grads`` holds the gradients of ``weights`` (the cell's
    trainable parameters), summed over the microbatches, ready for an optimizer:
    ``opt(stage.grads)``. A step starts them again from zero.

    A cell that went through ``hp_fsdp.fully_shard`` (a :class:`ShardedCell`) is gathered
    once per step, at its first forward, and stays gathered until the step's end, where its
    summed gradients are reduced to this rank's shards (one reduce-scatter per group):
    ``weights`` and ``grads`` are then the shards."""

    framework = "mindspore"

    def __init__(
        self,
        module,
        stage_index: int,
        num_stages: int,
        *,
        device=None,
        group=None,
        input_args=None,
        activation_hooks=None,
        direct_weight_grads: bool = True,
        cuda_graphs: bool = False,
    ) -> None:
        fn = "PipelineStage"
        if not isinstance(module, ms.nn.Cell):
            raise PipelineTypeError(f"{fn}: module is a {type(module).__name__}: pass an nn.Cell")
        check_stage_index(stage_index, num_stages, fn)
        check_bool(direct_weight_grads, "direct_weight_grads", fn)
        check_bool(cuda_graphs, "cuda_graphs", fn)
        for arg, v, why in (
            ("input_args", input_args, "shapes travel in each channel's first header"),
            ("activation_hooks", activation_hooks, "wrap the cell with hp_offload instead"),
        ):
            if v is not None:
                raise PipelineError(f"{fn}: {arg} is not supported on MindSpore cells ({why})")
        if cuda_graphs:
            raise PipelineError(f"{fn}: cuda_graphs=True needs torch on CUDA, not a MindSpore cell")
        target = ms.get_context("device_target")
        if device is not None and _DEVICES.get(str(device).split(":")[0].lower()) != target:
            raise PipelineTypeError(
                f"{fn}: device={device!r}: MindSpore stages run on the device set with "
                f"mindspore.set_device (here {target}); pass None or that device"
            )
        if not direct_weight_grads:
            raise PipelineError(
                f"{fn}: direct_weight_grads=False is torch-only (it concerns .grad and "
                "AccumulateGrad hooks; a MindSpore stage hands its gradients back in grads): "
                "leave it at True"
            )
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise PipelineError(
                f"{fn}: MindSpore stages run in PyNative mode (mindspore.vjp keeps each "
                "microbatch's graph until its backward); call mindspore.set_context(mode="
                "mindspore.PYNATIVE_MODE)"
            )
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.sharded = isinstance(module, ShardedCell)
        inner = [n for n, c in module.cells_and_names() if n and isinstance(c, ShardedCell)]
        if inner and not self.sharded:
            raise PipelineError(
                f"{fn}: sub-cells {inner[:3]} went through fully_shard but the stage's cell did "
                "not: its gradients would never be reduced (MindSpore has no hook to do it per "
                "cell); apply fully_shard to the stage's cell too, after its blocks"
            )
        self.weights = tuple(module.trainable_params())
        # what the forwards use and the backward differentiates: a sharded cell's gathered
        # Parameters (its gradients are reduced to the shards once per step, in finish)
        self._diff = (
            tuple(module.gathered_parameters(self.weights)) if self.sharded else self.weights
        )
        self._held = False
        self.grads: tuple = ()
        self._saved: dict[int, tuple] = {}  # mb -> (inputs, loss_fn, target) until its backward

    def __repr__(self) -> str:
        name = type(self.module).__name__
        return f"PipelineStage({name}, {self.stage_index}/{self.num_stages}, mindspore)"

    # -- per microbatch ------------------------------------------------------------------------
    def forward(self, mb: int, inputs: tuple, loss_fn=None, target=None):
        """Run the cell on ``inputs`` and keep them (and ``target``) for ``backward(mb, ...)``;
        returns the outputs (the last stage: ``(loss, output)``). MindSpore's PyNative mode
        keeps one differentiated graph at a time (a second ``mindspore.vjp`` replaces the
        first's), so no graph is kept here: the backward reruns this forward under
        ``mindspore.vjp``."""
        self._saved[mb] = (inputs, loss_fn, target)
        out = self.module(*inputs)
        return (loss_fn(out, target), out) if loss_fn is not None else out

    def backward(self, mb: int, grads) -> tuple:
        """The input gradients of microbatch ``mb`` given its output gradients (the last stage:
        the loss's seed): its forward again under ``mindspore.vjp``, then the vjp; the weight
        gradients are added into ``grads``."""
        try:
            inputs, loss_fn, target = self._saved.pop(mb)
        except KeyError:
            raise PipelineError(
                f"stage {self.stage_index}: backward of microbatch {mb} before its forward"
            ) from None
        if loss_fn is not None:

            def run(*xs):
                return loss_fn(self.module(*xs), target)

        else:
            run = self.module
        weights = list(self._diff) or None
        if self.is_first:  # the step's inputs take no gradient
            _, fvjp = ms.vjp(lambda: run(*inputs), weights=weights)
        else:
            _, fvjp = ms.vjp(run, *inputs, weights=weights)
        got = fvjp(grads)
        dx, dw = got if self.weights else (got, ())
        dx = () if self.is_first else _as_tuple(dx)
        if self.weights:
            if self.grads:
                self.grads = tuple(a + b for a, b in zip(self.grads, dw))
            else:
                self.grads = tuple(dw)
        return dx

    def begin(self) -> None:
        """A step's start: zero the gradients; a sharded cell stays gathered from its first
        forward until :meth:`finish`."""
        self.reset()
        if self.sharded:
            self.module.hold_gathered(True)
            self._held = True

    def finish(self) -> None:
        """A step's end: a sharded cell's summed gradients become this rank's shards, and the
        shards go back into the cell."""
        if self._held:
            try:
                if self.grads:
                    self.grads = tuple(self.module.reduce_gradients(self.weights, self.grads))
            finally:
                self._held = False
                self.module.hold_gathered(False)

    def reset(self) -> None:
        """Zero the gradients, drop every microbatch's inputs and let a sharded cell go back
        to its shards (a step's start, or after a failed step)."""
        self._saved.clear()
        self.grads = ()
        if self._held:
            self._held = False
            self.module.hold_gathered(False)


def _split(x, n: int, what: str) -> list:
    if not isinstance(x, ms.Tensor):
        return [x] * n
    if x.ndim == 0:
        raise PipelineError(f"{what} is a 0-d tensor: it has no batch dim to split")
    size = x.shape[0]
    if size % n:
        raise PipelineError(
            f"{what} has batch size {size} on dim 0, not divisible by n_microbatches={n}; "
            f"use a batch that is a multiple of {n} or another n_microbatches"
        )
    return list(ops.split(x, size // n, axis=0))


class MSPipelineSchedule:
    """A named schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``) over this rank's
    MindSpore stages (what ``Schedule1F1B(stages, ...)`` and its siblings build for
    MindSpore stages). ``step(*inputs, target=, losses=)`` as on torch; afterwards each
    stage's ``grads`` holds its summed weight gradients (``grads()`` gives them all, in the
    order of ``weights()``)."""

    framework = "mindspore"

    def __init__(
        self,
        name: str,
        stages,
        n_microbatches: int,
        loss_fn: Callable | None = None,
        *,
        scale_grads: bool = True,
        batch_spec=None,
        **flags,
    ) -> None:
        if name == "zbv":
            raise PipelineError(
                "ScheduleZBV: MindSpore stages run FULL_B backwards only (mindspore.vjp gives "
                "input and weight gradients together): use ScheduleGPipe, Schedule1F1B or "
                "ScheduleInterleaved1F1B"
            )
        if name not in _SCHEDULES:
            raise PipelineTypeError(
                "PipelineSchedule over MindSpore stages: build one of "
                f"{', '.join(_SCHEDULES.values())}, not the base class"
            )
        fn = _SCHEDULES[name]
        stages = check_stage_list(stages, MSPipelineStage, fn, "PipelineStage over a cell")
        check_int(n_microbatches, "n_microbatches", fn, low=1)
        check_bool(scale_grads, "scale_grads", fn)
        for arg, v in flags.items():
            if arg not in _REFUSED:
                raise PipelineTypeError(f"{fn}() got an unexpected keyword argument {arg!r}")
            check_bool(v, arg, fn)
            if v:
                raise PipelineError(
                    f"{fn}: {arg}=True is not supported on MindSpore stages ({_REFUSED[arg]})"
                )
        if batch_spec is not None:
            raise PipelineError(
                f"{fn}: batch_spec is not supported on MindSpore stages: inputs and the target "
                "are split on dim 0"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise PipelineTypeError(f"{fn}: loss_fn is a {type(loss_fn).__name__}, not callable")
        self.stages = {s.stage_index: s for s in stages}
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.group = stages[0].group
        platform = self.platform = get_platform()
        if platform.framework != "mindspore":
            raise PipelineError(
                f"{fn}: MindSpore stages need hp-dtensor's MindSpore platform (HP_BACKEND="
                f"mindspore, as msrun workers set), this process has {platform.framework!r}"
            )
        init = platform.is_initialized()
        self.pp = platform.get_world_size(self.group) if init else 1
        self.rank = platform.get_rank(self.group) if init else 0
        self.ranks = platform.group_ranks(self.group) if init else [0]
        n_stages = stages[0].num_stages
        steps, self.placement = build_schedule(
            name, self.pp, n_microbatches, stages_per_rank=stages_per_rank(n_stages, self.pp, fn)
        )
        if len(self.placement) != n_stages:
            raise PipelineError(
                f"{fn} on {self.pp} ranks runs {len(self.placement)} stages; the stages say "
                f"num_stages={n_stages}"
            )
        mine = sorted(s for s, r in self.placement.items() if r == self.rank)
        if sorted(self.stages) != mine:
            raise PipelineError(
                f"rank {self.rank} must hold stages {mine} for {fn}, got {sorted(self.stages)}"
            )
        if loss_fn is None and any(s.is_last for s in stages):
            raise PipelineError("loss_fn is required on the rank that holds the last stage")
        self.program = blocking_program(steps, self.placement)[self.rank]
        self._meta: dict[tuple[str, int], list] = {}  # channel -> [(shape, dtype)] once known

    def weights(self) -> tuple:
        """This rank's stages' trainable parameters, stage by stage."""
        return tuple(w for s in sorted(self.stages) for w in self.stages[s].weights)

    def grads(self) -> tuple:
        """The gradients of :meth:`weights` after the last step."""
        return tuple(g for s in sorted(self.stages) for g in self.stages[s].grads)

    def step(self, *args, target=None, losses: list | None = None):
        """One pipelined forward and backward of a batch (see the class); returns the last
        stage's outputs concatenated over the microbatches on its rank, else None."""
        m = self.n_microbatches
        n = len(self.placement)
        first, last = self.stages.get(0), self.stages.get(n - 1)
        problem = None
        try:
            if losses is not None and not isinstance(losses, list):
                raise PipelineTypeError(
                    f"step: losses is a {type(losses).__name__}: give a list or None"
                )
            if first is None and args:
                raise PipelineError(f"rank {self.rank} holds no first stage: pass no inputs")
            if first is not None and not args:
                raise PipelineError(f"rank {self.rank} holds the first stage: pass the inputs")
            if last is not None and target is None:
                raise PipelineError(f"rank {self.rank} holds the last stage: pass target=")
            cols = [_split(a, m, f"input {i}") for i, a in enumerate(args)] if first else []
            mbs = [tuple(c[i] for c in cols) for i in range(m)] if first else None
            targets = _split(target, m, "target") if last is not None else None
        except Exception as e:  # every rank hears of it before any rank waits on another
            problem = e
        self._agree(problem)
        self._meta.clear()  # one header per channel per step: shapes may change between steps
        acts: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> inputs for that stage
        cots: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> output gradients
        outs, loss_of = {}, {}
        try:
            for st in self.stages.values():
                st.begin()
            for item in self.program:
                if isinstance(item, Message):
                    self._transfer(item, acts, cots)
                    continue
                s, i = item.stage, item.microbatch
                st = self.stages[s]
                if item.type is T.F:
                    inputs = mbs[i] if s == 0 else acts.pop((s, i))
                    if st.is_last:
                        loss, out = st.forward(i, inputs, self.loss_fn, targets[i])
                        loss_of[i], outs[i] = loss, out
                    else:
                        out = _as_tuple(st.forward(i, inputs))
                        if s + 1 in self.stages:
                            acts[(s + 1, i)] = out
                        else:
                            acts[("out", s, i)] = out
                elif item.type is T.FULL_B:
                    if st.is_last:
                        seed = ops.ones_like(loss_of[i]) / (m if self.scale_grads else 1)
                        dx = st.backward(i, seed)
                    else:
                        g = cots.pop((s, i))
                        dx = st.backward(i, g if len(g) > 1 else g[0])
                    if s > 0:
                        if s - 1 in self.stages:
                            cots[(s - 1, i)] = dx
                        else:
                            cots[("out", s, i)] = dx
                else:  # build_schedule gives these schedules F and FULL_B only
                    raise PipelineError(f"MindSpore stages cannot run {item}")
            for s in sorted(self.stages):  # the same order on every data-parallel replica
                self.stages[s].finish()
        except BaseException:
            for st in self.stages.values():
                st.reset()
            raise
        if last is None:
            return None
        if losses is not None:
            losses.extend(loss_of[i] for i in range(m))
        return ops.concat([outs[i] for i in range(m)], axis=0)

    def _agree(self, problem: Exception | None) -> None:
        """Every rank that could wait on this one learns whether any refused this step's
        arguments (one small all-reduce), and all raise together: a rank that refused raises
        its own error, the others name it. Without this, a first stage that refuses a batch
        would leave the next stages waiting for its activations forever. With sharded stages
        the data-parallel replicas wait on each other too (each group's gather): the whole
        world agrees then, else the pipeline group."""
        sharded = any(st.sharded for st in self.stages.values())
        group, what = (None, "rank(s)") if sharded else (self.group, "pipeline rank(s)")
        init = self.platform.is_initialized()
        n = self.platform.get_world_size(group) if init else 1
        if n > 1:
            me = self.platform.get_rank(group)
            flags = np.zeros(n, np.float32)
            flags[me] = problem is not None
            t = ms.Tensor(flags)
            self.platform.all_reduce(t, "sum", group)
            refused = [r for r, f in enumerate(t.asnumpy()) if f]
            if refused and problem is None:
                raise PipelineError(
                    f"{what} {refused} refused this step's arguments (their error says why, "
                    f"e.g. a batch n_microbatches={self.n_microbatches} does not divide): "
                    "every rank stops this step"
                )
        if problem is not None:
            raise problem

    # -- transfers -----------------------------------------------------------------------------
    def _transfer(self, msg: Message, acts: dict, cots: dict) -> None:
        me = self.rank
        store = acts if msg.kind == "F" else cots
        to = msg.stage + 1 if msg.kind == "F" else msg.stage - 1
        chan = (msg.kind, msg.stage)
        peer = self.ranks[msg.dst if msg.src == me else msg.src]
        if msg.src == me:
            tensors = store.pop(("out", msg.stage, msg.microbatch))
            if chan not in self._meta:
                self._meta[chan] = [(tuple(t.shape), t.dtype) for t in tensors]
                self._send_one(_header(tensors), peer)
            for t in tensors:
                self._send_one(t, peer)
        else:
            if chan not in self._meta:
                h = ms.Tensor(np.zeros(_HEADER, np.int32))
                self._recv_one(h, peer)
                self._meta[chan] = _parse_header(h)
            got = []
            for shape, dt in self._meta[chan]:
                buf = ops.zeros(shape, dt)
                got.append(self._recv_one(buf, peer))
            store[(to, msg.microbatch)] = tuple(got)

    def _send_one(self, t, peer: int) -> None:
        self.platform.batch_p2p([(t, peer)], [], None)

    def _recv_one(self, buf, peer: int):
        self.platform.batch_p2p([], [(buf, peer)], None)
        return buf


def _header(tensors) -> ms.Tensor:
    vals = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise PipelineTypeError(
                f"a stage output of dtype {t.dtype} cannot travel between stages"
            )
        vals += [_DTYPES.index(t.dtype), t.ndim, *t.shape]
    if len(vals) > _HEADER:
        raise PipelineError(
            f"stage outputs too many or too high-rank to describe in {_HEADER} ints"
        )
    a = np.zeros(_HEADER, np.int32)
    a[: len(vals)] = vals
    return ms.Tensor(a)


def _parse_header(h) -> list:
    vals = h.asnumpy().tolist()
    out, k = [], 1
    for _ in range(vals[0]):
        dt, nd = vals[k], vals[k + 1]
        out.append((tuple(vals[k + 2 : k + 2 + nd]), _DTYPES[dt]))
        k += 2 + nd
    return out
