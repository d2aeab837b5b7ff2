"""Token dispatch: permutation by expert, all-to-all to the experts' ranks, and the way back.

``dispatch(x, top_scores, top_indices) -> (tokens, num_tokens_per_expert, ctx)`` and
``combine(y, ctx)`` are separate steps. Everything that belongs to one batch (the permutation,
split sizes, gates, masks) lives in the returned :class:`DispatchContext`, and the autograd
nodes keep what their backward needs; a dispatcher holds only configuration (its mesh). So any
number of microbatches can be in flight at once (1F1B, interleaved, ZBV, overlapped B/F), and
each backward uses its own forward's routing, also when activation checkpointing recomputes the
forward.

NOTE [Dispatch layout]
    Local permutation: the ``T * k`` routed copies sorted stably by global expert id
    (``hp_kernels.moe``), copies dropped over capacity last. Experts are laid out contiguously
    over the expert-parallel ranks (rank ``r`` owns experts ``r * E_l ... (r + 1) * E_l - 1``),
    so that order is also grouped by destination rank. After the all-to-all a rank holds blocks
    ``(source rank, local expert)``; one more stable sort (by local expert) gives the grouped
    rows the experts need. Every permutation is applied as a gather both ways (its inverse is
    kept), so nothing scatter-adds with atomics.

NOTE [Host syncs]
    The exact all-to-all needs its split sizes on the host: one device-to-host copy per layer
    and direction pair (the counts of this rank's rows per destination and of the rows it will
    receive, copied together). ``sync_free=True`` avoids it: every (source, destination) block
    is padded to ``rows_per_peer`` rows, the all-to-alls have even splits, and the per-expert
    counts stay on the device (the grouped GEMM reads them there). The default bound,
    ``T * k``, can never overflow, at the price of moving ``ep`` times more bytes; a tighter
    bound drops what overflows (counted in ``ctx.overflow``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import hp_dtensor as hp
from hp_dtensor import DeviceMesh
from hp_kernels import moe as kmoe

from .errors import DispatchError, MoEConfigError

__all__ = [
    "AllToAllDispatcher",
    "CombineHandle",
    "DispatchContext",
    "DispatchHandle",
    "LocalDispatcher",
    "OneSidedDispatcher",
    "TokenDispatcher",
]


@dataclass(eq=False)
class DispatchContext:
    """What ``combine`` needs to undo one ``dispatch``: one per microbatch and layer.

    Attributes:
        num_tokens, top_k: ``T`` and ``k`` of the dispatched batch.
        order, inverse: the local permutation of the ``T * k`` copies (row -> copy, copy -> row).
        gates: ``(T, k)`` gate values multiplied into the expert outputs by ``combine``.
        keep: ``(T, k)`` bool mask of copies kept (None: dropless).
        num_tokens_per_expert: rows per local expert after dispatch (device tensor).
        input_splits, output_splits: rows this rank sent to / received from each peer (exact
            all-to-all; None otherwise).
        regroup, regroup_inverse: the permutation from ``(source, expert)`` blocks to expert
            order after the all-to-all, and its inverse (None without expert parallelism).
        slots: sync-free path: each permuted row's slot in the padded send buffer (a dump slot
            for rows that are not sent).
        overflow: sync-free path: copies dropped because a block exceeded ``rows_per_peer``
            (a device tensor; 0 on the other paths).
        dispatcher: the dispatcher that made it (``combine`` checks it is given back to it).
    """

    num_tokens: int
    top_k: int
    order: torch.Tensor
    inverse: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    regroup: torch.Tensor | None = None
    regroup_inverse: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    overflow: Any = 0
    dispatcher: Any = field(default=None, repr=False)


class DispatchHandle:
    """A dispatch whose all-to-all may still be in flight: ``wait()`` returns ``(tokens,
    num_tokens_per_expert, ctx)``. Work placed between ``dispatch_async`` and ``wait`` (the
    shared experts, another microbatch's compute) overlaps the transfer."""

    def __init__(self, finish, keep_alive=()) -> None:
        self._finish = finish
        self._keep = keep_alive
        self._result = None

    def wait(self):
        """Finish the dispatch (idempotent)."""
        if self._result is None:
            self._result = self._finish()
            self._finish = self._keep = None
        return self._result


class CombineHandle(DispatchHandle):
    """A combine whose all-to-all may still be in flight: ``wait()`` returns the ``(T, dim)``
    output."""


class TokenDispatcher:
    """Base of the dispatchers: ``dispatch``/``combine`` and their ``_async`` forms.

    A dispatcher is configuration (the expert count, a mesh), immutable and shared; copying a
    module copies the reference."""

    num_experts: int

    def dispatch_async(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        top_indices: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
    ) -> DispatchHandle:  # pragma: no cover - overridden
        raise NotImplementedError

    def combine_async(self, y: torch.Tensor, ctx: DispatchContext) -> CombineHandle:
        raise NotImplementedError  # pragma: no cover - overridden

    def dispatch(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        top_indices: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]:
        """Route ``x`` ``(T, dim)``'s copies to their experts.

        Args:
            x: tokens.
            top_scores: ``(T, k)`` gate values (multiplied in by ``combine``).
            top_indices: ``(T, k)`` global expert ids.
            keep: ``(T, k)`` bool, copies to send (None: all; capacity drops otherwise).

        Returns:
            ``tokens`` (rows grouped by this rank's experts), ``num_tokens_per_expert`` (one
            count per local expert, on the device), and the context ``combine`` needs.
        """
        return self.dispatch_async(x, top_scores, top_indices, keep=keep).wait()

    def combine(self, y: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """Expert outputs ``y`` (rows as ``dispatch`` returned them) back to ``(T, dim)``: each
        token's copies returned and summed, weighted by their gates."""
        return self.combine_async(y, ctx).wait()

    def _check_ctx(self, ctx: DispatchContext) -> None:
        if ctx.dispatcher is not self:
            raise DispatchError(
                "combine got a DispatchContext made by another dispatcher: give each combine "
                "the context its own dispatch returned"
            )

    def __deepcopy__(self, memo):
        return self  # immutable configuration holding process groups: shared, not copied


def _check_inputs(x, top_scores, top_indices, keep):
    if x.dim() != 2:
        raise DispatchError(f"dispatch: x must be (T, dim), got shape {tuple(x.shape)}")
    t = x.shape[0]
    if top_indices.dim() != 2 or top_indices.shape[0] != t:
        raise DispatchError(
            f"dispatch: top_indices has shape {tuple(top_indices.shape)}; it needs (T, k) with "
            f"T = {t}"
        )
    if top_scores.shape != top_indices.shape:
        raise DispatchError(
            f"dispatch: top_scores {tuple(top_scores.shape)} and top_indices "
            f"{tuple(top_indices.shape)} must have one shape"
        )
    if keep is not None and keep.shape != top_indices.shape:
        raise DispatchError(f"dispatch: keep {tuple(keep.shape)} must be shaped like top_indices")


class LocalDispatcher(TokenDispatcher):
    """No expert parallelism: every expert is local; dispatch is the permutation alone."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = int(num_experts)

    def dispatch_async(self, x, top_scores, top_indices, *, keep=None):
        _check_inputs(x, top_scores, top_indices, keep)
        perm = kmoe.permute_tokens(x, top_indices, self.num_experts, keep=keep, check=False)
        ctx = DispatchContext(
            num_tokens=x.shape[0],
            top_k=top_indices.shape[1],
            order=perm.order,
            inverse=perm.inverse,
            gates=top_scores,
            keep=keep,
            num_tokens_per_expert=perm.counts,
            dispatcher=self,
        )
        result = (perm.tokens, perm.counts, ctx)
        return DispatchHandle(lambda: result)

    def combine_async(self, y, ctx):
        self._check_ctx(ctx)
        out = kmoe.unpermute_tokens(y, ctx.order, ctx.gates, inverse=ctx.inverse, keep=ctx.keep)
        return CombineHandle(lambda: out)

    def __repr__(self) -> str:
        return f"LocalDispatcher(num_experts={self.num_experts})"


# -- all-to-all with autograd ---------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` to the peers, theirs gathered by ``out_splits``;
    backward is the reverse exchange. With ``pending`` (a list) the exchange is started only and
    its work appended: the caller waits before reading the output."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, exchange, pending):
        ctx.splits = (in_splits, out_splits)
        ctx.exchange = exchange
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = exchange(out, x, out_splits, in_splits, pending is not None)
        if pending is not None:
            pending.append((work, x))
        elif work is not None:
            work.wait()
        return out

    @staticmethod
    def backward(ctx, g):
        in_splits, out_splits = ctx.splits
        g = g.contiguous()
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        work = ctx.exchange(gx, g, in_splits, out_splits, False)
        if work is not None:
            work.wait()
        return gx, None, None, None, None


def _wait_all(pending) -> None:
    for work, _ in pending:
        if work is not None:
            work.wait()
    pending.clear()


class _PlatformExchange:
    """``all_to_all`` through hp-dtensor's platform (gloo, NCCL, HCCL; MindSpore's own)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group(0)
        self.platform = hp.get_platform(mesh.device_type)

    def __call__(self, out, inp, out_splits, in_splits, async_op):
        return self.platform.all_to_all(out, inp, out_splits, in_splits, self.group, async_op)


class _OneSidedExchange:
    """``all_to_all_single`` of hp-kernels: peers read this rank's rows from shared memory on
    CPU; pushed into symmetric memory over NVLink on CUDA. Synchronous (returns no work)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        from hp_kernels import comm

        self.group = mesh.get_group(0)
        self.comm = comm

    def __call__(self, out, inp, out_splits, in_splits, async_op):
        self.comm.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.group)
        return None


class AllToAllDispatcher(TokenDispatcher):
    """Expert parallelism over a 1-D mesh: tokens go to the ranks that own their experts.

    Rank ``r`` of ``mesh`` owns experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``. The exact
    path exchanges per-expert counts, reads the split sizes on the host once (see NOTE [Host
    syncs]) and sends exactly the routed rows with a variable-split all-to-all. With
    ``sync_free=True`` the counts stay on the device and every block is padded to
    ``rows_per_peer`` rows (default ``T * k``: nothing can overflow).

    Args:
        num_experts: ``E`` (all ranks together).
        mesh: the 1-D expert-parallel mesh.
        sync_free: padded, even all-to-alls with device-side counts.
        rows_per_peer: the padded bound per (source, destination) pair (sync-free only).
    """

    _exchange_class = _PlatformExchange

    def __init__(
        self,
        num_experts: int,
        mesh: DeviceMesh,
        *,
        sync_free: bool = False,
        rows_per_peer: int | None = None,
    ) -> None:
        check_ep_mesh(mesh, num_experts, type(self).__name__)
        if rows_per_peer is not None:
            if not sync_free:
                raise MoEConfigError(
                    "rows_per_peer bounds the padded blocks of the sync-free path: pass "
                    "sync_free=True with it, or drop it"
                )
            if not isinstance(rows_per_peer, int) or rows_per_peer <= 0:
                raise MoEConfigError(f"rows_per_peer={rows_per_peer!r} must be a positive int")
        self.num_experts = int(num_experts)
        self.mesh = mesh
        self.ep = mesh.size()
        self.local_experts = self.num_experts // self.ep
        self.sync_free = bool(sync_free)
        self.rows_per_peer = rows_per_peer
        self._exchange = self._exchange_class(mesh)

    def __repr__(self) -> str:
        extra = f", sync_free=True, rows_per_peer={self.rows_per_peer}" if self.sync_free else ""
        return f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep}{extra})"

    # -- the exact path -------------------------------------------------------------------
    def dispatch_async(self, x, top_scores, top_indices, *, keep=None):
        _check_inputs(x, top_scores, top_indices, keep)
        if self.sync_free:
            return self._dispatch_padded(x, top_scores, top_indices, keep)
        ep, el = self.ep, self.local_experts
        t, k = top_indices.shape
        perm = kmoe.permute_tokens(x, top_indices, self.num_experts, keep=keep, check=False)
        counts = perm.counts
        recv_counts = torch.empty_like(counts)
        work = self._exchange(recv_counts, counts, [el] * ep, [el] * ep, False)
        if work is not None:
            work.wait()
        # NOTE [Host syncs]: the one device-to-host copy of this layer's dispatch
        splits = torch.stack([counts.view(ep, el).sum(1), recv_counts.view(ep, el).sum(1)])
        in_splits, out_splits = (list(s) for s in splits.tolist())
        sent = sum(in_splits)
        send = perm.tokens if sent == t * k else perm.tokens[:sent]
        pending: list = []
        received = _AllToAll.apply(send, out_splits, in_splits, self._exchange, pending)

        def finish():
            _wait_all(pending)
            tokens, per_expert, regroup, inverse = self._regroup(
                received, recv_counts.view(ep, el), sum(out_splits)
            )
            ctx = DispatchContext(
                num_tokens=t,
                top_k=k,
                order=perm.order,
                inverse=perm.inverse,
                gates=top_scores,
                keep=keep,
                num_tokens_per_expert=per_expert,
                input_splits=in_splits,
                output_splits=out_splits,
                regroup=regroup,
                regroup_inverse=inverse,
                dispatcher=self,
            )
            return tokens, per_expert, ctx

        return DispatchHandle(finish, (send,))

    def _regroup(self, received, counts_by_source, total):
        """Rows in ``(source, local expert)`` blocks -> grouped by local expert (sources in
        order within an expert)."""
        per_expert = counts_by_source.sum(0)
        if self.local_experts == 1 or self.ep == 1:
            return received, per_expert, None, None
        el = self.local_experts
        ids = torch.arange(el, device=received.device).repeat(self.ep)
        ids = torch.repeat_interleave(ids, counts_by_source.reshape(-1), output_size=total)
        order, _ = kmoe.expert_order(ids, el, check=False)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return kmoe.gather_rows(received, order, inverse), per_expert, order, inverse

    def combine_async(self, y, ctx):
        self._check_ctx(ctx)
        if self.sync_free:
            return self._combine_padded(y, ctx)
        if ctx.regroup is not None:  # back to (source, expert) blocks
            y = kmoe.gather_rows(y, ctx.regroup_inverse, ctx.regroup)
        pending: list = []
        back = _AllToAll.apply(y, ctx.input_splits, ctx.output_splits, self._exchange, pending)

        def finish():
            _wait_all(pending)
            rows = back
            missing = ctx.num_tokens * ctx.top_k - rows.shape[0]
            if missing:  # copies dropped over capacity were not sent: zero rows stand in
                rows = torch.cat([rows, rows.new_zeros((missing, rows.shape[1]))])
            return kmoe.unpermute_tokens(
                rows, ctx.order, ctx.gates, inverse=ctx.inverse, keep=ctx.keep
            )

        return CombineHandle(finish, (y,))

    # -- the sync-free path ----------------------------------------------------------------
    def _dispatch_padded(self, x, top_scores, top_indices, keep):
        ep, el = self.ep, self.local_experts
        t, k = top_indices.shape
        n = t * k
        cap = self.rows_per_peer or n
        dev = x.device
        perm = kmoe.permute_tokens(x, top_indices, self.num_experts, keep=keep, check=False)
        by_rank = perm.counts.view(ep, el)
        # rows sent per (destination, expert): a block is cut at ``cap`` rows, experts in order
        start = torch.cumsum(by_rank, 1) - by_rank
        sent = (cap - start).clamp(min=0).minimum(by_rank)
        # each permuted row's destination and position in its destination's block
        rank_rows = by_rank.sum(1)
        rank_start = torch.cumsum(rank_rows, 0) - rank_rows
        row = torch.arange(n, device=dev)
        kept_rows = rank_rows.sum()
        dest = torch.searchsorted(torch.cumsum(rank_rows, 0), row, right=True).clamp(max=ep - 1)
        pos = row - rank_start[dest]
        valid = (row < kept_rows) & (pos < cap)
        slots = torch.where(valid, dest * cap + pos, ep * cap)  # ep * cap: the dump slot
        send = x.new_zeros((ep * cap + 1, x.shape[1])).index_copy(0, slots, perm.tokens)
        send = send[: ep * cap]
        recv_sent = torch.empty(ep * el, dtype=sent.dtype, device=dev)
        work = self._exchange(recv_sent, sent.reshape(-1), [el] * ep, [el] * ep, False)
        if work is not None:
            work.wait()
        recv_sent = recv_sent.view(ep, el)
        pending: list = []
        even = [cap] * ep
        received = _AllToAll.apply(send, even, even, self._exchange, pending)
        overflow = (by_rank - sent).sum()

        def finish():
            _wait_all(pending)
            # local expert of each received row; el marks padding
            ends = torch.cumsum(recv_sent, 1)  # (ep, el)
            i = torch.arange(cap, device=dev).expand(ep, cap).contiguous()
            ids = torch.searchsorted(ends, i, right=True).reshape(-1)
            real = ids < el
            order, _ = kmoe.expert_order(ids.clamp(max=el - 1), el, keep=real, check=False)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=dev)
            tokens = kmoe.gather_rows(received, order, inverse)
            per_expert = recv_sent.sum(0)
            ctx = DispatchContext(
                num_tokens=t,
                top_k=k,
                order=perm.order,
                inverse=perm.inverse,
                gates=top_scores,
                keep=_and(keep, valid.index_select(0, perm.inverse).view(t, k)),
                num_tokens_per_expert=per_expert,
                regroup=order,
                regroup_inverse=inverse,
                slots=slots,
                overflow=overflow,
                dispatcher=self,
            )
            return tokens, per_expert, ctx

        return DispatchHandle(finish, (send,))

    def _combine_padded(self, y, ctx):
        cap_rows = y.shape[0]
        y = kmoe.gather_rows(y, ctx.regroup_inverse, ctx.regroup)
        pending: list = []
        even = [cap_rows // self.ep] * self.ep
        back = _AllToAll.apply(y, even, even, self._exchange, pending)

        def finish():
            _wait_all(pending)
            rows = torch.cat([back, back.new_zeros((1, back.shape[1]))])
            rows = rows.index_select(0, ctx.slots)  # unsent rows read the zero dump row
            return kmoe.unpermute_tokens(
                rows, ctx.order, ctx.gates, inverse=ctx.inverse, keep=ctx.keep
            )

        return CombineHandle(finish, (y,))


def _and(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a & b


class OneSidedDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` whose exchanges are hp-kernels' one-sided all-to-all (shared
    memory between the CPU ranks of a host; symmetric memory over NVLink on CUDA) instead of
    the collective library's. The mesh's ranks must share one host."""

    _exchange_class = _OneSidedExchange


def check_ep_mesh(mesh: Any, num_experts: int, who: str) -> None:
    """Raise before any collective when ``mesh`` cannot serve as an expert-parallel mesh."""
    from hp_dtensor import MeshError

    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{who}: mesh must be an hp_dtensor DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise MeshError(
            f"{who}: the expert-parallel mesh must be 1-D, got {mesh}: pass mesh['ep'] (use "
            f"ExpertTensorParallel for a 2-D [ep, tp] mesh)"
        )
    if num_experts % mesh.size():
        raise MoEConfigError(
            f"{who}: num_experts={num_experts} is not divisible by the expert-parallel degree "
            f"{mesh.size()}: choose a degree that divides the expert count"
        )
