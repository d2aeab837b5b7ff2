"""The dense decoder (Llama 3, Qwen3) in plain single-device PyTorch. Parallelism is applied from
outside (``parallelize_llama``); the code only avoids hard-coding head counts (``view(b, s, -1,
hd)``) so tensor parallelism can shard heads."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._config import TransformerConfig

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "rotary_tables",
]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learnt scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _inv_freq(cfg: TransformerConfig) -> torch.Tensor:
    hd = int(cfg.hd * cfg.partial_rotary_factor)  # Qwen3.5 rotates a quarter of each head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = cfg.rope_scaling
    if sc:  # Llama 3.1: long wavelengths slowed by `factor`, a smooth ramp in between
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotary_tables(cfg: TransformerConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[1, max_seq_len, 1, head_dim]`` (rotate-half layout), float32."""
    inv = _inv_freq(cfg).to(device)
    pos = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    ang = pos[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)[None, :, None, :]
    return ang.cos(), ang.sin()


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE (and Qwen3's per-head q/k norms)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        hd, b = cfg.hd, cfg.attention_bias
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=b)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=b)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=b)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=b)
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # -1: local heads under TP
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # the tables cover max_seq_len; the sequence here is whole even under sequence
        # parallelism (the input was gathered), and also in a later pipeline stage
        cos, sin = cos[:, :s].to(q.dtype), sin[:, :s].to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals. In Qwen3.5 the attention is either
    Gated DeltaNet (``linear_attention``) or gated full attention (``attention``), chosen by
    ``layer_types[layer]``, and the norms are zero-centred."""

    def __init__(self, cfg: TransformerConfig, layer: int = 0) -> None:
        super().__init__()
        if cfg.architecture == "qwen3_5":
            from ._qwen3_5 import GatedAttention, GatedDeltaNet, ZeroCenteredRMSNorm

            self.attention_norm = ZeroCenteredRMSNorm(cfg.dim, cfg.norm_eps)
            if cfg.layer_types[layer] == "linear_attention":
                self.linear_attention = GatedDeltaNet(cfg)
            else:
                self.attention = GatedAttention(cfg)
            self.ffn_norm = ZeroCenteredRMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.attention = Attention(cfg)
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        mixer = getattr(self, "attention", None) or self.linear_attention
        x = x + mixer(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks (``layers`` is a ``ModuleDict`` keyed "0", "1", ...
    so a pipeline stage can drop blocks and keep names), final norm, output projection (tied to
    the embedding when ``tie_word_embeddings``). ``forward(tokens) -> logits [b, s, vocab]``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        if cfg.architecture == "qwen3_5":
            from ._qwen3_5 import ZeroCenteredRMSNorm

            self.norm = ZeroCenteredRMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Share the embedding as the output projection when ``tie_word_embeddings`` (again
        after ``to_empty``, which gives each module its own new parameter)."""
        if self.config.tie_word_embeddings and None not in (self.output, self.tok_embeddings):
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device=None) -> None:
        """Normal(0, init_std) weights, zero biases, unit norms, and the rotary tables (call
        after ``to_empty`` when the model was built on the meta device)."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif hasattr(m, "reset_parameters") and not isinstance(m, (nn.Linear, nn.Embedding)):
                m.reset_parameters()  # norms, Gated DeltaNet's decay parameters and convolution
        self.init_buffers(buffer_device)

    @torch.no_grad()
    def init_buffers(self, device=None) -> None:
        """Recompute the rotary tables (non-persistent buffers) on ``device``."""
        device = device or self.rope_cos.device
        if device.type == "meta":
            return
        cos, sin = rotary_tables(self.config, device)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[b, s]`` -> logits ``[b, s, vocab]``. A pipeline stage without the
        embedding takes hidden states, one without the output returns them."""
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len="
                    f"{self.config.max_seq_len}: build the model with a larger max_seq_len"
                )
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write ``config.json`` and safetensors weights in HuggingFace format (see
        :func:`hp_trainer.models.save_pretrained`)."""
        from ._hf import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
