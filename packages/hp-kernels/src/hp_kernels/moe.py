"""MoE token permutation: group routed token copies by expert, and the weighted inverse.

``permute_tokens`` sorts the ``T x k`` routed copies of the tokens by expert, stably (token
order kept within an expert), so each expert sees one contiguous block; ``unpermute_tokens``
scatters expert outputs back and combines each token's ``k`` copies with its routing weights.
Both are differentiable (index-select / index-add underneath). On CPU the order comes from an
O(T k) counting sort in the compiled module; on CUDA from torch's stable sort.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._ext import load

__all__ = ["Permutation", "permute_tokens", "unpermute_tokens"]


class Permutation(NamedTuple):
    """Result of :func:`permute_tokens`.

    Attributes:
        tokens: ``(T * k, H)`` token copies grouped by expert.
        order: ``(T * k,)`` int64: row ``r`` of ``tokens`` is token ``order[r] // k``'s
            ``order[r] % k``-th routed copy.
        counts: ``(num_experts,)`` int64 rows per expert.
        offsets: ``(num_experts + 1,)`` int64 start row of each expert (cumulative counts).
    """

    tokens: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


def _expert_order(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    if flat.device.type == "cpu":
        c = load()
        flat = flat.contiguous()
        order = torch.empty_like(flat)
        counts = torch.empty(num_experts, dtype=torch.int64)
        bad = c.expert_order(
            flat.data_ptr(), flat.numel(), num_experts, order.data_ptr(), counts.data_ptr()
        )
        if bad >= 0:
            raise ValueError(
                f"permute_tokens: expert_indices holds {int(flat[bad])} at flat position {bad}; "
                f"expert ids must lie in [0, num_experts={num_experts})"
            )
        return order, counts
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(
            f"permute_tokens: expert_indices must lie in [0, num_experts={num_experts})"
        )
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def permute_tokens(
    tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> Permutation:
    """Copy each token once per routed expert and group the copies by expert.

    Args:
        tokens: ``(T, H)``.
        expert_indices: ``(T, k)`` (or ``(T,)`` for top-1) integer expert ids.
        num_experts: number of experts ``E``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"permute_tokens: tokens must be (T, H), got shape {tuple(tokens.shape)}")
    if expert_indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"permute_tokens: expert_indices must be int64 or int32, got {expert_indices.dtype}"
        )
    idx = expert_indices if expert_indices.dim() == 2 else expert_indices.unsqueeze(1)
    if idx.dim() != 2 or idx.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute_tokens: expert_indices has shape {tuple(expert_indices.shape)}; it needs "
            f"(T, k) with T = tokens.shape[0] = {tokens.shape[0]}"
        )
    if num_experts <= 0:
        raise ValueError(f"permute_tokens: num_experts={num_experts} must be positive")
    k = idx.shape[1]
    order, counts = _expert_order(idx.reshape(-1).to(torch.int64), num_experts)
    permuted = tokens.index_select(0, torch.div(order, k, rounding_mode="floor"))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Permutation(permuted, order, counts, offsets)


def unpermute_tokens(
    permuted: torch.Tensor,
    order: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`permute_tokens` with a weighted combine:
    ``out[t] = sum_j probs[t, j] * permuted[row of (t, j)]``.

    Args:
        permuted: ``(T * k, H)`` expert outputs in the permuted order.
        order: the ``order`` of the :class:`Permutation`.
        probs: ``(T, k)`` routing weights; ``None`` sums the copies unweighted.
        num_tokens: ``T`` (needed only when ``probs`` is ``None`` and ``k`` > 1).
    """
    if permuted.dim() != 2 or permuted.shape[0] != order.numel():
        raise ValueError(
            f"unpermute_tokens: permuted has shape {tuple(permuted.shape)}; it needs "
            f"({order.numel()}, H), one row per entry of order"
        )
    if probs is not None:
        if probs.dim() == 1:
            probs = probs.unsqueeze(1)
        t, k = probs.shape
        if t * k != order.numel():
            raise ValueError(
                f"unpermute_tokens: probs has shape {tuple(probs.shape)} but order "
                f"has {order.numel()} entries (T * k)"
            )
        weights = probs.reshape(-1).index_select(0, order).to(permuted.dtype).unsqueeze(1)
        rows = permuted * weights
    else:
        t = order.numel() if num_tokens is None else int(num_tokens)
        if order.numel() % t:
            raise ValueError(
                f"unpermute_tokens: num_tokens={t} does not divide {order.numel()} rows"
            )
        k = order.numel() // t
        rows = permuted
    token = torch.div(order, k, rounding_mode="floor")
    out = torch.zeros((t, permuted.shape[1]), dtype=permuted.dtype, device=permuted.device)
    return out.index_add(0, token, rows)
