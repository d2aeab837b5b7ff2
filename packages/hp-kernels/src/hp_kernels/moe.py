"""MoE token permutation: group routed token copies by expert, and the weighted inverse.

``permute_tokens`` sorts the ``T x k`` routed copies of the tokens by expert, stably (token
order kept within an expert), so each expert sees one contiguous block; ``unpermute_tokens``
scatters expert outputs back and combines each token's ``k`` copies with its routing weights.

Both directions are gathers, forward and backward: a permutation is a bijection between the
``T * k`` copies and the rows of the permuted buffer, so ``order`` (row -> copy) and
``inverse`` (copy -> row) turn every scatter-add into a gather followed by a sum over the
``k`` copies of a token. No atomics: results are bitwise reproducible on GPUs, where
``index_add`` is not. On CPU the order comes from an O(T k) counting sort in the compiled
module (torch's stable sort where it was not built); on CUDA from torch's stable sort. Copies
left out with ``keep`` (capacity drops) are placed after every expert's block: they are in no
expert's rows and contribute nothing. ``swiglu`` is the experts' activation, fused with the
rows' gate values (one Triton kernel each way on CUDA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_bool, check_int
from ._ext import is_built, load
from .errors import KernelsTypeError, KernelsValueError

__all__ = [
    "Permutation",
    "balanced_split",
    "count_experts",
    "expert_order",
    "gather_rows",
    "has_data",
    "permute_tokens",
    "swiglu",
    "unpermute_tokens",
]


class Permutation(NamedTuple):
    """Result of :func:`permute_tokens`.

    Attributes:
        tokens: ``(T * k, H)`` token copies grouped by expert (copies left out by ``keep``
            last).
        order: ``(T * k,)`` int64: row ``r`` of ``tokens`` is token ``order[r] // k``'s
            ``order[r] % k``-th routed copy.
        counts: ``(num_experts,)`` int64 rows per expert (kept copies only).
        offsets: ``(num_experts + 1,)`` int64 start row of each expert (cumulative counts).
        inverse: ``(T * k,)`` int64: copy ``c`` sits in row ``inverse[c]`` (``order``'s inverse).
    """

    tokens: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor | None = None


def _tensor(fn: str, value: object, arg: str, *, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise KernelsTypeError(
            f"{fn}: {arg} must be a torch.Tensor{' or None' if none_ok else ''}, got "
            f"{type(value).__name__}"
        )


def count_experts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(num_experts,)`` int64 occurrences of each id in ``expert_ids`` (flattened), without the
    device-to-host sync ``torch.bincount`` makes on CUDA to size its output."""
    _tensor("count_experts", expert_ids, "expert_ids")
    if expert_ids.dtype == torch.bool or expert_ids.is_floating_point() or expert_ids.is_complex():
        raise KernelsTypeError(
            f"count_experts: expert_ids must hold integer ids, got {expert_ids.dtype} (a float "
            "id would be truncated)"
        )
    check_int("count_experts", num_experts, "num_experts", low=1)
    flat = expert_ids.reshape(-1).to(torch.int64)
    out = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return out.scatter_add_(0, flat, torch.ones_like(flat))


def has_data(t: torch.Tensor) -> bool:
    """False for a fake tensor (``FakeTensorMode``: a dry run builds the model with shapes and
    no storage), whose values cannot be read on the host; True otherwise. Code that must read
    routing counts on the host asks this first and, in a dry run, assumes balanced routing."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` as evenly as integers allow (the first ``total % parts``
    get one more): the routing a dry run assumes where the real one is data."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _check_range(flat: torch.Tensor, buckets: int) -> None:
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= buckets):
        raise KernelsValueError(f"expert ids must lie in [0, num_experts={buckets})")


def _counting_order(flat: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order and counts of CPU ids: the compiled O(n) counting sort (range checked on
    the way), or torch's stable sort where the module was not built. Under ``torch.compile``
    (and for fake tensors) torch's stable sort, traced into the graph: the counting sort reads
    raw pointers and the range check reads values on the host, both graph breaks."""
    if not has_data(flat) or torch.compiler.is_compiling():
        return torch.sort(flat, stable=True).indices, count_experts(flat, buckets)
    if not is_built():
        _check_range(flat, buckets)
        return torch.sort(flat, stable=True).indices, count_experts(flat, buckets)
    c = load()
    flat = flat.contiguous()
    order = torch.empty_like(flat)
    counts = torch.empty(buckets, dtype=torch.int64)
    bad = c.expert_order(
        flat.data_ptr(), flat.numel(), buckets, order.data_ptr(), counts.data_ptr()
    )
    if bad >= 0:
        raise KernelsValueError(
            f"expert ids must lie in [0, num_experts={buckets}); flat position {bad} holds "
            f"{int(flat[bad])}"
        )
    return order, counts


def expert_order(
    expert_ids: torch.Tensor,
    num_experts: int,
    *,
    keep: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable order that groups ``expert_ids`` (flattened) by expert, and the counts.

    Args:
        expert_ids: integer ids in ``[0, num_experts)``, any shape (read flattened).
        num_experts: ``E``.
        keep: optional bool mask of ``expert_ids``' shape; entries that are False go after every
            expert's block and are not counted.
        check: on CUDA, check the id range (a device-to-host sync); pass False for ids made by
            a router, which are in range by construction. The CPU path always checks (free)
            outside ``torch.compile``; compiled, it checks as CUDA does.

    Returns:
        ``(order, counts)``: ``order[r]`` is the flat position of the ``r``-th entry in expert
        order (int64, ``expert_ids.numel()`` entries); ``counts`` (``(E,)`` int64) the kept
        entries per expert.
    """
    _tensor("expert_order", expert_ids, "expert_ids")
    if expert_ids.dtype not in (torch.int64, torch.int32):
        raise KernelsTypeError(f"expert ids must be int64 or int32, got {expert_ids.dtype}")
    check_int("expert_order", num_experts, "num_experts")
    if num_experts <= 0:
        raise KernelsValueError(f"num_experts={num_experts} must be positive")
    _tensor("expert_order", keep, "keep", none_ok=True)
    check_bool("expert_order", check, "check")
    flat = expert_ids.reshape(-1).to(torch.int64)
    on_cpu = flat.device.type == "cpu"
    compiling = torch.compiler.is_compiling()
    if check and (not on_cpu or compiling):
        _check_range(flat, num_experts)
    buckets = num_experts
    if keep is not None:
        if keep.shape != expert_ids.shape or keep.dtype != torch.bool:
            raise KernelsValueError(
                f"keep must be a bool tensor of expert_ids' shape {tuple(expert_ids.shape)}, "
                f"got {keep.dtype} {tuple(keep.shape)}"
            )
        if on_cpu and has_data(flat) and not compiling:  # (a fake tensor has no data)
            _check_range(flat, num_experts)  # before the dropped ones take the extra bucket
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped: one bucket past the end
        buckets = num_experts + 1
    if on_cpu:
        order, counts = _counting_order(flat, buckets)
    else:
        order, counts = torch.sort(flat, stable=True).indices, count_experts(flat, buckets)
    return order, counts[:num_experts]


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


class _GatherRows(torch.autograd.Function):
    """``src.index_select(0, order // k)`` where every row of ``src`` is taken exactly ``k``
    times; the backward sums each row's ``k`` copies through ``inverse`` (a gather, no
    atomics), copies not in ``keep`` counting zero."""

    @staticmethod
    def forward(ctx, src, order, inverse, k, keep):
        ctx.save_for_backward(inverse, keep)
        ctx.k, ctx.rows = k, src.shape[0]
        index = order if k == 1 else torch.div(order, k, rounding_mode="floor")
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        inverse, keep = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        if keep is not None:  # rows of dropped copies may hold anything: never add them
            g = g.masked_fill(~keep.reshape(-1, *([1] * (g.dim() - 1))), 0)
        if ctx.k > 1:
            g = g.view(ctx.rows, ctx.k, *grad.shape[1:]).sum(1)
        return g, None, None, None, None


def gather_rows(
    src: torch.Tensor,
    order: torch.Tensor,
    inverse: torch.Tensor,
    k: int = 1,
    *,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``order // k`` of ``src`` (``src.shape[0] * k`` of them), differentiable with a
    gather-only backward. ``inverse`` is ``order``'s inverse permutation (``inverse[order[r]] =
    r``). With ``k = 1`` it applies a permutation of the rows. ``keep`` (one flag per output
    row's source copy, in copy order): the gradients of rows whose copy is not kept are dropped
    (those rows went to no expert, and their gradient is unspecified)."""
    for arg, value in (("src", src), ("order", order), ("inverse", inverse)):
        _tensor("gather_rows", value, arg)
    _tensor("gather_rows", keep, "keep", none_ok=True)
    check_int("gather_rows", k, "k", low=1)
    return _GatherRows.apply(src, order, inverse, k, keep)


def _row_gates(probs, order, dtype):
    return probs.reshape(-1).index_select(0, order).to(dtype)


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j probs[t, j] * permuted[inverse[t * k + j]]`` (copies not in ``keep``
    count zero), with gathers only, forward and backward."""

    @staticmethod
    def forward(ctx, permuted, probs, order, inverse, keep):
        t, k = probs.shape
        rows = permuted.index_select(0, inverse).view(t, k, permuted.shape[1])
        w = probs.to(permuted.dtype)
        if keep is not None:
            rows = rows.masked_fill(~keep.unsqueeze(-1), 0)
            w = w.masked_fill(~keep, 0)
        out = torch.bmm(w.unsqueeze(1), rows).squeeze(1)
        ctx.save_for_backward(permuted, probs, order, inverse, keep)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        permuted, probs, order, inverse, keep = ctx.saved_tensors
        k = ctx.k
        g_rows = grad_out.index_select(0, torch.div(order, k, rounding_mode="floor"))
        grad_permuted = grad_probs = None
        if ctx.needs_input_grad[0]:
            w = probs if keep is None else probs.masked_fill(~keep, 0)
            grad_permuted = g_rows * _row_gates(w, order, g_rows.dtype).unsqueeze(1)
        if ctx.needs_input_grad[1]:
            acc = torch.float32 if permuted.element_size() < 4 else permuted.dtype
            dots = (g_rows * permuted).sum(-1, dtype=acc)
            grad_probs = dots.index_select(0, inverse).view(probs.shape)
            if keep is not None:
                grad_probs = grad_probs.masked_fill(~keep, 0)
            grad_probs = grad_probs.to(probs.dtype)
        return grad_permuted, grad_probs, None, None, None


class _SumCopies(torch.autograd.Function):
    """``out[t] = sum_j permuted[inverse[t * k + j]]`` (copies not in ``keep`` count zero); the
    backward is one gather (no multiply: the weights were applied before)."""

    @staticmethod
    def forward(ctx, permuted, order, inverse, keep, t, k):
        rows = permuted.index_select(0, inverse).view(t, k, permuted.shape[1])
        if keep is not None:
            rows = rows.masked_fill(~keep.view(t, k, 1), 0)
        ctx.save_for_backward(order, keep)
        ctx.k = k
        return rows.sum(1)

    @staticmethod
    def backward(ctx, grad_out):
        order, keep = ctx.saved_tensors
        g = grad_out.index_select(0, torch.div(order, ctx.k, rounding_mode="floor"))
        if keep is not None:
            g = g.masked_fill(~keep.reshape(-1).index_select(0, order).unsqueeze(1), 0)
        return g, None, None, None, None, None


def permute_tokens(
    tokens: torch.Tensor,
    expert_indices: torch.Tensor,
    num_experts: int,
    *,
    keep: torch.Tensor | None = None,
    check: bool = True,
) -> Permutation:
    """Copy each token once per routed expert and group the copies by expert.

    Args:
        tokens: ``(T, H)``.
        expert_indices: ``(T, k)`` (or ``(T,)`` for top-1) integer expert ids.
        num_experts: number of experts ``E``.
        keep: optional ``(T, k)`` bool mask; copies that are False (dropped over capacity) go
            after every expert's block.
        check: see :func:`expert_order`.
    """
    _tensor("permute_tokens", tokens, "tokens")
    _tensor("permute_tokens", expert_indices, "expert_indices")
    _tensor("permute_tokens", keep, "keep", none_ok=True)
    check_int("permute_tokens", num_experts, "num_experts", low=1)
    check_bool("permute_tokens", check, "check")
    if tokens.dim() != 2:
        raise KernelsValueError(
            f"permute_tokens: tokens must be (T, H), got shape {tuple(tokens.shape)}"
        )
    if expert_indices.dtype not in (torch.int64, torch.int32):
        raise KernelsTypeError(
            f"permute_tokens: expert_indices must be int64 or int32, got {expert_indices.dtype}"
        )
    idx = expert_indices if expert_indices.dim() == 2 else expert_indices.unsqueeze(1)
    if idx.dim() != 2 or idx.shape[0] != tokens.shape[0]:
        raise KernelsValueError(
            f"permute_tokens: expert_indices has shape {tuple(expert_indices.shape)}; it needs "
            f"(T, k) with T = tokens.shape[0] = {tokens.shape[0]}"
        )
    if keep is not None and keep.dim() == 1:
        keep = keep.unsqueeze(1)
    k = idx.shape[1]
    try:
        order, counts = expert_order(idx, num_experts, keep=keep, check=check)
    except ValueError as e:
        raise KernelsValueError(f"permute_tokens: {e}") from None
    inverse = _inverse(order)
    permuted = gather_rows(tokens, order, inverse, k, keep=keep)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Permutation(permuted, order, counts, offsets, inverse)


def unpermute_tokens(
    permuted: torch.Tensor,
    order: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    num_tokens: int | None = None,
    inverse: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`permute_tokens` with a weighted combine:
    ``out[t] = sum_j probs[t, j] * permuted[row of (t, j)]``.

    Args:
        permuted: ``(T * k, H)`` expert outputs in the permuted order.
        order: the ``order`` of the :class:`Permutation`.
        probs: ``(T, k)`` routing weights; ``None`` sums the copies unweighted.
        num_tokens: ``T`` (needed only when ``probs`` is ``None`` and ``k`` > 1).
        inverse: the :class:`Permutation`'s ``inverse`` (computed from ``order`` if omitted).
        keep: the mask given to :func:`permute_tokens`; dropped copies count zero (their rows
            may hold anything, NaN included).
    """
    _tensor("unpermute_tokens", permuted, "permuted")
    _tensor("unpermute_tokens", order, "order")
    for arg, value in (("probs", probs), ("inverse", inverse), ("keep", keep)):
        _tensor("unpermute_tokens", value, arg, none_ok=True)
    if num_tokens is not None:
        check_int("unpermute_tokens", num_tokens, "num_tokens", low=1)
    if permuted.dim() != 2 or permuted.shape[0] != order.numel():
        raise KernelsValueError(
            f"unpermute_tokens: permuted has shape {tuple(permuted.shape)}; it needs "
            f"({order.numel()}, H), one row per entry of order"
        )
    if inverse is None:
        inverse = _inverse(order)
    if probs is None:
        t = order.numel() if num_tokens is None else int(num_tokens)
        if t <= 0 or order.numel() % t:
            raise KernelsValueError(
                f"unpermute_tokens: num_tokens={t} does not divide {order.numel()} rows"
            )
        k = order.numel() // t
        if keep is not None:
            keep = keep.reshape(t, k)
        return _SumCopies.apply(permuted, order, inverse, keep, t, k)
    if probs.dim() == 1:
        probs = probs.unsqueeze(1)
    if probs.dim() != 2 or probs.numel() != order.numel():
        raise KernelsValueError(
            f"unpermute_tokens: probs has shape {tuple(probs.shape)} but order "
            f"has {order.numel()} entries (T * k)"
        )
    if keep is not None:
        keep = keep.reshape(probs.shape)
    return _Combine.apply(permuted, probs, order, inverse, keep)


# -- the expert activation -------------------------------------------------------------------


def _triton_ops():
    """The Triton kernels, or None where Triton is not installed (imported once)."""
    global _TRITON
    if _TRITON is _UNLOADED:
        try:
            from . import _triton_moe
        except ImportError:  # no Triton: the torch composite serves
            _TRITON = None
        else:
            _TRITON = _triton_moe
    return _TRITON


_UNLOADED = object()
_TRITON = _UNLOADED


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # float32, or float64 for float64


def _swiglu_torch(a, b, w):
    acc = _acc(a)
    h = torch.nn.functional.silu(a.to(acc)) * b.to(acc)
    if w is not None:
        h = h * w.to(acc).unsqueeze(1)
    return h.to(a.dtype)


def _swiglu_backward_torch(dh, a, b, w):
    acc = _acc(a)
    af, bf, g = a.to(acc), b.to(acc), dh.to(acc)
    sig = torch.sigmoid(af)
    silu = af * sig
    dw = (g * silu * bf).sum(-1) if w is not None else None
    if w is not None:
        g = g * w.to(acc).unsqueeze(1)
    da = g * bf * (sig + silu * (1 - sig))
    return da.to(a.dtype), (g * silu).to(b.dtype), dw


class _SwiGLU(torch.autograd.Function):
    """``silu(a) * b * w[:, None]`` saving only ``a``, ``b`` (and ``w``): the backward recomputes
    the sigmoid instead of keeping ``silu(a)``, one activation-sized tensor less per layer."""

    @staticmethod
    def forward(ctx, a, b, w, fused):
        ctx.fused = fused
        ctx.save_for_backward(a, b, w)
        return fused.swiglu_forward(a, b, w) if fused is not None else _swiglu_torch(a, b, w)

    @staticmethod
    def backward(ctx, dh):
        a, b, w = ctx.saved_tensors
        dh = dh.contiguous()
        if ctx.fused is not None:
            da, db, dw = ctx.fused.swiglu_backward(dh, a, b, w)
        else:
            da, db, dw = _swiglu_backward_torch(dh, a, b, w)
        if dw is not None and w is not None:
            dw = dw.to(w.dtype)
        return da, db, dw, None


def swiglu(a: torch.Tensor, b: torch.Tensor, row_weights: torch.Tensor | None = None):
    """``silu(a) * b``, each row multiplied by ``row_weights[row]`` when given; differentiable
    in all three. ``a``, ``b``: ``(R, H)`` of one dtype; ``row_weights``: ``(R,)`` (a MoE's gate
    values of the rows: weighting the hidden activations equals weighting the expert outputs,
    the down projection being linear). On CUDA with Triton one fused kernel each way; elsewhere
    torch ops. Arithmetic in float32; the result in ``a``'s dtype."""
    _tensor("swiglu", a, "a")
    _tensor("swiglu", b, "b")
    _tensor("swiglu", row_weights, "row_weights", none_ok=True)
    if a.shape != b.shape or a.dim() != 2:
        raise KernelsValueError(
            f"swiglu: a {tuple(a.shape)} and b {tuple(b.shape)} must be one (R, H)"
        )
    if row_weights is not None and row_weights.shape != (a.shape[0],):
        raise KernelsValueError(
            f"swiglu: row_weights has shape {tuple(row_weights.shape)}; it needs ({a.shape[0]},)"
        )
    fused = None
    # under torch.compile the composite is traced and fused by the compiler with its neighbours
    if a.is_cuda and a.dtype == b.dtype and not torch.compiler.is_compiling():
        fused = _triton_ops()
        a, b = a.contiguous(), b.contiguous()
        if row_weights is not None:
            row_weights = row_weights.contiguous()
    return _SwiGLU.apply(a, b, row_weights, fused)
