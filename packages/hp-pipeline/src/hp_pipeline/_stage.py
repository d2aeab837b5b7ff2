"""``PipelineStage``: one stage's module, its per-microbatch state, and the three backward
flavours (input gradient B, weight gradient W, both at once FULL_B)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["PipelineError", "PipelineStage", "ShardedModule"]


class PipelineError(ValueError):
    """Bad pipeline arguments (stage indices, microbatches, inputs)."""


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
    plain_roots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: a module that runs one piece of the model.

    ``device`` defaults to the current accelerator (CPU when there is none); ``group`` is the
    pipeline process group (default: the whole world), whose ranks hold the stages as the
    schedule places them. Inputs and outputs are a tensor or a tuple of tensors; their shapes
    are learnt from the first transfer (a small header travels with a channel's first microbatch);
    ``input_args`` (example inputs, or shapes), if given, are checked against it (a mismatch is
    a warning naming both: only the receiving rank knows, and an error there would leave the
    sender waiting).
    """

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
    ) -> None:
        if not isinstance(module, nn.Module):
            raise PipelineError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise PipelineError(f"num_stages must be a positive int, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise PipelineError(f"stage_index must be in [0, {num_stages}), got {stage_index!r}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device) if device is not None else _default_device()
        self.group = group
        self.input_meta: list[tuple[torch.Size, torch.dtype]] | None = None
        if input_args is not None:
            self.input_meta = [_meta_of(a) for a in _as_tuple(input_args)]
        if activation_hooks is not None and not callable(activation_hooks):
            raise PipelineError("activation_hooks must be a callable: microbatch -> context")
        self.activation_hooks = activation_hooks
        self._chunks: dict[int, _Chunk] = {}
        self.sharded = isinstance(module, ShardedModule)

    # -- facts --------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        """Whether this stage takes the model's inputs."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the model's output (and computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    # -- forward ------------------------------------------------------------------------------
    def forward_one_chunk(self, mb: int, args: tuple, kwargs: dict | None = None) -> tuple:
        """Run microbatch ``mb`` through the module; keep what its backward needs.

        On a stage other than the first, floating-point ``args`` become leaves that want a
        gradient (detached from whatever produced them), so this stage's backward stops here.
        """
        if mb in self._chunks:
            raise PipelineError(f"stage {self.stage_index}: microbatch {mb} ran forward twice")
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

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        """The last stage's (scaled) loss for ``mb``: its backward starts there."""
        self._chunks[mb].loss = loss

    def outputs(self, mb: int) -> tuple[torch.Tensor, ...]:
        """The forward outputs of ``mb`` (to send on)."""
        return tuple(self._chunks[mb].outputs)

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
        c = self._chunks[mb]
        outs, gs = self._roots(mb, grads)
        if outs:
            torch.autograd.backward(outs, gs)
        del self._chunks[mb]
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in c.inputs]

    def backward_input(self, mb: int, grads: tuple | None = None) -> list[torch.Tensor | None]:
        """B: only the input gradients of ``mb``; what the weight gradients need is kept for
        :meth:`backward_weight` (the gradient arriving at each graph node that has a
        parameter branch)."""
        c = self._chunks[mb]
        outs, gs = self._roots(mb, grads)
        if not outs:
            c.input_grads = [None] * len(c.inputs)
            return c.input_grads
        on_path, cuts = _split_graph(outs, c.inputs)
        captured: dict[object, tuple] = {}
        handles = [
            node.register_prehook(lambda go, node=node: captured.__setitem__(node, go))
            for node, _ in cuts
        ]
        try:
            if c.inputs:
                dx = torch.autograd.grad(outs, c.inputs, gs, retain_graph=True, allow_unused=True)
            else:
                dx = []
        finally:
            for h in handles:
                h.remove()
        c.weight_roots = [
            (node, list(captured[node]), branch) for node, branch in cuts if node in captured
        ]
        c.plain_roots = [(o, g) for o, g in zip(outs, gs) if o.grad_fn not in on_path]
        c.input_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(dx, c.inputs)]
        return c.input_grads

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients of ``mb`` from what :meth:`backward_input` kept.

        Each cut node runs again from the gradient it received, asked only for its parameter
        branches (so its input-side outputs are not computed and nothing upstream is
        revisited); then those branches run down to the parameters in one backward, together
        with the outputs that never reached an input (the whole backward of a first stage).
        One call per cut node: one call for all of them would feed each node the gradient of
        the nodes above it a second time.
        """
        c = self._chunks.pop(mb)
        if c.input_grads is None:
            raise PipelineError(f"stage {self.stage_index}: W of {mb} before its B")
        tails, tail_grads = [], []
        for node, grads_out, branch in c.weight_roots:
            if _matmul_weight_grads(node, grads_out, branch, tails, tail_grads):
                continue
            roots = [GradientEdge(node, i) for i, g in enumerate(grads_out) if g is not None]
            if not roots:
                continue
            gs = [g for g in grads_out if g is not None]
            edges = [e for _, e in branch]
            got = torch.autograd.grad(roots, edges, gs, allow_unused=True)
            for e, g in zip(edges, got):
                if g is not None:
                    tails.append(e)
                    tail_grads.append(g)
        for o, g in c.plain_roots:
            tails.append(o)
            tail_grads.append(g)
        if tails:
            torch.autograd.backward(tails, tail_grads)

    def clear(self) -> None:
        """Drop every microbatch's state (after a failed step)."""
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


def _matmul_weight_grads(node, grads_out, branch, tails, tail_grads) -> bool:
    """The weight gradient of a matmul cut node (``x @ W.t()``, ``bias + x @ W.t()``: every
    linear layer) from its saved input, as one matrix product launched here instead of an
    autograd call per node; the branch below (transpose, dtype cast, accumulation) runs with
    the others. False for any other node: it then goes through autograd."""
    kind = type(node).__name__
    g = grads_out[0] if len(grads_out) == 1 else None
    if g is None:
        return False
    slots = dict(branch)
    if kind == "MmBackward0" and set(slots) == {1}:
        tails.append(slots[1])  # grad of mat2 (W^T) = x^T g
        tail_grads.append(node._saved_self.t().mm(g))
        return True
    if kind == "AddmmBackward0" and 2 in slots and set(slots) <= {0, 2}:
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return False
        bias = None
        if 0 in slots:  # the bias, broadcast over rows: its gradient sums them
            edge = slots[0]
            try:
                shape = tuple(edge.node._input_metadata[edge.output_nr].shape)
            except (AttributeError, IndexError):  # no metadata: autograd decides
                return False
            if shape == tuple(g.shape):
                bias = g
            elif shape == (g.shape[-1],):
                bias = g.sum(0)
            else:
                return False
        tails.append(slots[2])
        tail_grads.append(node._saved_mat1.t().mm(g))
        if bias is not None:
            tails.append(slots[0])
            tail_grads.append(bias)
        return True
    return False


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
