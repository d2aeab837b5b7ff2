"""Reference models for tests and benchmarks: plain single-device code.

``TinyLlama`` is a Llama-style decoder (RMSNorm, RoPE, grouped-query SDPA attention, SwiGLU) whose
default shapes are small and uneven on purpose; the benchmarks build the 1.3B anchor model from
it by passing the anchor's shapes.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learnt scale."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


def rope(x, cos, sin):
    """Rotary position embedding (rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    """Pre-norm attention + SwiGLU block; ``forward(x, cos, sin)``."""

    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, -1, self.hd)  # -1: local heads under tensor parallelism
        k = self.wk(h).view(b, s, -1, self.hd)
        v = self.wv(h).view(b, s, -1, self.hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    """Embedding, ``layers`` blocks, final norm and an untied output projection."""

    def __init__(self, vocab=37, dim=24, layers=2, heads=4, kv_heads=2, hidden=42, seq=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(seq).float(), inv)
        ang = torch.cat([ang, ang], -1)[None, :, None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.out(self.norm(x))


class LlamaStage(nn.Module):
    """Layers ``[lo, hi)`` of a :class:`TinyLlama` as one pipeline stage (copies, so the full
    model stays intact): the first stage embeds, the last normalises and projects to the
    vocabulary. ``names`` maps this stage's parameter names to the full model's."""

    def __init__(self, full: TinyLlama, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.tok = copy.deepcopy(full.tok) if first else None
        self.layers = nn.ModuleList(copy.deepcopy(full.layers[i]) for i in range(lo, hi))
        self.norm = copy.deepcopy(full.norm) if last else None
        self.out = copy.deepcopy(full.out) if last else None
        self.register_buffer("cos", full.cos.clone(), persistent=False)
        self.register_buffer("sin", full.sin.clone(), persistent=False)
        self.names = {}
        for n, _ in self.named_parameters():
            if n.startswith("layers."):
                i, rest = n.split(".", 2)[1:]
                self.names[n] = f"layers.{lo + int(i)}.{rest}"
            else:
                self.names[n] = n

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        if self.out is not None:
            x = self.out(self.norm(x))
        return x
