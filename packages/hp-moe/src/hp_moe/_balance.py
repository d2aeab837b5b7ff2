"""Load balancing: the auxiliary loss, auxiliary-loss-free expert bias, capacity drops.

NOTE [Balance statistics and recomputation]
    Activation checkpointing runs a layer's forward again, in backward or (hp-pipeline's
    weight-gradient steps) whenever a saved tensor is read. A recomputed forward must neither
    count its tokens again nor change step statistics, and the auxiliary loss's gradient must
    be the one its first forward computed. So counting and accumulation are skipped while a
    forward is a recomputation (``recomputing()``: autograd is executing a backward on this
    thread, or PyTorch's checkpoint is refilling saved tensors); the loss's expert weights
    ``f`` ride on its autograd node as an attribute, not as a saved tensor, so the node of the
    first forward keeps them (with non-reentrant checkpointing, PyTorch's default and
    hp-offload's, backward runs the first forward's nodes and the recomputation only refills
    their saved tensors). The recomputed forward performs the same autograd-recorded ops in
    the same order, as the checkpoint requires. Reentrant checkpointing runs its first forward
    without autograd, so no loss exists to replay: ``MoE`` refuses an auxiliary loss there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

import hp_dtensor as hp
from hp_kernels.moe import count_experts

from ._checks import check_model, check_number, check_tensor
from .errors import MoEConfigError, MoETypeError

__all__ = [
    "AUX_LOSS_TYPES",
    "MoEAuxLossAutoScaler",
    "capacity_keep",
    "moe_statistics",
    "recomputing",
    "register_expert_bias_update",
    "set_aux_loss_scale",
    "set_load_balance_group",
    "update_expert_bias",
]

AUX_LOSS_TYPES = ("sequence", "batch", "global")


def non_reentrant_recompute() -> bool:
    """True while PyTorch's non-reentrant checkpoint refills saved tensors by recomputing."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return bool(top) and getattr(top[0], "__qualname__", "").startswith("_recomputation_hook")


@torch.compiler.disable
def recomputing() -> bool:
    """True while this forward is an activation-checkpoint recomputation: autograd executes a
    backward on this thread, or PyTorch's checkpoint is refilling saved tensors (which
    hp-pipeline's weight-gradient steps make it do outside a backward). Never traced: it reads
    autograd's state, which a compiled graph cannot guard on (a graph break, run eagerly)."""
    return torch._C._current_graph_task_id() != -1 or non_reentrant_recompute()


class _Unset:
    """The "not declared" marker of a load-balance group (one object, kept by deepcopy)."""

    def __repr__(self) -> str:
        return "<unset>"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_UNSET"


_UNSET = _Unset()


class BalanceGroups:
    """The process groups one ``MoE``'s statistics are summed over: ``balance`` (the ranks
    that see different tokens; ``_UNSET`` until declared) and ``sequence`` (context-parallel
    ranks sharing sequences). Holds process groups: ``deepcopy`` shares it."""

    def __init__(self) -> None:
        self.balance = _UNSET
        self.sequence = None

    def __deepcopy__(self, memo):
        return self


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: the forward returns ``output`` unchanged;
    the backward passes ``output``'s gradient through and gives ``aux_loss`` the gradient
    ``coeff`` (so ``coeff * aux_loss`` is optimised without being added to the main loss).

    ``MoEAuxLossAutoScaler.apply(output, aux_loss, coeff)``.
    """

    @staticmethod
    def forward(ctx, output, aux_loss, coeff=1.0):
        check_tensor(output, "output", "MoEAuxLossAutoScaler")
        check_tensor(aux_loss, "aux_loss", "MoEAuxLossAutoScaler")
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)):
            raise MoETypeError(f"MoEAuxLossAutoScaler: coeff={coeff!r}: give a number")
        ctx.coeff = float(coeff)
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.coeff, dtype=dtype, device=device), None


class _WeightedSum(torch.autograd.Function):
    """``sum(p * w)`` with ``w`` a constant held on the node (see NOTE [Balance statistics and
    recomputation]): a recomputed forward cannot change the weights backward uses."""

    @staticmethod
    def forward(ctx, p, w):
        ctx.w = w
        return (p * w).sum()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w, None


def _probabilities(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores as per-token distributions over the experts (sigmoid scores normalised, as the
    DeepSeek-V3 report's sequence-wise balance loss does)."""
    if score_func == "sigmoid":
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return scores


def aux_loss(
    moe: Any,
    scores: torch.Tensor,
    top_indices: torch.Tensor,
    batch: int,
    seq: int,
    *,
    record: bool,
) -> torch.Tensor:
    """The balance loss ``sum_i f_i * P_i`` of one forward (see ``MoE``'s docstring for the
    three kinds). ``record``: this is a first forward (not a recomputation); accumulate step
    statistics and reduce counts over the groups."""
    e, k = scores.shape[-1], top_indices.shape[-1]
    p = _probabilities(scores, moe.router.score_func)
    with torch.no_grad():
        hits = torch.zeros_like(scores).scatter_(-1, top_indices, 1.0)
    kind = moe.aux_loss_type
    if kind == "sequence":
        group = moe.sequence_group
        with torch.no_grad():
            counts = hits.view(batch, seq, e).sum(1)  # (B, E)
            local_len = torch.full((1,), float(seq), device=scores.device)
            summed, size = _reduce(torch.cat([counts.reshape(-1), local_len]), group, record)
            counts, full_len = summed[:-1].view(batch, e), summed[-1]
            # f_b = counts_b E / (k S); the loss averages f_b . mean_b(p) over sequences, and
            # each of the ``size`` ranks holding a part of them contributes its tokens' share
            f = counts * (e / (k * full_len)) * size / (batch * full_len)
        return _WeightedSum.apply(p.view(batch, seq, e).sum(1), f)
    if kind == "batch":  # this forward's tokens: under context parallelism, the whole
        # sequences' (their parts summed over the sequence group, as for "sequence")
        with torch.no_grad():
            local = torch.cat([hits.sum(0), torch.full((1,), float(p.shape[0]), device=p.device)])
            summed, size = _reduce(local, moe.sequence_group, record)
            counts, full = summed[:-1], summed[-1]
            f = counts * (e / (k * full)) * size / full
        return _WeightedSum.apply(p.sum(0), f)
    # global: counts over the balance group, accumulated over the step's microbatches
    with torch.no_grad():
        local = torch.cat([hits.sum(0), torch.full((1,), float(p.shape[0]), device=p.device)])
        summed, size = _reduce(local, moe._balance_group_or_none(), record)
        tokens_now = summed[-1]
        if record:
            moe.global_counts.add_(summed)
            acc = moe.global_counts
        else:  # a recomputation: its value is not used for gradients (see the NOTE)
            acc = summed
        f = acc[:-1] * (e / (k * acc[-1])) * size / tokens_now
    return _WeightedSum.apply(p.sum(0), f)


def _reduce(t: torch.Tensor, group, record: bool) -> tuple[torch.Tensor, int]:
    """``t`` summed over ``group`` (none: this process), and the group's size."""
    if group is None:
        return t, 1
    size = hp.get_platform(t.device.type).get_world_size(group)
    if record and size > 1:
        t = t.clone()
        hp.get_platform(t.device.type).all_reduce(t, "sum", group)
    return t, size


def capacity_keep(
    top_scores: torch.Tensor, top_indices: torch.Tensor, num_experts: int, capacity_factor: float
) -> torch.Tensor:
    """``(T, k)`` bool: the copies each expert keeps when it takes at most ``ceil(factor * T *
    k / E)`` of them, highest gate value first (ties: earlier token, then earlier choice). On
    the device, no host sync."""
    t, k = top_indices.shape
    capacity = math.ceil(capacity_factor * t * k / num_experts)
    flat_e = top_indices.reshape(-1)
    by_score = torch.argsort(top_scores.detach().reshape(-1), descending=True, stable=True)
    order = by_score[torch.argsort(flat_e[by_score], stable=True)]
    counts = count_experts(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(t * k, device=flat_e.device) - starts[flat_e[order]]
    keep = torch.empty(t * k, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank < capacity
    return keep.view(t, k)


# -- auxiliary-loss-free balancing --------------------------------------------------------------


def _moe_modules(model: nn.Module) -> Iterator[nn.Module]:
    from ._moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            yield m


def set_load_balance_group(
    model: nn.Module, group: Any = None, *, sequence_group: Any = _UNSET
) -> None:
    """Declare, for every ``MoE`` in ``model``, the process group over which balance statistics
    are summed: the data-, context- and expert-parallel ranks, the ranks that see different
    tokens (``None``: this process alone). ``aux_loss_type="global"`` reduces its counts over it
    and needs this call (it also says that each step ends with ``update_expert_bias``, which
    resets the accumulated counts). Each rank's "global" loss is scaled by the group's size so
    that the *mean* of the ranks' gradients is the one-process gradient: gradients must be
    averaged over exactly this group (as data-parallel training does); each rank's
    ``aux_loss_total`` is its share, and their mean the one-process value.
    ``sequence_group``: the context-parallel group whose ranks hold parts of the same sequences
    (``aux_loss_type="sequence"`` and ``"batch"``, whose statistics then cover the whole
    sequences; same averaging)."""
    check_model(model, "set_load_balance_group")
    for m in _moe_modules(model):
        groups = BalanceGroups()  # a fresh holder: a deep-copied model shares the old one
        groups.balance = group
        groups.sequence = m.sequence_group if sequence_group is _UNSET else sequence_group
        m.balance_groups = groups


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Multiply every ``MoE``'s auxiliary-loss gradient by ``scale``: ``1 / n`` when the main
    loss is divided by ``n`` accumulation or pipeline microbatches, so that the loss keeps its
    weight ``aux_loss_coeff`` in the step's gradient (``MoEAuxLossAutoScaler`` cannot see the
    main loss's scaling; Megatron's ``set_loss_scale`` is the same knob)."""
    check_model(model, "set_aux_loss_scale")
    check_number(scale, "scale", "set_aux_loss_scale", positive=True)
    for m in _moe_modules(model):
        m.aux_loss_scale = float(scale)


@torch.no_grad()
def update_expert_bias(model: nn.Module, *, group: Any = None) -> None:
    """Auxiliary-loss-free balancing, once per optimizer step, for every ``MoE`` of ``model``
    with ``load_balance_coeff``: ``tokens_per_expert`` summed over ``group`` (counts of the whole
    step, every microbatch), then ``delta = coeff * sign(mean(tokens) - tokens)``, ``delta -=
    delta.mean()``, ``expert_bias += delta``; the counts are zeroed. It also starts a new step
    for ``aux_loss_type="global"``. The counts of all layers go in one all-reduce."""
    check_model(model, "update_expert_bias")
    moes = list(_moe_modules(model))
    biased = [m for m in moes if m.load_balance_coeff]  # 0: the bias stays as it is
    if biased:
        flat = torch.cat([m.tokens_per_expert.float() for m in biased])
        if group is not None and hp.get_platform(flat.device.type).get_world_size(group) > 1:
            hp.get_platform(flat.device.type).all_reduce(flat, "sum", group)
        for m, counts in zip(biased, flat.split([m.num_experts for m in biased])):
            delta = m.load_balance_coeff * torch.sign(counts.mean() - counts)
            delta -= delta.mean()
            m.expert_bias.add_(delta.to(m.expert_bias.dtype))
    reset_statistics(model)


@torch.no_grad()
def reset_statistics(model: nn.Module) -> None:
    """Zero the step's statistics of every ``MoE`` of ``model`` (expert counts, dropped tokens,
    the balance loss's running sum) without moving any expert bias: what a trainer calls for a
    step it skips. ``update_expert_bias`` ends with it."""
    check_model(model, "reset_statistics")
    for m in _moe_modules(model):
        m.tokens_per_expert.zero_()
        m.global_counts.zero_()
        m.dropped_tokens.zero_()
        m.aux_loss_total.zero_()


def register_expert_bias_update(
    optimizer: torch.optim.Optimizer, model: nn.Module, *, group: Any = None
):
    """Run ``update_expert_bias(model, group=group)`` as a pre-step hook of ``optimizer`` (so
    the counts cover every microbatch of the step) and declare ``group`` the load-balance group
    (``set_load_balance_group``). Returns the hook's handle."""
    check_model(model, "register_expert_bias_update")
    if not callable(getattr(optimizer, "register_step_pre_hook", None)):
        raise MoETypeError(
            f"register_expert_bias_update: optimizer is a {type(optimizer).__name__}: give a "
            "torch.optim.Optimizer (one with register_step_pre_hook)"
        )
    moes = list(_moe_modules(model))
    if not moes:
        raise MoEConfigError(
            f"register_expert_bias_update: {type(model).__name__} holds no MoE layer"
        )
    set_load_balance_group(model, group)

    def hook(opt, args, kwargs):
        update_expert_bias(model, group=group)

    return optimizer.register_step_pre_hook(hook)


@torch.no_grad()
def moe_statistics(model: nn.Module, *, group: Any = None) -> list[dict]:
    """The step's statistics of every ``MoE`` in ``model`` so far, one dict per layer (by module
    name): ``tokens`` (routed copies per expert, summed over ``group``), ``imbalance`` (max /
    mean of those), ``aux_loss`` (the step's balance losses, mean over ``group``),
    ``bias_min``/``bias_max`` (the expert bias, None without one) and ``dropped`` (copies
    dropped over capacity, summed). A collective over ``group`` (every rank calls it); read
    it before ``update_expert_bias`` resets the counts."""
    from ._moe import MoE

    check_model(model, "moe_statistics")
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
    if not named:
        return []
    parts = [m.tokens_per_expert.float() for _, m in named]
    flat = torch.cat(
        parts
        + [torch.stack([m.dropped_tokens.float() for _, m in named])]
        + [torch.stack([m.aux_loss_total.float() for _, m in named])]
    )
    size = 1
    if group is not None:
        platform = hp.get_platform(flat.device.type)
        size = platform.get_world_size(group)
        if size > 1:
            platform.all_reduce(flat, "sum", group)
    values = flat.tolist()
    out, pos, n = [], 0, len(named)
    dropped, aux = values[-2 * n : -n], values[-n:]
    for i, (name, m) in enumerate(named):
        counts = values[pos : pos + m.num_experts]
        pos += m.num_experts
        mean = sum(counts) / len(counts)
        bias = m.expert_bias
        out.append(
            {
                "layer": name,
                "tokens": counts,
                "imbalance": max(counts) / mean if mean > 0 else 0.0,
                "aux_loss": aux[i] / size,
                "bias_min": float(bias.min()) if bias is not None else None,
                "bias_max": float(bias.max()) if bias is not None else None,
                "dropped": int(dropped[i]),
            }
        )
    return out
