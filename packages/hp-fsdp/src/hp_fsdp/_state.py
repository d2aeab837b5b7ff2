"""State owned by a root ``fully_shard`` module, and the hooks that drive its groups.

NOTE [Root context]
    Everything that spans the groups of one model lives on an ``FSDPContext`` that the groups
    share: which groups' backward started (reduced at the end of backward), the order their
    forwards ran (implicit backward prefetch), the reduce-scatters launched in this backward
    (finished in launch order; HSDP all-reduces overlap the next one), the devices whose
    all-gather stream already waited for compute in this pass, and the side streams. A
    ``fully_shard`` call makes a context for its group and adopts those of the groups inside
    it, so the outermost call owns one context for the whole model (FSDP2 likewise keeps this
    on the root's state). Two models in one process, a frozen teacher beside a student or two
    models trained alternately, never see each other's groups; a model whose groups sit on
    different meshes (experts over their own data-parallel ranks) shares one context, and each
    group reduces over its own mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.autograd import Variable

if TYPE_CHECKING:
    from ._group import ParamGroup

__all__ = ["FSDPContext", "hook_inputs", "reduce_now"]


class FSDPContext:
    """The state one root ``fully_shard`` module owns for all groups under it."""

    def __init__(self) -> None:
        self.groups: list[ParamGroup] = []
        self.pending: list[ParamGroup] = []  # backward started; reduced at the end of backward
        self.forward_order: list[ParamGroup] = []  # forwards of this pass, in order
        self.launched: list[ParamGroup] = []  # reduce-scatters started in this backward
        self.ag_ordered: set = set()  # devices whose all-gather stream waited in this pass
        self.streams: dict = {}  # (device, purpose) -> CUDA side stream

    def adopt(self, group: ParamGroup) -> None:
        """Make ``group`` (and nothing else) one of this context's groups."""
        if group.ctx is not self:
            if group in group.ctx.groups:
                group.ctx.groups.remove(group)
            group.ctx = self
        if group not in self.groups:
            self.groups.append(group)

    def side_stream(self, dev, kind: str, follow: bool = True):
        """A side stream per (CUDA device, purpose); with ``follow`` it first waits for the
        current stream (its inputs were produced there). None on CPU, where collectives are
        ordered anyway."""
        if dev.type != "cuda":
            return None
        s = self.streams.get((dev, kind))
        if s is None:
            s = self.streams[(dev, kind)] = torch.cuda.Stream(dev)
        if follow:
            s.wait_stream(torch.cuda.current_stream(dev))
        return s

    def backward_started(self, group: ParamGroup) -> None:
        """``group``'s backward began: queue the end-of-backward work once per backward."""
        if not self.pending:
            Variable._execution_engine.queue_callback(self.end_of_backward)
        if group not in self.pending:
            group._left = group._fwd_calls
            self.pending.append(group)

    def end_of_backward(self) -> None:
        """Finish every group's reduction: started ones in launch order, then the rest in a
        fixed order (both the same on every rank, as collectives require)."""
        started = list(dict.fromkeys(g for g in self.launched if g in self.pending))
        rest = sorted((g for g in self.pending if g not in started), key=lambda g: -g.index)
        self.pending.clear()
        self.forward_order.clear()
        self.ag_ordered.clear()  # the optimizer step comes next
        try:
            for g in started + rest:
                g.post_backward()
        finally:
            self.launched.clear()
            for g in self.groups:  # all-gathers prefetched for a backward that did not come
                g.discard_prefetch()
                g._fwd_calls = 0


def reduce_now(groups: list[ParamGroup]) -> None:
    """Reduce the gradients the groups accumulated with sync off, outside any backward: all
    reduce-scatters start (in a fixed order, the same on every rank), then all finish."""
    order = sorted((g for g in groups if g.entries), key=lambda g: -g.index)
    try:
        for g in order:
            if g._rs is None:
                g._start_reduce()
        for g in order:
            g._finish_reduce()
    finally:
        for g in order:
            g.ctx.launched.clear()


class _PostBackward(torch.autograd.Function):
    """Identity on a forward call's inputs; its backward tells the group the call is done."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.module_backward_done()
        return (None, *grads)


def hook_inputs(group, args, kwargs):
    """The forward call's inputs that need a gradient, through ``_PostBackward``: when
    gradients reach them, the module's backward is done (the same moment on every rank)."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return args, kwargs
    outs = _PostBackward.apply(group, *[flat[i] for i in idx])
    for i, o in zip(idx, outs):
        flat[i] = o
    return torch.utils._pytree.tree_unflatten(flat, spec)


def tree_map_tensors(fn, tree):
    return torch.utils._pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)
