"""Helpers shared by hp-moe's tests: weight mapping from transformers' MoE blocks, references."""

from __future__ import annotations

import torch

from hp_moe import MoE


def load_from_hf(moe: MoE, hf, *, bias_name: str | None = None) -> None:
    """Copy a transformers MoE block's weights into ``moe`` (fused ``gate_up_proj`` [E, 2I, H],
    gate rows first; ``down_proj`` [E, H, I]; shared experts gate/up/down)."""
    inter = hf.experts.down_proj.shape[-1]
    with torch.no_grad():
        moe.experts.w1.copy_(hf.experts.gate_up_proj[:, :inter])
        moe.experts.w3.copy_(hf.experts.gate_up_proj[:, inter:])
        moe.experts.w2.copy_(hf.experts.down_proj)
        moe.router.gate.weight.copy_(hf.gate.weight)
        shared = getattr(hf, "shared_experts", None)
        if shared is not None:
            moe.shared_experts.w1.weight.copy_(shared.gate_proj.weight)
            moe.shared_experts.w3.weight.copy_(shared.up_proj.weight)
            moe.shared_experts.w2.weight.copy_(shared.down_proj.weight)
        if bias_name is not None:
            moe.expert_bias.copy_(getattr(hf.gate, bias_name))


def hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' gradients under our parameter names."""
    inter = hf.experts.down_proj.shape[-1]
    g = hf.experts.gate_up_proj.grad
    out = {
        "experts.w1": g[:, :inter],
        "experts.w3": g[:, inter:],
        "experts.w2": hf.experts.down_proj.grad,
        "router.gate.weight": hf.gate.weight.grad,
    }
    shared = getattr(hf, "shared_experts", None)
    if shared is not None:
        out["shared_experts.w1.weight"] = shared.gate_proj.weight.grad
        out["shared_experts.w3.weight"] = shared.up_proj.weight.grad
        out["shared_experts.w2.weight"] = shared.down_proj.weight.grad
    return out


def loop_experts(x, counts, w1, w2, w3):
    """Per-expert SwiGLU over rows grouped by expert (the reference for GroupedExperts)."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        out.append((torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat(out) if out else x[:0]


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE computed token by token from its definition (no permutation, no dispatch)."""
    b, s, d = x.shape
    flat = x.reshape(-1, d)
    top_scores, top_idx, _ = moe.router(flat, moe.expert_bias)
    w1, w2, w3 = (getattr(moe.experts, n) for n in ("w1", "w2", "w3"))
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(d, dtype=flat.dtype)
        for j in range(top_idx.shape[1]):
            e = int(top_idx[t, j])
            h = torch.nn.functional.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])
            acc = acc + top_scores[t, j] * (w2[e] @ h)
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view(b, s, d)
