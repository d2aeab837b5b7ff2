"""``PipelineStage``: one stage's module, its per-microbatch state, and the three backward
flavours (input gradient B, weight gradient W, both at once FULL_B)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, get_gradient_edge

from hp_dtensor import framework_of

from ._errors import PipelineError, PipelineTypeError, check_bool, check_int
from ._graphs import StageGraphs, check_graphable
from ._position import StagePosition, check_stage_index

__all__ = ["PipelineError", "PipelineStage", "ShardedModule"]


@runtime_checkable
class ShardedModule(Protocol):
    """What a stage's module must offer to be gathered once per step instead of once per
    microbatch (``hp_fsdp.fully_shard`` modules do). hp-pipeline needs nothing else from
    hp-fsdp."""

    def unshard(self, async_op: bool = False): ...  # noqa: D102
    def reshard(self) -> None: ...  # noqa: D102
    def set_requires_gradient_sync(self, flag: bool, *, recurse: bool = True): ...  # noqa: D102
    def set_reshard_after_forward(self, flag: bool | None, *, recurse: bool = True): ...  # noqa: D102
    def set_reshard_after_backward(self, flag: bool, *, recurse: bool = True): ...  # noqa: D102
    def reduce_gradients(self) -> None: ...  # noqa: D102


@dataclass
class _Chunk:
    """What one microbatch left on a stage between its forward and its backward."""

    inputs: list[torch.Tensor]  # leaves that want an input gradient (empty on the first stage)
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None = None
    input_grads: list[torch.Tensor | None] | None = None
    weight_roots: list[tuple[object, list, list[tuple[int, GradientEdge]]]] = field(
        default_factory=list
    )  # W: (cut node, the gradients it received, its parameter branches: (input slot, edge))
    matmuls: list[tuple[_MatmulPlan, object, torch.Tensor]] = field(default_factory=list)
    # W: (a linear layer's plan, its matmul node, the gradient of its output): one x^T g each
    tails: list[tuple[object, torch.Tensor]] = field(default_factory=list)
    # W: parameter branches whose incoming gradient B already computed, and outputs that never
    # reached an input (the whole backward of a first stage): one backward from all of them
    slot: object = None  # cuda_graphs: the _graphs._Slot this microbatch runs in


class PipelineStage(StagePosition):
    """Stage ``stage_index`` of ``num_stages``: a module that runs one piece of the model.

    ``device`` defaults to the current accelerator (CPU when there is none); ``group`` is the
    pipeline process group (default: the whole world), whose ranks hold the stages as the
    schedule places them. Inputs and outputs are a tensor or a tuple of tensors; their shapes
    are learnt from the first transfer (a small header travels with a channel's first microbatch);
    ``input_args`` (example inputs, or shapes), if given, are checked against it (a mismatch is
    a warning naming both: only the receiving rank knows, and an error there would leave the
    sender waiting).

    ``direct_weight_grads`` (default True): in W, a linear weight whose gradient only needs a
    transpose (and autocast's cast) gets it from one GEMM that adds into ``.grad``, skipping
    the parameter's ``AccumulateGrad`` node. Tensor hooks and post-accumulate-grad hooks on the
    parameter are seen and keep autograd's way, but hooks on the ``AccumulateGrad`` node
    itself cannot be seen from Python: pass False when something registers them (Megatron-style
    ``main_grad`` accumulation; torch DDP's reducer, for which it is switched off on its own).

    ``cuda_graphs`` (default False): each microbatch's forward and backward replay CUDA graphs
    captured on first use, one set per microbatch in flight (see ``hp_pipeline._graphs``):
    for stages whose step is bound by the host's kernel launches. Needs a CUDA device, static
    input shapes, positional tensor inputs, plain (unsharded, non-DTensor) parameters, no
    ``activation_hooks``, and a module without host synchronisation or data-dependent
    control flow. Each in-flight microbatch keeps its own graph memory; ``.grad`` tensors are
    fixed buffers the graphs add into (``zero_grad(set_to_none=True)`` still works).
    """

    def __new__(cls, module=None, *args, **kwargs):
        """A MindSpore cell gets the MindSpore binding's stage (``hp_pipeline._backend``),
        with the same arguments; anything else this class."""
        if framework_of(module) == "mindspore":
            from ._backend._mindspore import MSPipelineStage

            return MSPipelineStage(module, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        input_args: tuple | None = None,
        activation_hooks: Callable[[int], AbstractContextManager] | None = None,
        direct_weight_grads: bool = True,
        cuda_graphs: bool = False,
    ) -> None:
        fn = "PipelineStage"
        if not isinstance(module, nn.Module):
            what = (
                f"the class {module.__name__}, not an instance"
                if isinstance(module, type)
                else f"a {type(module).__name__}"
            )
            raise PipelineTypeError(f"{fn}: module is {what}: pass an nn.Module instance")
        check_stage_index(stage_index, num_stages, fn)
        check_bool(direct_weight_grads, "direct_weight_grads", fn)
        check_bool(cuda_graphs, "cuda_graphs", fn)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise PipelineTypeError(
                f"{fn}: group={group!r} is a {type(group).__name__}, not a ProcessGroup: pass "
                "the pipeline group (e.g. mesh.get_group('pp')) or None for the whole world"
            )
        if device is not None and not isinstance(device, (torch.device, str, int)):
            raise PipelineTypeError(
                f"{fn}: device={device!r} is a {type(device).__name__}: give a torch.device, "
                "a str such as 'cuda:0', or None"
            )
        try:
            dev = torch.device(device) if device is not None else _default_device()
        except (RuntimeError, TypeError) as e:
            raise PipelineError(
                f"{fn}: device={device!r} is not a device: give e.g. 'cpu' or 'cuda:0' ({e})"
            ) from None
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = dev
        self.group = group
        self.input_meta: list[tuple[torch.Size, torch.dtype]] | None = None
        if input_args is not None:
            self.input_meta = [_meta_of(a) for a in _as_tuple(input_args)]
        if activation_hooks is not None and not callable(activation_hooks):
            raise PipelineTypeError(
                f"{fn}: activation_hooks={activation_hooks!r} is a "
                f"{type(activation_hooks).__name__}: activation_hooks must be a callable: "
                "microbatch -> context"
            )
        self.activation_hooks = activation_hooks
        self._chunks: dict[int, _Chunk] = {}
        self.sharded = isinstance(module, ShardedModule)
        ddp = torch.nn.parallel.DistributedDataParallel
        self.direct_weight_grads = bool(direct_weight_grads) and not any(
            isinstance(m, ddp) for m in module.modules()
        )
        # what writes .grad (FULL_B, W, B's whole-backward fallback) holds this; a schedule
        # with threaded_b_f puts one lock here for all its stages
        self.grad_lock: AbstractContextManager = nullcontext()
        self.graphs: StageGraphs | None = None
        if cuda_graphs:
            check_graphable(self)
            self.graphs = StageGraphs(self)

    # -- facts --------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    # -- forward ------------------------------------------------------------------------------
    def forward_one_chunk(self, mb: int, args: tuple, kwargs: dict | None = None) -> tuple:
        """Run microbatch ``mb`` through the module; keep what its backward needs.

        On a stage other than the first, floating-point ``args`` become leaves that want a
        gradient (detached from whatever produced them), so this stage's backward stops here.
        """
        check_int(mb, "mb", "PipelineStage.forward_one_chunk")
        if not isinstance(args, (tuple, list)):
            raise PipelineTypeError(
                f"PipelineStage.forward_one_chunk: args is a {type(args).__name__}: give a tuple "
                "of inputs, e.g. (x,)"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise PipelineTypeError(
                f"PipelineStage.forward_one_chunk: kwargs is a {type(kwargs).__name__}: give a "
                "dict (or None)"
            )
        if mb in self._chunks:
            raise PipelineError(f"stage {self.stage_index}: microbatch {mb} ran forward twice")
        if self.graphs is not None:
            outs, slot = self.graphs.forward(mb, args, kwargs)
            self._chunks[mb] = _Chunk(inputs=[], outputs=outs, slot=slot)
            return tuple(outs)
        return self._forward(mb, args, kwargs)

    def _forward(self, mb: int, args: tuple, kwargs: dict | None) -> tuple:
        ins: list[torch.Tensor] = []
        if not self.is_first:
            args = tuple(_leaf(a, ins) for a in args)
        if self.activation_hooks is None:
            out = self.module(*args, **(kwargs or {}))
        else:
            with self.activation_hooks(mb):
                out = self.module(*args, **(kwargs or {}))
        outs = list(_as_tuple(out))
        for o in outs:
            if not isinstance(o, torch.Tensor):
                raise PipelineError(
                    f"stage {self.stage_index} returned a {type(o).__name__}; a stage must "
                    "return a tensor or a tuple of tensors"
                )
        self._chunks[mb] = _Chunk(inputs=ins, outputs=outs)
        return tuple(outs)

    def _chunk(self, mb: int, fn: str) -> _Chunk:
        c = self._chunks.get(mb) if isinstance(mb, int) else None
        if c is None:
            raise PipelineError(
                f"PipelineStage.{fn}: mb={mb!r} has no forward on stage {self.stage_index} "
                f"(microbatches with state here: {sorted(self._chunks)}): run "
                "forward_one_chunk(mb, ...) first"
            )
        return c

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        """The last stage's (scaled) loss for ``mb``: its backward starts there."""
        c = self._chunk(mb, "set_loss")
        if not isinstance(loss, torch.Tensor):
            raise PipelineTypeError(
                f"PipelineStage.set_loss: loss is a {type(loss).__name__}: give the loss tensor"
            )
        c.loss = loss

    def outputs(self, mb: int) -> tuple[torch.Tensor, ...]:
        """The forward outputs of ``mb`` (to send on)."""
        return tuple(self._chunk(mb, "outputs").outputs)

    # -- backward -----------------------------------------------------------------------------
    def _roots(self, mb: int, grads: tuple | None):
        c = self._chunks[mb]
        if c.loss is not None:
            return [c.loss], [None]
        if grads is None:
            raise PipelineError(f"stage {self.stage_index}: backward of {mb} without gradients")
        floats = [o for o in c.outputs if o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floats, grads) if o.requires_grad and g is not None]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward_full(self, mb: int, grads: tuple | None = None) -> list[torch.Tensor | None]:
        """FULL_B: input and weight gradients of ``mb`` in one backward. Returns the input
        gradients (to send to the previous stage) and drops ``mb``'s state."""
        slot = self._chunk(mb, "backward_full").slot
        if slot is None:
            return self._backward_full(mb, grads)
        c = self._chunks.pop(mb)
        try:
            dx = self.graphs.backward(slot, c.loss, c.outputs, grads)
            if slot.w is not None:  # captured for B and W: this microbatch takes both here
                slot.w.replay()
        finally:
            self.graphs._give_back(slot)
        return dx

    def _backward_full(self, mb: int, grads: tuple | None) -> list[torch.Tensor | None]:
        c = self._chunks[mb]
        outs, gs = self._roots(mb, grads)
        if outs:
            with self.grad_lock:
                torch.autograd.backward(outs, gs)
        del self._chunks[mb]
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in c.inputs]

    def backward_input(self, mb: int, grads: tuple | None = None) -> list[torch.Tensor | None]:
        """B: only the input gradients of ``mb``; what the weight gradients need is kept for
        :meth:`backward_weight`.

        The graph is cut where a node on an input's path has a branch reaching only
        parameters. For a linear layer's matmul the gradient entering the node is kept (W is
        then one ``x^T g`` from the node's saved input); for any other cut node B also returns
        the gradient entering its parameter branch, in the same backward call: little work
        (norm scales and the like), and one autograd call fewer per node in W.
        """
        c = self._chunk(mb, "backward_input")
        if c.slot is not None:
            if c.slot.w is None:
                raise PipelineError(
                    f"stage {self.stage_index}: B of microbatch {mb}, whose graphs were "
                    "captured for FULL_B only: its schedule's step list has FULL_B for it (was "
                    "the list changed, or is the stage driven by hand alongside a schedule?)"
                )
            c.input_grads = self.graphs.backward(c.slot, c.loss, c.outputs, grads)
            return c.input_grads
        return self._backward_input(mb, grads)

    def _backward_input(self, mb: int, grads: tuple | None) -> list[torch.Tensor | None]:
        c = self._chunks[mb]
        outs, gs = self._roots(mb, grads)
        if not outs:
            c.input_grads = [None] * len(c.inputs)
            return c.input_grads
        on_path, cuts = _split_graph(outs, c.inputs)
        plans = {node: plan for node, br in cuts if (plan := _matmul_plan(node, br)) is not None}
        if _hooked_params(cuts, plans):
            # a tensor hook on a parameter below a non-matmul cut node would run when B reads
            # the gradient there and again when W feeds it on: take the whole backward here
            with self.grad_lock:
                torch.autograd.backward(outs, gs)
            c.matmuls, c.weight_roots, c.tails = [], [], []
            c.input_grads = [
                x.grad if x.grad is not None else torch.zeros_like(x) for x in c.inputs
            ]
            return c.input_grads
        early, late = _branch_edges(
            cuts, plans, [o.grad_fn for o in outs if o.grad_fn not in on_path]
        )
        captured: dict[object, tuple] = {}
        # node prehooks, not GradientEdge inputs: autograd captures an edge's gradient before
        # the hooks on that node (and on the tensor it made) run, and dx gets the hooked one
        handles = [
            node.register_prehook(lambda go, node=node: captured.__setitem__(node, go))
            for node, _ in cuts
            if node in plans or node in late
        ]
        try:
            want = list(c.inputs) + early
            got = (
                torch.autograd.grad(outs, want, gs, retain_graph=True, allow_unused=True)
                if want
                else ()
            )
        finally:
            for h in handles:
                h.remove()
        dx, edge_grads = got[: len(c.inputs)], got[len(c.inputs) :]
        c.matmuls = []
        for node, plan in plans.items():
            if node in captured and captured[node][0] is not None:
                c.matmuls.append((plan, node, captured[node][0]))
        c.weight_roots = [
            (node, list(captured[node]), br)
            for node, br in cuts
            if node in late and node in captured
        ]
        c.tails = [(e, g) for e, g in zip(early, edge_grads) if g is not None]
        c.tails += [(o, g) for o, g in zip(outs, gs) if o.grad_fn not in on_path]
        c.input_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(dx, c.inputs)]
        return c.input_grads

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients of ``mb`` from what :meth:`backward_input` kept.

        Each linear layer's weight gradient is one ``x^T g`` launched here. A cut node whose
        parameter branch B could not take on its own (one shared with a linear layer's) runs
        again from the gradient it received, asked only for its branch. Then every branch runs
        down to the parameters in one backward, with the outputs that never reached an input.

        All of it runs in one ``torch.utils.checkpoint.GraphExecGroup`` (where torch has it):
        under activation checkpointing, reading a saved input outside a backward runs the
        layer's forward again for every read; in one group it runs once per layer.
        """
        c = self._chunks.get(mb)
        if c is None or c.input_grads is None:
            raise PipelineError(f"stage {self.stage_index}: W of {mb} before its B")
        if c.slot is not None:
            del self._chunks[mb]
            try:
                c.slot.w.replay()
            finally:
                self.graphs._give_back(c.slot)
            return
        self._backward_weight(mb)

    def _backward_weight(self, mb: int) -> None:
        c = self._chunks.pop(mb)
        with _exec_group(), self.grad_lock:
            self._weight_grads(c, self.direct_weight_grads)

    @staticmethod
    def _weight_grads(c: _Chunk, direct: bool) -> None:
        tails = [e for e, _ in c.tails]
        tail_grads = [g for _, g in c.tails]
        with torch.no_grad():  # W's own products need no graph of their own
            for plan, node, g in c.matmuls:
                x = plan.saved_input(node)
                _matmul_weight_grads(plan, x, g, tails, tail_grads, direct)
        for node, grads_out, branch in c.weight_roots:
            roots = [GradientEdge(node, i) for i, g in enumerate(grads_out) if g is not None]
            if not roots:
                continue
            gs = [g for g in grads_out if g is not None]
            # one edge once: autograd returns the whole gradient for each copy of an edge
            edges = list({(e.node, e.output_nr): e for _, e in branch}.values())
            got = torch.autograd.grad(roots, edges, gs, allow_unused=True)
            for e, g in zip(edges, got):
                if g is not None:
                    tails.append(e)
                    tail_grads.append(g)
        if tails:
            torch.autograd.backward(tails, tail_grads)

    def clear(self) -> None:
        """Drop every microbatch's state (after a failed step)."""
        for c in self._chunks.values():
            if c.slot is not None:
                self.graphs._give_back(c.slot)
        self._chunks.clear()


def _split_graph(outputs, inputs):
    """Walk the autograd graph below ``outputs``.

    Returns (nodes from which an input is reachable, cut nodes): a cut node lies on an input's
    path and also has a branch that reaches only parameters; the backward of that
    branch is the weight gradient, computed later from the gradient the node received.
    """
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    parents: dict[object, list] = {}
    order = []
    seen = set()
    todo = deque(o.grad_fn for o in outputs if o.grad_fn is not None)
    for n in todo:
        seen.add(n)
    while todo:
        n = todo.popleft()
        order.append(n)
        for child, _ in n.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(n)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    on_path = set()
    todo = deque(n for n in input_nodes if n in seen)
    on_path.update(todo)
    while todo:
        n = todo.popleft()
        for p in parents.get(n, ()):
            if p not in on_path:
                on_path.add(p)
                todo.append(p)
    cuts = []
    for n in order:
        if n not in on_path:
            continue
        branch = [
            (j, GradientEdge(c, nr))
            for j, (c, nr) in enumerate(n.next_functions)
            if c is not None and c not in on_path
        ]
        if branch:
            cuts.append((n, branch))
    return on_path, cuts


@dataclass(frozen=True)
class _MatmulPlan:
    """How a linear layer's matmul cut node gets its weight gradient in W: ``x @ W.t()``
    (``MmBackward0``: input saved as ``self``, the weight branch in slot 1) or
    ``bias + x @ W.t()`` (``AddmmBackward0``: input saved as ``mat1``, weight in slot 2, bias
    in slot 0 with the shape it had)."""

    weight: GradientEdge
    saved: str  # the node attribute holding the input x
    bias: GradientEdge | None = None
    bias_shape: tuple[int, ...] = ()

    def saved_input(self, node) -> torch.Tensor:
        """The matmul's saved input ``x``."""
        return getattr(node, self.saved)


def _matmul_plan(node, branch) -> _MatmulPlan | None:
    """The plan for a matmul cut node whose only parameter branches are its weight (and bias),
    else None: it then goes through autograd."""
    kind = type(node).__name__
    slots = dict(branch)
    if kind == "MmBackward0" and set(slots) == {1}:
        return _MatmulPlan(slots[1], "_saved_self")
    if kind == "AddmmBackward0" and 2 in slots and set(slots) <= {0, 2}:
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        if 0 not in slots:
            return _MatmulPlan(slots[2], "_saved_mat1")
        edge = slots[0]
        try:
            shape = tuple(edge.node._input_metadata[edge.output_nr].shape)
        except (AttributeError, IndexError):  # no metadata: autograd decides
            return None
        return _MatmulPlan(slots[2], "_saved_mat1", edge, shape)
    return None


def _hooked_params(cuts, plans) -> bool:
    """Whether a parameter below a non-matmul cut node has tensor hooks (``register_hook``)."""
    todo = [e.node for node, br in cuts if node not in plans for _, e in br]
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        var = getattr(n, "variable", None)
        if var is not None and getattr(var, "_backward_hooks", None):
            return True
        todo.extend(c for c, _ in n.next_functions if c is not None)
    return False


def _branch_edges(cuts, plans, free=()) -> tuple[list[GradientEdge], set]:
    """Split the parameter branches of the cut nodes that are not planned matmuls: edges whose
    incoming gradient B returns, and cut nodes W must run again. A branch goes to W when its
    node is also reached from another branch (shared with a matmul's weight, say, or below
    another branch), where asking B for it would count a gradient twice."""
    seen: dict[object, int] = {}
    below: set = set()
    todo = [n for n in free if n is not None]  # outputs off the input path feed W's backward too
    while todo:
        n = todo.pop()
        if n not in below:
            below.add(n)
            todo.extend(c for c, _ in n.next_functions if c is not None)
    for _, br in cuts:
        for _, e in br:
            seen[e.node] = seen.get(e.node, 0) + 1
            todo = [n for n, _ in e.node.next_functions if n is not None]
            while todo:
                n = todo.pop()
                if n not in below:
                    below.add(n)
                    todo.extend(c for c, _ in n.next_functions if c is not None)
    early: list[GradientEdge] = []
    late: set = set()
    for node, br in cuts:
        if node in plans:
            continue
        if any(seen[e.node] > 1 or e.node in below for _, e in br):
            late.add(node)
        else:
            early.extend(e for _, e in br)
    return early, late


def _matmul_weight_grads(plan: _MatmulPlan, x, g, tails, tail_grads, direct=True) -> None:
    """The weight gradient of a linear layer (``x^T g``; the bias, broadcast over rows, sums
    ``g`` back to its shape). Where the weight's branch is only a transpose, perhaps a dtype
    cast, and the accumulation into an unhooked parameter, one GEMM adds ``g^T x`` straight
    into ``.grad`` (:func:`_accumulate_into`); else it is a tail of W's backward."""
    param = _grad_sink(plan.weight, x) if direct else None
    if param is None or not _accumulate_into(param, g.t(), x):
        tails.append(plan.weight)
        tail_grads.append(x.t().mm(g))
    if plan.bias is not None:
        tails.append(plan.bias)
        tail_grads.append(g.sum_to_size(plan.bias_shape))


def _only_next(node):
    """The one node a node's gradient flows on to, or None when there are several or none."""
    nexts = node.next_functions
    return nexts[0][0] if len(nexts) == 1 else None


def _grad_sink(edge: GradientEdge, x: torch.Tensor) -> torch.Tensor | None:
    """The parameter at the end of a linear layer's weight branch when all that branch does is
    transpose (``TBackward0``), maybe cast the dtype on the same device (``ToCopyBackward0``,
    autocast's weight cast), and accumulate into a plain parameter with no tensor hooks and no
    post-accumulate-grad hooks. Else None: the branch goes through autograd."""
    node = edge.node
    if type(node).__name__ != "TBackward0":
        return None
    node = _only_next(node)
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        node = _only_next(node)
    if node is None or type(node).__name__ != "AccumulateGrad":
        return None
    param = getattr(node, "variable", None)
    if (
        param is None
        or type(param) not in (nn.Parameter, torch.Tensor)
        or type(x) is not torch.Tensor
        or param.device != x.device
        or param._backward_hooks
        or getattr(param, "_post_accumulate_grad_hooks", None)
        or not param.is_contiguous()
    ):
        return None
    return param


_out_dtype_mm = True  # False once this torch turned out to lack mm/addmm's out_dtype


def _accumulate_into(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``param.grad += a @ b`` in one GEMM (``beta=1``), what autograd's cast and
    accumulation would do in two more kernels; ``param.grad = a @ b`` when it has none. A
    bf16 or fp16 product into an fp32 parameter accumulates in fp32 through ``out_dtype``
    (CUDA only: torch has no CPU kernel for it). False when neither applies (the caller then
    takes autograd's way)."""
    grad = param.grad
    if grad is not None and (
        type(grad) is not torch.Tensor or grad.dtype != param.dtype or grad.requires_grad
    ):
        return False
    if a.dtype != b.dtype:
        return False
    if a.dtype == param.dtype:
        if grad is None:
            param.grad = torch.mm(a, b, out=torch.empty_like(param))
        else:
            grad.addmm_(a, b)
        return True
    global _out_dtype_mm
    if (
        param.device.type != "cuda"
        or a.dtype not in (torch.bfloat16, torch.float16)
        or param.dtype != torch.float32
        or not _out_dtype_mm
    ):
        return False
    try:
        if grad is None:
            param.grad = torch.mm(a, b, out_dtype=param.dtype)
        else:
            torch.addmm(grad, a, b, out_dtype=param.dtype, out=grad)
    except (TypeError, NotImplementedError):  # a torch without out_dtype for mm
        _out_dtype_mm = False
        return False
    return True


@contextmanager
def _exec_group():
    """A new ``GraphExecGroup`` for W (torch >= 2.10; else nothing). Groups do not nest, and a
    caller's group that also covered B would find W's saved inputs already read: the caller's
    group is set aside while W runs."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group is None:
        yield
        return
    outer = group._get_current_group()
    if outer is not None:
        torch._C._set_graph_exec_group(None)
    try:
        with group():
            yield
    finally:
        if outer is not None:
            torch._C._set_graph_exec_group(outer)


def _leaf(a, ins: list):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        x = a.detach().requires_grad_(True)
        ins.append(x)
        return x
    return a


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _meta_of(a) -> tuple[torch.Size, torch.dtype]:
    if isinstance(a, torch.Tensor):
        return a.shape, a.dtype
    if isinstance(a, (tuple, list, torch.Size)):
        return torch.Size(a), torch.get_default_dtype()
    raise PipelineError(f"input_args entries must be tensors or shapes, got {type(a).__name__}")


def _default_device() -> torch.device:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator().type, acc.current_device_index())
    return torch.device("cpu")
