"""A Llama-style block (RMSNorm, attention with RoPE and grouped-query heads, SwiGLU MLP) in
plain single-device PyTorch, with the plans that parallelize it. Used by the tests (imported in
the ranks) and by benchmarks/tp/block.py."""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_dtensor import rotary_position_embedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def attention_core(q, k, v, cos, sin):
    """RoPE then causal grouped-query attention; q/k/v ``[b, s, heads, head_dim]``."""
    q, k = rotary_position_embedding(q, k, cos, sin)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.core = attention_core

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.core(q, k, v, cos, sin)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, hidden=48) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def tp_library(kind: str):
    """``(styles, parallelize_module)`` of one TP library: ``"ours"`` (hp_dtensor.parallel) or
    ``"torch"`` (torch.distributed.tensor.parallel); ``styles`` is what :func:`tp_plan` takes."""
    if kind == "ours":
        import hp_dtensor.parallel as hpp
        from hp_dtensor import Replicate, Shard

        return types.SimpleNamespace(
            **{n: getattr(hpp, n) for n in hpp.__all__}, Shard=Shard, Replicate=Replicate
        ), hpp.parallelize_module
    import torch.distributed.tensor.parallel as tp
    from torch.distributed import tensor as tdt

    return types.SimpleNamespace(
        ColwiseParallel=tp.ColwiseParallel,
        RowwiseParallel=tp.RowwiseParallel,
        SequenceParallel=tp.SequenceParallel,
        PrepareModuleInput=tp.PrepareModuleInput,
        Shard=tdt.Shard,
        Replicate=tdt.Replicate,
    ), tp.parallelize_module


def tp_plan(styles, *, sequence_parallel: bool, row_kwargs=None):
    """The torchtitan plan for one block; ``styles`` is ``hp_dtensor.parallel`` or
    ``torch.distributed.tensor.parallel`` (same names), ``Shard``/``Replicate`` from it too.
    ``row_kwargs`` go to the sequence-parallel row-wise styles (``collective_matmul``)."""
    col, row = styles.ColwiseParallel, styles.RowwiseParallel
    plan = {
        "attention.wq": col(),
        "attention.wk": col(),
        "attention.wv": col(),
        "feed_forward.w1": col(),
        "feed_forward.w3": col(),
    }
    if not sequence_parallel:
        plan["attention.wo"] = row()
        plan["feed_forward.w2"] = row()
        return plan
    shard1, rep = styles.Shard(1), styles.Replicate()
    plan.update(
        {
            "attention_norm": styles.SequenceParallel(),
            "attention": styles.PrepareModuleInput(
                input_layouts=(shard1, None, None), desired_input_layouts=(rep, None, None)
            ),
            "attention.wo": row(output_layouts=shard1, **(row_kwargs or {})),
            "ffn_norm": styles.SequenceParallel(),
            "feed_forward": styles.PrepareModuleInput(
                input_layouts=(shard1,), desired_input_layouts=(rep,)
            ),
            "feed_forward.w2": row(output_layouts=shard1, **(row_kwargs or {})),
        }
    )
    return plan
