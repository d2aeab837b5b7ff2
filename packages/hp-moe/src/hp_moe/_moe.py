"""The ``MoE`` layer: router, routed experts through a token dispatcher, shared experts."""

from __future__ import annotations

import torch
import torch.nn as nn

from hp_kernels.moe import count_experts

from ._balance import (
    _UNSET,
    AUX_LOSS_TYPES,
    BalanceGroups,
    MoEAuxLossAutoScaler,
    aux_loss,
    capacity_keep,
    non_reentrant_recompute,
    recomputing,
)
from ._checks import check_bool, check_number, check_positive_int
from ._experts import FeedForward, GroupedExperts
from ._router import TokenChoiceTopKRouter, check_routing
from .errors import DispatchError, MoEConfigError, MoETypeError

__all__ = ["MoE", "hoist_recompute_check"]

_FP32_BUFFERS = ("expert_bias", "tokens_per_expert", "aux_loss_total", "global_counts")


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (DeepSeek-V3, Qwen3-MoE, torchtitan's MoE).

    Each token is routed to ``top_k`` of ``num_experts`` SwiGLU experts (``router``, a
    ``TokenChoiceTopKRouter``); the expert outputs are multiplied by their gate values and summed,
    then the shared experts' output (a ``FeedForward`` of ``shared_hidden_dim``, by default
    ``hidden_dim * num_shared_experts``; times ``sigmoid(shared_expert_gate(x))`` with
    ``shared_expert_gate``, as Qwen3.5-MoE) is added. Routing, dispatch, expert compute and
    combine are separate steps: the experts' ``dispatcher`` (local until ``ExpertParallel``
    installs an all-to-all one) returns a ``DispatchContext`` per call, so nothing of a batch
    is kept on the module.

    Load balancing:

    - ``load_balance_coeff``: auxiliary-loss-free balancing (DeepSeek-V3). Buffers
      ``expert_bias`` (persistent, added to the scores only to choose experts) and
      ``tokens_per_expert`` (counts of the step); ``update_expert_bias`` (or the optimizer hook
      of ``register_expert_bias_update``) moves the bias once per step. ``0`` keeps the bias
      (loaded from a checkpoint, say) fixed: it still routes, it is never moved.
    - ``aux_loss_coeff`` > 0: a balance loss ``sum_i f_i P_i`` (``f_i``: the share of routed
      copies that chose expert ``i``, times ``E``; ``P_i``: the mean probability of ``i``)
      attached to the output with ``MoEAuxLossAutoScaler``. ``aux_loss_type``: ``"sequence"``
      (per sequence, averaged; DeepSeek-V3's), ``"batch"`` (this forward's tokens; both over
      the whole sequences under context parallelism, see ``set_load_balance_group``) or
      ``"global"`` (``f`` from the counts of every rank of the load-balance group and of every
      microbatch of the step so far; see ``set_load_balance_group``), whose value and gradient
      averaged over that group do not depend on how the batch is split over its ranks. With
      the main loss divided over ``n`` microbatches, ``set_aux_loss_scale(model, 1 / n)``.
      Needs non-reentrant activation checkpointing where the layer is checkpointed.
    - ``capacity_factor``: dropless when None; otherwise each expert keeps at most ``ceil(factor
      * T * k / E)`` copies, highest gate value first, and the dropped copies are counted in
      ``dropped_tokens``.

    ``moe(x)``: ``(batch, seq, dim)`` -> ``(batch, seq, dim)``.

    Example::

        moe = MoE(64, 128, num_experts=8, top_k=2, num_shared_experts=1)
        y = moe(torch.randn(2, 16, 64))
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        num_shared_experts: int = 0,
        shared_hidden_dim: int | None = None,
        shared_expert_gate: bool = False,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        load_balance_coeff: float | None = None,
        aux_loss_coeff: float = 0.0,
        aux_loss_type: str = "sequence",
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(dim, "dim", "MoE")
        check_positive_int(hidden_dim, "hidden_dim", "MoE")
        check_bool(route_norm, "route_norm", "MoE")
        check_bool(shared_expert_gate, "shared_expert_gate", "MoE")
        check_routing(
            num_experts, top_k, score_func, num_expert_groups, num_limited_groups, route_scale
        )
        _check_balance(
            num_shared_experts, load_balance_coeff, aux_loss_coeff, aux_loss_type, capacity_factor
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.router = TokenChoiceTopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups,
        )
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        if shared_hidden_dim is None:
            shared_hidden_dim = hidden_dim * num_shared_experts
        elif not num_shared_experts:
            raise MoEConfigError(
                f"shared_hidden_dim={shared_hidden_dim} without shared experts: set "
                f"num_shared_experts (>= 1) or drop shared_hidden_dim"
            )
        if shared_expert_gate and not num_shared_experts:
            raise MoEConfigError("shared_expert_gate=True needs num_shared_experts >= 1")
        self.shared_experts = FeedForward(dim, shared_hidden_dim) if num_shared_experts else None
        #: Qwen2/3.5-MoE's gate on the shared experts: their output times sigmoid(gate(x))
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_expert_gate else None
        self.load_balance_coeff = load_balance_coeff
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.aux_loss_type = aux_loss_type
        self.capacity_factor = capacity_factor
        if load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        else:
            self.expert_bias = None
        # step statistics (not checkpointed, reset by update_expert_bias): routed copies per
        # expert, dropped copies, the sum of this step's balance losses, and the "global" loss's
        # accumulated counts (E counts, then the token count)
        self._recomputing: bool | None = None  # set by hoist_recompute_check's wrapper only
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_total", torch.zeros(()), persistent=False)
        self.register_buffer("global_counts", torch.zeros(num_experts + 1), persistent=False)
        #: the process groups balance statistics are summed over (set_load_balance_group);
        #: shared, not copied, by deepcopy
        self.balance_groups = BalanceGroups()
        #: multiplies the auxiliary loss's gradient (set_aux_loss_scale: 1 / microbatches
        #: when the main loss is divided so)
        self.aux_loss_scale = 1.0

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the expert bias and the step statistics in place: a model built on the meta
        device and materialised with ``to_empty`` holds garbage in them until then (its
        parameters are initialised by their modules' ``reset_parameters``)."""
        for name in ("expert_bias", "tokens_per_expert", "dropped_tokens", "aux_loss_total"):
            buf = getattr(self, name)
            if buf is not None:
                buf.zero_()
        self.global_counts.zero_()

    @property
    def balance_group(self):
        """The ranks that see different tokens (data-, context- and expert-parallel)."""
        return self.balance_groups.balance

    @property
    def sequence_group(self):
        """The context-parallel ranks holding parts of the same sequences (or None)."""
        return self.balance_groups.sequence

    def _apply(self, fn, recurse=True):
        # the balance buffers follow the module's device, never its dtype: bf16 counts round
        # and a 1e-3 bias step vanishes next to a bias of 0.5
        keep = {n: b for n, b in self._buffers.items() if n in _FP32_BUFFERS and b is not None}
        for n in keep:
            self._buffers[n] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for n, b in keep.items():
                probe = fn(b.new_empty(0))
                # a device move (or to_empty) applies as is; a dtype cast moves the device only
                self._buffers[n] = fn(b) if probe.dtype == b.dtype else b.to(probe.device)
        return self

    def _balance_group_or_none(self):
        if self.balance_groups.balance is _UNSET:
            raise DispatchError(
                'aux_loss_type="global" reduces its counts over the load-balance group and '
                "accumulates them until the step ends: call hp_moe.register_expert_bias_update("
                "optimizer, model, group=...) (or set_load_balance_group and update_expert_bias "
                "after each step) before training"
            )
        return self.balance_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise MoETypeError(f"MoE: x is a {type(x).__name__}: give a (batch, seq, dim) tensor")
        if x.dim() in (2, 3) and x.shape[-1] != self.experts.dim:
            raise DispatchError(
                f"MoE: x has shape {tuple(x.shape)}; this layer takes (batch, seq, "
                f"dim={self.experts.dim})"
            )
        if x.dim() == 2:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != 3:
            raise DispatchError(f"MoE takes (batch, seq, dim), got shape {tuple(x.shape)}")
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        top_scores, top_indices, scores = self.router(flat, self.expert_bias)
        # see NOTE [Balance statistics ...]; read before the call when hoist_recompute_check
        # wraps a compiled region (a bool the graph guards on, instead of a graph break)
        rec = self._recomputing
        record = self.training and not (recomputing() if rec is None else rec)
        keep = None
        if self.capacity_factor is not None:
            keep = capacity_keep(top_scores, top_indices, self.num_experts, self.capacity_factor)
        if record:
            with torch.no_grad():
                self.tokens_per_expert.add_(count_experts(top_indices, self.num_experts))
                if keep is not None:
                    self.dropped_tokens.add_(keep.numel() - keep.sum())
        aux = None
        if self.training and self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            if not record and not non_reentrant_recompute():
                raise DispatchError(
                    "an auxiliary loss under reentrant activation checkpointing: its first "
                    "forward ran without autograd, so the loss's weights of that forward cannot "
                    "be replayed; use torch.utils.checkpoint(..., use_reentrant=False) (or "
                    "hp_offload.checkpoint_wrapper), or aux_loss_coeff=0"
                )
            aux = aux_loss(self, scores, top_indices, b, s, record=record)
        dispatcher = self.experts.dispatcher
        # the gates travel with the rows and are multiplied into the experts' activations
        handle = dispatcher.dispatch_async(
            flat, top_scores, top_indices, keep=keep, gates_to_experts=True
        )
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
        tokens, counts, ctx = handle.wait()
        if record and ctx.overflow is not None:  # sync-free blocks over their bound
            self.dropped_tokens.add_(ctx.overflow)
        y = self.experts(tokens, counts, row_weights=ctx.row_gates)
        out = dispatcher.combine(y, ctx).to(x.dtype)
        if shared is not None:
            out = out + shared
        if aux is not None:
            if record:
                self.aux_loss_total.add_(aux.detach())
            out = MoEAuxLossAutoScaler.apply(out, aux, self.aux_loss_coeff * self.aux_loss_scale)
        return out.view(b, s, d)

    def extra_repr(self) -> str:
        extra = []
        if self.load_balance_coeff is not None:
            extra.append(f"load_balance_coeff={self.load_balance_coeff}")
        if self.aux_loss_coeff:
            extra.append(f"aux_loss_coeff={self.aux_loss_coeff}, aux={self.aux_loss_type!r}")
        if self.capacity_factor is not None:
            extra.append(f"capacity_factor={self.capacity_factor}")
        return ", ".join([f"num_experts={self.num_experts}, top_k={self.top_k}", *extra])


def _check_balance(shared, lb_coeff, aux_coeff, aux_type, capacity_factor) -> None:
    if not isinstance(shared, int) or isinstance(shared, bool):
        raise MoETypeError(f"num_shared_experts={shared!r} must be an int >= 0")
    if shared < 0:
        raise MoEConfigError(f"num_shared_experts={shared!r} must be an int >= 0")
    if lb_coeff is not None:  # 0 keeps the expert bias fixed; None: no expert bias
        check_number(lb_coeff, "load_balance_coeff", hint=" (0: a fixed bias; None: no bias)")
    check_number(aux_coeff, "aux_loss_coeff", hint=" (0: no loss)")
    if aux_type not in AUX_LOSS_TYPES:
        raise MoEConfigError(f"aux_loss_type={aux_type!r} is not one of {AUX_LOSS_TYPES}")
    if capacity_factor is not None:
        check_number(capacity_factor, "capacity_factor", positive=True, hint=" (None: dropless)")


def hoist_recompute_check(fn, module: nn.Module):
    """``fn`` (a ``torch.compile``-d forward of ``module``, e.g. a transformer block's) wrapped
    so that whether a call is an activation-checkpoint recomputation is read once, eagerly,
    before the call, and handed to ``module``'s MoE layers as a plain bool.

    A MoE layer records its balance statistics on a forward and not on its recomputation
    (``recomputing()``), which reads autograd's state: traced, that is a graph break in every
    MoE layer. Given the bool, the compiled graph guards on it instead (at most one graph
    for forwards and one for recomputations). The previous values are put back after the
    call, so wrapped regions nest; a MoE layer called outside the wrapper checks for itself.

    The bool is an attribute of the layers, not per thread: do not run the wrapped region on
    two threads at once (hp-pipeline's ``threaded_b_f`` would). A layer with an auxiliary loss
    should stay out of the compiled region (``torch.compiler.disable`` its forward, as
    hp-trainer's ``apply_compile`` does): the loss reads more of autograd's state.

    Example::

        block.forward = hoist_recompute_check(torch.compile(block.forward), block)
    """
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    if not moes:
        return fn

    def forward(*args, **kwargs):
        flag = recomputing()
        before = [m._recomputing for m in moes]
        for m in moes:
            m._recomputing = flag
        try:
            return fn(*args, **kwargs)
        finally:
            for m, b in zip(moes, before):
                m._recomputing = b

    return forward
