"""DeepSeek-V3's parts in plain single-device PyTorch: multi-head latent attention (MLA) with
its decoupled RoPE heads and YaRN scaling, and multi-token prediction (MTP) modules.

MLA compresses keys and values through a low-rank latent (``wkv_a`` -> ``kv_norm`` ->
``wkv_b``) and optionally the queries too (``wq_a`` -> ``q_norm`` -> ``wq_b``; ``wq`` without
``q_lora_rank``); each head is ``qk_nope_head_dim`` dimensions without position plus
``qk_rope_head_dim`` rotated ones, the rotated key shared by all heads. Head counts are read
from the tensors, so tensor parallelism can split ``wq``/``wq_b``/``wkv_b``/``wo`` by heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._config import TransformerConfig

__all__ = ["MLAttention", "MTPModule", "yarn_mscale"]

_LATENT_EPS = 1e-6  # the latent norms' epsilon (fixed in the reference implementation)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """Rotate ``x``'s last dim. ``interleaved``: its pairs are ``(x0, x1), (x2, x3), ...`` (the
    layout of DeepSeek's checkpoints), returned in rotate-half layout; the same permutation for
    queries and keys, so their products are unchanged."""
    if interleaved:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), causal, over ``(batch, seq, dim)``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        from ._transformer import RMSNorm

        d, h, b = cfg.dim, cfg.n_heads, cfg.attention_bias
        self.n_heads = h
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=b)
            self.q_norm = RMSNorm(cfg.q_lora_rank, _LATENT_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(d, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, cfg.kv_lora_rank + self.rope_dim, bias=b)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, _LATENT_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=b)
        self.interleaved = cfg.rope_interleave
        self.softmax_scale = qk**-0.5
        sc = cfg.rope_scaling
        if sc and sc.get("mscale_all_dim"):
            m = yarn_mscale(sc["factor"], sc["mscale_all_dim"])
            self.softmax_scale *= m * m

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope_dim)  # -1: local heads under TP
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = cos[:, :s].to(q.dtype), sin[:, :s].to(q.dtype)
        q_pe = _rope(q_pe, cos, sin, self.interleaved)
        k_pe = _rope(k_pe.view(b, s, 1, self.rope_dim), cos, sin, self.interleaved)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MTPModule(nn.Module):
    """One multi-token prediction depth (DeepSeek-V3 report, section 2.2): the previous depth's
    hidden states and the embeddings of the tokens one further ahead, each normalised,
    concatenated (embedding first) and projected back to ``dim``, then one transformer block;
    ``norm`` (applied by the caller) feeds the main model's output head and the next depth.
    ``forward(h, emb, cos, sin)`` on ``(batch, seq, dim)`` pairs already aligned."""

    def __init__(self, cfg: TransformerConfig, layer: int) -> None:
        super().__init__()
        from ._transformer import RMSNorm, TransformerBlock

        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg, layer)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h, emb, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x, cos, sin)
