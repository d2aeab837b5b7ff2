"""The Llama-style block of ``hp_testing.models.Block`` written for MindSpore: plain
single-device model code (RMSNorm, RoPE, grouped-query causal attention, SwiGLU), the same
parameter names and math, so weights move between the two through numpy."""

import math

import mindspore as ms
from mindspore import nn, ops


class RMSNorm(nn.Cell):
    """Root-mean-square normalisation with a learnt scale."""

    def __init__(self, dim):
        super().__init__()
        self.weight = ms.Parameter(ops.ones((dim,), ms.float32), name="weight")

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight


def rope(x, cos, sin):
    """Rotary position embedding (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + ops.cat((-x2, x1), -1) * sin


class Block(nn.Cell):
    """Pre-norm attention + SwiGLU block; ``construct(x, cos, sin)``."""

    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Dense(dim, heads * self.hd, has_bias=False)
        self.wk = nn.Dense(dim, kv_heads * self.hd, has_bias=False)
        self.wv = nn.Dense(dim, kv_heads * self.hd, has_bias=False)
        self.wo = nn.Dense(heads * self.hd, dim, has_bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Dense(dim, hidden, has_bias=False)
        self.w3 = nn.Dense(dim, hidden, has_bias=False)
        self.w2 = nn.Dense(hidden, dim, has_bias=True)

    def construct(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, -1, self.hd)  # -1: local heads under tensor parallelism
        k = self.wk(h).view(b, s, -1, self.hd)
        v = self.wv(h).view(b, s, -1, self.hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        group = q.shape[1] // k.shape[1]  # grouped-query attention
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.hd)
        causal = ops.triu(ops.ones((s, s), ms.bool_), diagonal=1)
        scores = scores.masked_fill(causal, float("-inf"))
        o = ops.matmul(ops.softmax(scores, -1), v)
        x = x + self.wo(o.swapaxes(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(ops.silu(self.w1(h)) * self.w3(h))
