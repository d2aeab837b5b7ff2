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

from ._checks import check_bool, check_positive_int, check_tensor
from .errors import DispatchError, MoEConfigError, MoEMeshError, MoETypeError

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
            (a device tensor; None on the other paths; ``MoE`` adds it to ``dropped_tokens``).
        row_gates: with ``gates_to_experts``, the gate of each row ``dispatch`` returned (the
            experts multiply it in and ``combine`` sums the copies unweighted); else None.
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
    overflow: torch.Tensor | None = None
    row_gates: torch.Tensor | None = None
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


def _done(value) -> DispatchHandle:
    return DispatchHandle(lambda: value)


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
        gates_to_experts: bool = False,
    ) -> DispatchHandle:
        """``dispatch`` with its transfers possibly still in flight: the returned handle's
        ``wait()`` gives what ``dispatch`` returns."""
        _check_inputs(x, top_scores, top_indices, keep)
        check_bool(gates_to_experts, "gates_to_experts", "dispatch")
        perm = kmoe.permute_tokens(x, top_indices, self.num_experts, keep=keep, check=False)
        gates = None
        if gates_to_experts:  # the gate of each permuted row (a gather both ways); rows of
            # dropped copies reach no expert, so their (unspecified) gradients are dropped
            gates = kmoe.gather_rows(top_scores.reshape(-1, 1), perm.order, perm.inverse, keep=keep)
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
        return self._send(perm.tokens, gates, ctx)

    def _send(self, rows, gates, ctx) -> DispatchHandle:  # pragma: no cover - overridden
        raise NotImplementedError

    def combine_async(self, y: torch.Tensor, ctx: DispatchContext) -> CombineHandle:
        """``combine`` with its transfer possibly still in flight."""
        raise NotImplementedError  # pragma: no cover - overridden

    def dispatch(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        top_indices: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        gates_to_experts: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]:
        """Route ``x`` ``(T, dim)``'s copies to their experts.

        Args:
            x: tokens.
            top_scores: ``(T, k)`` gate values (multiplied in by ``combine``).
            top_indices: ``(T, k)`` global expert ids.
            keep: ``(T, k)`` bool, copies to send (None: all; capacity drops otherwise).
            gates_to_experts: send each row's gate along (``ctx.row_gates``) for the experts
                to multiply into their hidden activations (``experts(tokens, counts,
                row_weights=ctx.row_gates)``: the same product, the down projection being
                linear, and fused into the activation); ``combine`` then sums unweighted.

        Returns:
            ``tokens`` (rows grouped by this rank's experts), ``num_tokens_per_expert`` (one
            count per local expert, on the device), and the context ``combine`` needs.
        """
        return self.dispatch_async(
            x, top_scores, top_indices, keep=keep, gates_to_experts=gates_to_experts
        ).wait()

    def combine(self, y: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """Expert outputs ``y`` (rows as ``dispatch`` returned them) back to ``(T, dim)``: each
        token's copies returned and summed, weighted by their gates (unless the dispatch sent
        the gates to the experts)."""
        return self.combine_async(y, ctx).wait()

    def _check_ctx(self, ctx: DispatchContext) -> None:
        if not isinstance(ctx, DispatchContext):
            raise MoETypeError(
                f"combine: ctx is a {type(ctx).__name__}: give the DispatchContext that this "
                "dispatcher's dispatch returned (its third value)"
            )
        if ctx.dispatcher is not self:
            raise DispatchError(
                "combine got a DispatchContext made by another dispatcher: give each combine "
                "the context its own dispatch returned"
            )

    @staticmethod
    def _unpermute(rows: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """The local permutation undone: each token's copies summed, weighted by the gates
        unless the experts applied them."""
        gates = ctx.gates if ctx.row_gates is None else None
        return kmoe.unpermute_tokens(
            rows, ctx.order, gates, num_tokens=ctx.num_tokens, inverse=ctx.inverse, keep=ctx.keep
        )

    def __deepcopy__(self, memo):
        return self  # immutable configuration holding process groups: shared, not copied


def _check_inputs(x, top_scores, top_indices, keep):
    for name, t in (("x", x), ("top_scores", top_scores), ("top_indices", top_indices)):
        check_tensor(t, name, "dispatch")
    if keep is not None:
        check_tensor(keep, "keep", "dispatch")
        if keep.dtype != torch.bool:
            raise DispatchError(f"dispatch: keep has dtype {keep.dtype}: give a bool mask")
    if top_indices.is_floating_point() or top_indices.dtype == torch.bool:
        raise DispatchError(
            f"dispatch: top_indices has dtype {top_indices.dtype}: give integer expert ids "
            "(the router's second output)"
        )
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
        check_positive_int(num_experts, "num_experts", "LocalDispatcher")
        self.num_experts = int(num_experts)

    def _send(self, rows, gates, ctx):
        if gates is not None:
            ctx.row_gates = gates.view(-1)
        return _done((rows, ctx.num_tokens_per_expert, ctx))

    def combine_async(self, y, ctx):
        self._check_ctx(ctx)
        return _done(self._unpermute(y, ctx))

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


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


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
        check_positive_int(num_experts, "num_experts", type(self).__name__)
        check_ep_mesh(mesh, num_experts, type(self).__name__)
        check_padding(sync_free, rows_per_peer)
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

    def _exchange_counts(self, counts: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """This rank's ``(ep, E_l)`` counts to the peers; theirs for this rank's experts, as
        ``(source, local expert)``. With ``bound`` (the sync-free block size) each peer's bound
        travels along and must equal this rank's: padded exchanges of unequal blocks would
        not match (checked on the device, without a host sync)."""
        ep, el = self.ep, self.local_experts
        send = counts.reshape(ep, el)
        if bound is not None:
            send = torch.cat([send, send.new_full((ep, 1), bound)], 1)
        w = send.shape[1]
        out = torch.empty(ep * w, dtype=counts.dtype, device=counts.device)
        work = self._exchange(out, send.reshape(-1).contiguous(), [w] * ep, [w] * ep, False)
        if work is not None:
            work.wait()
        out = out.view(ep, w)
        if bound is not None:
            torch._assert_async(
                (out[:, el] == bound).all(),
                "sync-free dispatch: the expert-parallel ranks pad to different block sizes "
                "(rows_per_peer defaults to each rank's T * k): give every rank the same number "
                "of tokens, or set rows_per_peer",
            )
            out = out[:, :el]
        return out

    def _send(self, rows, gates, ctx):
        if self.sync_free:
            return self._send_padded(rows, gates, ctx)
        ep, el = self.ep, self.local_experts
        counts = ctx.num_tokens_per_expert.view(ep, el)  # by destination rank, until regrouped
        by_source = self._exchange_counts(counts)
        # NOTE [Host syncs]: the one device-to-host copy of this layer's dispatch
        splits = torch.stack([counts.sum(1), by_source.sum(1)])
        if kmoe.has_data(splits):
            in_splits, out_splits = (list(s) for s in splits.tolist())
        else:  # a dry run (fake tensors): routing unknown, taken as balanced over the ranks
            in_splits = kmoe.balanced_split(int(rows.shape[0]), ep)
            out_splits = list(in_splits)
        sent = sum(in_splits)
        if sent < rows.shape[0]:  # copies dropped over capacity are last: not sent
            rows = rows[:sent]
            gates = None if gates is None else gates[:sent]
        pending: list = []
        received = _AllToAll.apply(rows, out_splits, in_splits, self._exchange, pending)
        if gates is not None:
            gates = _AllToAll.apply(gates, out_splits, in_splits, self._exchange, pending)
        ctx.input_splits, ctx.output_splits = in_splits, out_splits

        def finish():
            _wait_all(pending)
            tokens, regroup = received, None
            if el > 1 and ep > 1:  # (source, expert) blocks -> grouped by local expert
                ids = torch.arange(el, device=rows.device).repeat(ep)
                ids = torch.repeat_interleave(
                    ids, by_source.reshape(-1), output_size=sum(out_splits)
                )
                regroup, _ = kmoe.expert_order(ids, el, check=False)
                ctx.regroup, ctx.regroup_inverse = regroup, _inverse(regroup)
                tokens = kmoe.gather_rows(received, regroup, ctx.regroup_inverse)
            if gates is not None:
                g = (
                    gates
                    if regroup is None
                    else kmoe.gather_rows(gates, regroup, ctx.regroup_inverse)
                )
                ctx.row_gates = g.view(-1)
            ctx.num_tokens_per_expert = by_source.sum(0)
            return tokens, ctx.num_tokens_per_expert, ctx

        return DispatchHandle(finish, (rows, gates))

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
            return self._unpermute(rows, ctx)

        return CombineHandle(finish, (y,))

    # -- the sync-free path ----------------------------------------------------------------
    def _send_padded(self, rows, gates, ctx):
        ep, el = self.ep, self.local_experts
        n = rows.shape[0]
        cap = self.rows_per_peer or n
        dev = rows.device
        by_rank = ctx.num_tokens_per_expert.view(ep, el)
        # rows sent per (destination, expert): a block is cut at ``cap`` rows, experts in order
        start = torch.cumsum(by_rank, 1) - by_rank
        sent = (cap - start).clamp(min=0).minimum(by_rank)
        # each permuted row's destination and position in its destination's block
        rank_rows = by_rank.sum(1)
        rank_end = torch.cumsum(rank_rows, 0)
        row = torch.arange(n, device=dev)
        dest = torch.searchsorted(rank_end, row, right=True).clamp(max=ep - 1)
        pos = row - (rank_end - rank_rows)[dest]
        valid = (row < rank_end[-1]) & (pos < cap)
        slots = torch.where(valid, dest * cap + pos, ep * cap)  # ep * cap: the dump slot

        def padded(x):  # rows into their slots of the (ep * cap) send buffer
            buf = x.new_zeros((ep * cap + 1, *x.shape[1:])).index_copy(0, slots, x)
            return buf[: ep * cap]

        by_source = self._exchange_counts(sent, bound=cap)
        pending: list = []
        even = [cap] * ep
        received = _AllToAll.apply(padded(rows), even, even, self._exchange, pending)
        if gates is not None:
            gates = _AllToAll.apply(padded(gates), even, even, self._exchange, pending)
        ctx.slots, ctx.overflow = slots, (by_rank - sent).sum()
        valid_copies = valid.index_select(0, ctx.inverse).view(ctx.num_tokens, ctx.top_k)
        ctx.keep = valid_copies if ctx.keep is None else ctx.keep & valid_copies

        def finish():
            _wait_all(pending)
            # each received row's local expert; el marks padding (placed after every expert)
            ends = torch.cumsum(by_source, 1)
            i = torch.arange(cap, device=dev).expand(ep, cap).contiguous()
            ids = torch.searchsorted(ends, i, right=True).reshape(-1)
            real = ids < el
            order, _ = kmoe.expert_order(ids.clamp(max=el - 1), el, keep=real, check=False)
            ctx.regroup, ctx.regroup_inverse = order, _inverse(order)
            tokens = kmoe.gather_rows(received, order, ctx.regroup_inverse)
            if gates is not None:
                ctx.row_gates = kmoe.gather_rows(gates, order, ctx.regroup_inverse).view(-1)
            ctx.num_tokens_per_expert = by_source.sum(0)
            return tokens, ctx.num_tokens_per_expert, ctx

        return DispatchHandle(finish, (rows, gates))

    def _combine_padded(self, y, ctx):
        y = kmoe.gather_rows(y, ctx.regroup_inverse, ctx.regroup)
        pending: list = []
        even = [y.shape[0] // self.ep] * self.ep
        back = _AllToAll.apply(y, even, even, self._exchange, pending)

        def finish():
            _wait_all(pending)
            rows = torch.cat([back, back.new_zeros((1, back.shape[1]))])
            rows = rows.index_select(0, ctx.slots)  # unsent rows read the zero dump row
            return self._unpermute(rows, ctx)

        return CombineHandle(finish, (y,))


class OneSidedDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` whose exchanges are hp-kernels' one-sided all-to-all (shared
    memory between the CPU ranks of a host; symmetric memory over NVLink on CUDA) instead of
    the collective library's. The mesh's ranks must share one host."""

    _exchange_class = _OneSidedExchange


def check_padding(sync_free: bool, rows_per_peer) -> None:
    """``rows_per_peer`` belongs to the sync-free path and is a positive int."""
    check_bool(sync_free, "sync_free")
    if rows_per_peer is None:
        return
    if not sync_free:
        raise MoEConfigError(
            "rows_per_peer bounds the padded blocks of the sync-free path: pass sync_free=True "
            "with it, or drop it"
        )
    check_positive_int(rows_per_peer, "rows_per_peer")


def check_ep_mesh(mesh: Any, num_experts: int, who: str) -> None:
    """Raise before any collective when ``mesh`` cannot serve as an expert-parallel mesh."""
    if not isinstance(mesh, DeviceMesh):
        kind = type(mesh).__name__
        if kind == "DeviceMesh":  # torch.distributed's: say whose
            kind = f"{type(mesh).__module__}.{kind}"
        raise MoEMeshError(
            f"{who}: mesh must be an hp_dtensor DeviceMesh, got {kind}: build one with "
            "hp_dtensor.init_device_mesh(...) (a sub-mesh is mesh['ep'])"
        )
    if mesh.ndim != 1:
        raise MoEMeshError(
            f"{who}: the expert-parallel mesh must be 1-D, got {mesh}: pass mesh['ep'] (use "
            f"ExpertTensorParallel for a 2-D [ep, tp] mesh)"
        )
    if num_experts % mesh.size():
        raise MoEConfigError(
            f"{who}: num_experts={num_experts} is not divisible by the expert-parallel degree "
            f"{mesh.size()}: choose a degree that divides the expert count"
        )
