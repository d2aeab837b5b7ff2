"""The dense decoder (Llama 3, Qwen3) in plain single-device PyTorch. Parallelism is applied from
outside (``parallelize_llama``); the code only avoids hard-coding head counts (``view(b, s, -1,
hd)``) so tensor parallelism can shard heads."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_moe import FeedForward as SwiGLU
from hp_moe import MoE

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


def _yarn(cfg: TransformerConfig, sc: dict) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V2/V3): interpolated low frequencies, extrapolated high ones, a linear
    ramp between the dimensions that turn ``beta_slow`` and ``beta_fast`` times over the
    original context; and the attention temperature factor the tables are multiplied by."""
    from ._deepseek import yarn_mscale

    dim, base, factor = cfg.rope_dim, cfg.rope_theta, sc["factor"]
    old = sc["original_max_position_embeddings"]
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(correction_dim(fast)), math.ceil(correction_dim(slow))
    low, high = max(low, 0), min(high, dim - 1)
    if sc.get("truncate", True) is False:
        low, high = max(correction_dim(fast), 0), min(correction_dim(slow), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
    if sc.get("attention_factor") is not None:
        attention = float(sc["attention_factor"])
    elif m and m_all:
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    else:
        attention = yarn_mscale(factor)
    return inv, attention


def _inv_freq(cfg: TransformerConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotated dimensions, and the tables' scale (YaRN's)."""
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type") == "yarn":
        return _yarn(cfg, sc)
    hd = cfg.rope_dim  # Qwen3.5 rotates a quarter of each head, DeepSeek its decoupled part
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if sc:  # Llama 3.1: long wavelengths slowed by `factor`, a smooth ramp in between
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv, 1.0


def rotary_tables(cfg: TransformerConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[1, max_seq_len, 1, rope_dim]`` (rotate-half layout), float32."""
    inv, scale = _inv_freq(cfg)
    inv = inv.to(device)
    pos = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    ang = pos[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)[None, :, None, :]
    return ang.cos() * scale, ang.sin() * scale


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


class FeedForward(SwiGLU):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` of the configuration's width (hp_moe's ``FeedForward``,
    the same module the MoE layers' shared experts are)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg.dim, cfg.ffn_hidden, bias=cfg.mlp_bias)


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals. In Qwen3.5 the attention is either
    Gated DeltaNet (``linear_attention``) or gated full attention (``attention``), chosen by
    ``layer_types[layer]``, and the norms are zero-centred."""

    def __init__(self, cfg: TransformerConfig, layer: int = 0) -> None:
        super().__init__()
        if cfg.architecture == "deepseek_v3":
            from ._deepseek import MLAttention

            self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.attention = MLAttention(cfg)
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        elif cfg.architecture == "qwen3_5":
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
        if cfg.moe is not None and cfg.moe.is_moe(layer):
            self.moe = MoE(cfg.dim, **cfg.moe.layer_kwargs())
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        mixer = getattr(self, "attention", None) or self.linear_attention
        x = x + mixer(self.attention_norm(x), cos, sin)
        ffn = getattr(self, "moe", None) or self.feed_forward
        return x + ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks (``layers`` is a ``ModuleDict`` keyed "0", "1", ...
    so a pipeline stage can drop blocks and keep names), final norm, output projection (tied to
    the embedding when ``tie_word_embeddings``). ``forward(tokens) -> logits [b, s, vocab]``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        from ..errors import check_instance

        check_instance(cfg, TransformerConfig, "cfg", "Transformer", "use models.get_config(name)")
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
        self.mtp = None
        if cfg.mtp_layers:  # DeepSeek-V3's multi-token prediction, blocks after the main ones
            from ._deepseek import MTPModule

            self.mtp = nn.ModuleList(
                MTPModule(cfg, cfg.n_layers - 1) for _ in range(cfg.mtp_layers)
            )
            # the sum of a step's MTP losses (times their weight), for logging
            self.register_buffer("mtp_loss", torch.zeros(()), persistent=False)
        #: multiplies the MTP loss's gradient (1 / n when the main loss is divided over n
        #: microbatches), as hp_moe.set_aux_loss_scale does for the balance losses
        self.mtp_loss_scale = 1.0
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
        """Normal(0, init_std) weights, zero biases, unit norms, zero MoE expert biases and
        statistics, and the rotary tables (call after ``to_empty`` when the model was built on
        the meta device)."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, MoE):
                m.init_buffers()
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif hasattr(m, "reset_parameters") and not isinstance(m, (nn.Linear, nn.Embedding)):
                m.reset_parameters()  # norms, Gated DeltaNet's decay parameters and convolution
        self.init_buffers(buffer_device)

    @torch.no_grad()
    def init_buffers(self, device=None) -> None:
        """Recompute the rotary tables and zero the MTP loss sum (non-persistent float32
        buffers, whatever the parameters' dtype) on ``device``."""
        device = device or self.rope_cos.device
        if device.type == "meta":
            return
        cos, sin = rotary_tables(self.config, device)
        self.rope_cos, self.rope_sin = cos, sin
        if self.mtp is not None:
            self.mtp_loss = torch.zeros((), device=device)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[b, s]`` -> logits ``[b, s, vocab]``. A pipeline stage without the
        embedding takes hidden states, one without the output returns them.

        With ``targets`` (``[b, s]`` token ids, -100 ignored) it returns the mean
        cross-entropy loss instead, the output projection and the loss fused over token
        chunks (:func:`linear_cross_entropy`): the logits of the whole batch never exist.
        Not with multi-token prediction (its loss rides on the logits)."""
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
        if targets is not None:
            if self.output is None or self.mtp is not None:
                raise ValueError(
                    "Transformer.forward: targets (the fused loss) needs the output "
                    "projection and no multi-token prediction: call it without targets"
                )
            from ._loss import linear_cross_entropy

            return linear_cross_entropy(h, self.output.weight, targets)
        out = self.output(h) if self.output is not None else h
        if self.mtp is not None and self.training and torch.is_grad_enabled():
            out = self._attach_mtp(out, h, tokens)
        return out

    def _attach_mtp(self, logits, h, tokens):
        """DeepSeek-V3's MTP loss, ``weight / D * sum_k CE_k``: depth ``k`` combines the
        normalised hidden states of depth ``k - 1`` at position ``i`` (the main stack's after
        its final norm, as Megatron-Core, vLLM and SGLang feed DeepSeek's MTP module; then
        each module's after its own) with the embedding of token ``i + k`` and predicts token
        ``i + k + 1`` (positions whose target lies in this sequence). Its gradient is attached
        to the logits (as the MoE balance loss is to the layer output), so the training loop
        computes only the main loss."""
        from hp_moe import MoEAuxLossAutoScaler

        if self.tok_embeddings is None or self.output is None:
            raise ValueError(
                "multi-token prediction needs the embedding and the output head in one module "
                "(it is not split across pipeline stages)"
            )
        total = logits.new_zeros((), dtype=torch.float32)
        t = tokens.shape[1]
        for k, module in enumerate(self.mtp, start=1):
            if t - k < 2:
                break
            emb = self.tok_embeddings(tokens[:, k:])
            h = module.norm(module(h[:, : t - k], emb, self.rope_cos, self.rope_sin))
            pred = self.output(h[:, :-1])
            total = total + F.cross_entropy(
                pred.reshape(-1, pred.shape[-1]).float(), tokens[:, k + 1 :].reshape(-1)
            )
        coeff = self.config.mtp_loss_weight / len(self.mtp)
        with torch.no_grad():
            self.mtp_loss.add_(coeff * total.detach())
        return MoEAuxLossAutoScaler.apply(logits, total, coeff * self.mtp_loss_scale)

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write ``config.json`` and safetensors weights in HuggingFace format (see
        :func:`hp_trainer.models.save_pretrained`)."""
        from ._hf import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
