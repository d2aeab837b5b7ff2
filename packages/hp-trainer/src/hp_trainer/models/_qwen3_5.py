"""Qwen3.5 dense (text): a hybrid of Gated DeltaNet linear-attention blocks and gated
full-attention blocks (every fourth), in plain single-device PyTorch.

The Gated DeltaNet recurrence per head, with state ``S`` (key dim x value dim), decay
``a_t = exp(g_t)`` and write strength ``beta_t``::

    S_t = a_t * S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,     o_t = S_t^T q_t

is computed chunk by chunk (``chunk`` tokens at a time): inside a chunk the delta-rule updates are
collapsed with a unit-lower-triangular solve (the WY/UT form), so the work is matmuls plus one
short loop over chunks instead of a loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GatedAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "ShortConv",
    "ZeroCenteredRMSNorm",
    "chunk_gated_delta_rule",
    "gated_delta_rule_transition",
]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """At least float32: lower precisions are raised, float64 stays (for float64 oracles)."""
    return x.to(_f32_dtype(x))


def _f32_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype :func:`_f32` gives ``x``."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _f32_heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` -> a contiguous ``[b, h, s, d]`` of at least float32 (one copy)."""
    y = x.transpose(1, 2)
    # one copy_ that casts and lays out at once (``to`` would keep the strides, and a later
    # ``contiguous`` copy again)
    out = torch.empty_like(y, dtype=_f32_dtype(x), memory_format=torch.contiguous_format)
    return out.copy_(y)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is ``1 + weight`` (weight starts at zero), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(_f32(x), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + _f32(self.weight))).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``x`` times ``silu(gate)`` (the Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(_f32(x), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return (y * F.silu(_f32(gate))).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _chunked(q, k, v, g, beta, chunk: int):
    """The chunk-level pieces of the gated delta rule (see :func:`chunk_gated_delta_rule`):
    per chunk, the resolved values ``u`` and keys ``w``, the within-chunk scores, the decayed
    queries and keys and the chunk's total decay; ``q`` may be None (no outputs needed)."""
    b, s, h, dk = k.shape
    # [b, h, s, d] laid out as such (one copy, fused with the cast): the chunks' batched
    # matmuls then run on views; on the [b, s, h, d] layout each would copy its operands
    k, v = (_f32_heads_first(x) for x in (k, v))
    g, beta = _f32(g.transpose(1, 2)), _f32(beta.transpose(1, 2))  # [b, h, s]
    pad = -s % chunk  # padded positions: no decay, no write (the state passes unchanged)
    if pad:
        k, v = (F.pad(x, (0, 0, 0, pad)) for x in (k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // chunk
    k, v = (x.reshape(b, h, n, chunk, -1) for x in (k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gc = g.cumsum(-1)  # log decay from the chunk start to each position (inclusive)
    # decay from position j to i (i >= j) inside a chunk; zero above the diagonal
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(future, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + A) u = beta v and (I + A) w = beta k exp(gc), A strictly lower: the chunk's updates
    # resolved against each other
    a = (kb @ k.transpose(-1, -2)) * decay
    system = a.masked_fill(~torch.ones_like(future).tril(-1), 0.0)
    system = system + torch.eye(chunk, device=k.device, dtype=k.dtype)
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * gc.exp()[..., None], upper=False, unitriangular=True
    )
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]
    parts = {"u": u, "w": w, "k_dec": k_dec, "chunk_decay": chunk_decay, "n": n, "pad": pad}
    if q is not None:
        q = _f32_heads_first(q) * dk**-0.5
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
        q = q.reshape(b, h, n, chunk, -1)
        parts["attn"] = (q @ k.transpose(-1, -2)) * decay  # within-chunk scores, causal
        parts["q_dec"] = q * gc.exp()[..., None]
    return parts


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk: int = 64, initial_state=None):
    """The gated delta rule over a whole sequence, chunked.

    ``q``, ``k``: ``[b, s, h, dk]`` (already L2-normalised); ``v``: ``[b, s, h, dv]``; ``g``
    (log decay, <= 0) and ``beta``: ``[b, s, h]``; ``initial_state``: ``[b, h, dk, dv]`` (the
    state before the first token; zeros by default). Returns ``[b, s, h, dv]`` in ``v``'s
    dtype. Computed in float32 (float64 inputs stay float64).
    """
    parts = _chunked(q, k, v, g, beta, chunk)
    return delta_rule_outputs(parts, initial_state, k.shape[1], v.dtype)


def delta_rule_outputs(parts: dict, initial_state, seq: int, dtype) -> torch.Tensor:
    """The outputs ``[b, s, h, dv]`` from :func:`_chunked`'s pieces and an initial state
    (None: zeros)."""
    b, h, n, chunk, dv = parts["u"].shape
    dk = parts["w"].shape[-1]
    state = parts["u"].new_zeros(b, h, dk, dv) if initial_state is None else _f32(initial_state)
    # the chunks as one unbind each and the outputs as one stack: indexing chunk i in the loop
    # would give each index its own backward writing a whole zero-filled gradient (n of them,
    # summed), and assigning into a preallocated output copies; both grow with n squared
    u, w, q_dec, attn, k_dec, chunk_decay = (
        parts[name].unbind(2) for name in ("u", "w", "q_dec", "attn", "k_dec", "chunk_decay")
    )
    out = []
    for i in range(n):
        corrected = u[i] - w[i] @ state  # new values minus what the state predicts
        out.append(q_dec[i] @ state + attn[i] @ corrected)
        if i + 1 < n:  # the state after the last chunk is not an output
            state = state * chunk_decay[i] + k_dec[i].transpose(-1, -2) @ corrected
    out = torch.stack(out, 2).reshape(b, h, n * chunk, -1)[:, :, :seq]
    return out.transpose(1, 2).to(dtype)


def gated_delta_rule_transition(k, v, g, beta, *, chunk: int = 64):
    """The state map of a stretch of tokens: the rule is affine in its state, so the state
    after them is ``M @ S + N`` for the state ``S`` before them. Returns ``(M, N)``,
    ``[b, h, dk, dk]`` and ``[b, h, dk, dv]`` (float32; float64 for float64 inputs); shapes
    as in :func:`chunk_gated_delta_rule`. Context parallelism composes these over the ranks'
    stretches to give each rank its true initial state."""
    return delta_rule_transition(_chunked(None, k, v, g, beta, chunk))


def delta_rule_transition(parts: dict):
    """``(M, N)`` of :func:`gated_delta_rule_transition` from :func:`_chunked`'s pieces."""
    b, h, n, _, dv = parts["u"].shape
    dk = parts["w"].shape[-1]
    eye = torch.eye(dk, device=parts["u"].device, dtype=parts["u"].dtype)
    m = eye.expand(b, h, dk, dk)
    nn_ = parts["u"].new_zeros(b, h, dk, dv)
    # one unbind per piece, not an index per chunk (see delta_rule_outputs)
    names = ("u", "w", "k_dec", "chunk_decay")
    u, w, k_dec, chunk_decay = (parts[name].unbind(2) for name in names)
    for i in range(n):
        # one chunk: S' = (decay I - k_dec^T w) S + k_dec^T u
        kt = k_dec[i].transpose(-1, -2)
        step = chunk_decay[i] * eye - kt @ w[i]
        m, nn_ = step @ m, step @ nn_ + kt @ u[i]
    return m, nn_


class ShortConv(nn.Module):
    """Causal depthwise convolution over the channels of ``[b, s, c]``, then SiLU. The channel
    count is read from the weight, so the module runs unchanged on a slice of the channels."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for a depthwise convolution (fan-in = kernel size)
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, k = x.shape[1], self.weight.shape[-1]
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=k - 1, groups=self.weight.shape[0])
        return F.silu(y[..., :s]).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule: q/k/v projections, each through a short
    causal depthwise convolution (SiLU), per-head decay ``-exp(A_log) * softplus(a + dt_bias)``
    and write strength ``sigmoid(b)``, grouped value heads, a gated RMSNorm and the output
    projection.

    Every parameter is either per head (rows of the input projections, channels of the
    convolutions, ``A_log``, ``dt_bias``, columns of ``out_proj``) or shared by all heads (the
    norm), and the forward reads head counts from the tensors, so tensor parallelism splits the
    heads without changing this code. HuggingFace stores q/k/v (and their convolutions) fused
    in one ``in_proj_qkv`` / ``conv1d``; :mod:`~hp_trainer.models._hf` splits and joins them.
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.in_proj_q = nn.Linear(cfg.dim, key_dim, bias=False)
        self.in_proj_k = nn.Linear(cfg.dim, key_dim, bias=False)
        self.in_proj_v = nn.Linear(cfg.dim, value_dim, bias=False)
        self.conv_q = ShortConv(key_dim, cfg.linear_conv_kernel)
        self.conv_k = ShortConv(key_dim, cfg.linear_conv_kernel)
        self.conv_v = ShortConv(value_dim, cfg.linear_conv_kernel)
        self.in_proj_z = nn.Linear(cfg.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.dim, self.nv, bias=False)
        self.in_proj_a = nn.Linear(cfg.dim, self.nv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nv).uniform_(1, 16)))
        self.norm = GatedRMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.dim, bias=False)
        self.chunk = 64

    #: the recurrence's implementation, ``(q, k, v, g, beta, *, chunk) -> o`` (context
    #: parallelism installs one that passes the state between ranks)
    delta_rule = staticmethod(chunk_gated_delta_rule)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Decay parameters as in the reference initialisation (the convolutions reset
        themselves)."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(1, 16)))

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        bsz, s, _ = x.shape
        q = self.conv_q(self.in_proj_q(x)).reshape(bsz, s, -1, self.dk)
        k = self.conv_k(self.in_proj_k(x)).reshape(bsz, s, -1, self.dk)
        v = self.conv_v(self.in_proj_v(x)).reshape(bsz, s, -1, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -_f32(self.A_log).exp() * F.softplus(_f32(self.in_proj_a(x)) + self.dt_bias)
        rep = v.shape[2] // q.shape[2]  # value heads per key head
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        # L2 normalisation as the reference kernels define it: eps inside the square root
        q = _f32(q) * torch.rsqrt(_f32(q).pow(2).sum(-1, keepdim=True) + 1e-6)
        k = _f32(k) * torch.rsqrt(_f32(k).pow(2).sum(-1, keepdim=True) + 1e-6)
        o = self.delta_rule(q, k, v, g, beta, chunk=self.chunk)
        z = self.in_proj_z(x).reshape(bsz, s, -1, self.dv)
        o = self.norm(o, z).reshape(bsz, s, -1)
        return self.out_proj(o)


def _partial_rope(x, cos, sin):
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat([x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass], dim=-1)


class GatedAttention(nn.Module):
    """Full causal attention with an output gate: ``wq`` produces each head's query and gate,
    the attention output is multiplied by ``sigmoid(gate)``; zero-centred q/k norms; RoPE on
    the first ``rotary_dim`` dims of each head."""

    def __init__(self, cfg) -> None:
        super().__init__()
        hd = self.head_dim = cfg.hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd * 2, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, cfg.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.wq(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, s, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim))
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = cos[:, :s].to(q.dtype), sin[:, :s].to(q.dtype)
        q, k = _partial_rope(q, cos, sin), _partial_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate)
        return self.wo(o)
