"""Token-choice top-k routing (softmax or sigmoid scores, optional group-limited choice)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import check_bool, check_number, check_positive_int, check_tensor
from .errors import MoEConfigError, MoETypeError

__all__ = ["TokenChoiceTopKRouter", "check_routing"]

SCORE_FUNCS = ("softmax", "sigmoid")


def check_routing(
    num_experts: int,
    top_k: int,
    score_func: str,
    num_expert_groups: int | None,
    num_limited_groups: int | None,
    route_scale: float = 1.0,
) -> None:
    """Raise ``MoEConfigError`` for a routing configuration that cannot work (pure, no
    tensors): every rank raises the same error before anything is built."""
    for name, v in (("num_experts", num_experts), ("top_k", top_k)):
        check_positive_int(v, name)
    if top_k > num_experts:
        raise MoEConfigError(
            f"top_k={top_k} is larger than num_experts={num_experts}: a token cannot choose more "
            f"experts than there are; lower top_k"
        )
    if score_func not in SCORE_FUNCS:
        raise MoEConfigError(
            f"score_func={score_func!r} is not one of {SCORE_FUNCS}: use 'softmax' (Qwen3-MoE, "
            f"Mixtral) or 'sigmoid' (DeepSeek-V3)"
        )
    check_number(route_scale, "route_scale", positive=True)
    if (num_expert_groups is None) != (num_limited_groups is None):
        raise MoEConfigError(
            f"num_expert_groups={num_expert_groups} and num_limited_groups={num_limited_groups}: "
            f"group-limited routing needs both (or neither)"
        )
    if num_expert_groups is None:
        return
    check_positive_int(num_expert_groups, "num_expert_groups")
    if num_experts % num_expert_groups:
        raise MoEConfigError(
            f"num_expert_groups={num_expert_groups} does not divide num_experts={num_experts}: "
            f"choose a divisor of the expert count"
        )
    if not isinstance(num_limited_groups, int) or not 0 < num_limited_groups <= num_expert_groups:
        raise MoEConfigError(
            f"num_limited_groups={num_limited_groups!r} must lie in [1, num_expert_groups="
            f"{num_expert_groups}]: a token can only keep groups that exist"
        )
    per_group = num_experts // num_expert_groups
    if top_k > num_limited_groups * per_group:
        raise MoEConfigError(
            f"top_k={top_k} exceeds the {num_limited_groups * per_group} experts of "
            f"num_limited_groups={num_limited_groups} groups of {per_group}: raise "
            f"num_limited_groups or lower top_k"
        )


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts from a linear gate's scores.

    Scores are computed in float32, or float64 for float64 inputs (``softmax`` or ``sigmoid``
    of ``gate(x)``). An expert bias
    (auxiliary-loss-free balancing) is added to the scores only to choose the experts; the gate
    values returned are the unbiased scores of the chosen experts, then normalised to sum to one
    per token when ``route_norm`` and multiplied by ``route_scale``. With
    ``num_expert_groups``, experts form equal groups, a group scores the sum of its two best
    (biased) scores, and a token chooses only among its ``num_limited_groups`` best groups
    (DeepSeek-V3's node-limited routing).

    Args:
        dim: model width.
        num_experts: ``E``.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        route_norm: normalise the chosen gate values per token.
        route_scale: multiply the gate values (DeepSeek-V3's ``routed_scaling_factor``).
        num_expert_groups, num_limited_groups: group-limited routing (both or neither).

    ``forward(x, expert_bias=None)`` takes ``(T, dim)`` and returns ``(top_scores (T, k) fp32,
    top_indices (T, k) int64, scores (T, E) fp32)``.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(dim, "dim", "TokenChoiceTopKRouter")
        check_routing(
            num_experts, top_k, score_func, num_expert_groups, num_limited_groups, route_scale
        )
        check_bool(route_norm, "route_norm", "TokenChoiceTopKRouter")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func = score_func
        self.route_norm, self.route_scale = bool(route_norm), float(route_scale)
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, dim)`` -> ``(T, E)`` scores in float32 (float64 for float64 ``x``)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        if self.score_func == "softmax":
            return torch.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        g = self.num_expert_groups
        grouped = choice.unflatten(-1, (g, self.num_experts // g))
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (T, g)
        keep = torch.topk(best, self.num_limited_groups, dim=-1, sorted=False).indices
        drop = torch.ones_like(best, dtype=torch.bool).scatter_(-1, keep, False)
        return grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(-2)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn = "TokenChoiceTopKRouter"
        check_tensor(x, "x", fn, ndim=2)
        if x.shape[-1] != self.gate.in_features:
            raise MoEConfigError(
                f"{fn}: x has shape {tuple(x.shape)}; the gate takes "
                f"(T, dim={self.gate.in_features})"
            )
        if expert_bias is not None:
            if not isinstance(expert_bias, torch.Tensor):
                raise MoETypeError(
                    f"{fn}: expert_bias is a {type(expert_bias).__name__}: give a tensor of "
                    f"shape ({self.num_experts},) or None"
                )
            if tuple(expert_bias.shape) != (self.num_experts,):  # (1,) would broadcast
                raise MoEConfigError(
                    f"{fn}: expert_bias has shape {tuple(expert_bias.shape)}: give one bias per "
                    f"expert, shape ({self.num_experts},)"
                )
        scores = self.scores(x)
        with torch.no_grad():
            choice = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                choice = self._limit_groups(choice)
            top_indices = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(-1, top_indices)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            top_scores = top_scores * self.route_scale
        return top_scores, top_indices, scores
