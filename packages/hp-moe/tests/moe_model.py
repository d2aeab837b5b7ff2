"""A tiny MoE transformer for the distributed tests, and the train-and-compare loop.

Every parallel run is compared with one process training the same model on the whole batch
(every data-parallel rank's batch, concatenated), with the same seed: outputs, losses and every
gradient at each step, parameters at the end.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
import hp_moe
from hp_dtensor import DTensor
from hp_moe import MoE

VOCAB, DIM, HEADS, HIDDEN, EXPERTS, TOP_K = 32, 16, 4, 8, 8, 2
B, S = 2, 6  # per data-parallel rank


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, **moe_kw) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention(DIM, HEADS)
        self.moe_norm = nn.RMSNorm(DIM)
        self.moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **moe_kw)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class TinyMoE(nn.Module):
    def __init__(self, n_layers: int = 2, **moe_kw) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(**moe_kw) for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


MOE_KW = dict(
    num_shared_experts=1,
    score_func="sigmoid",
    route_norm=True,
    route_scale=1.5,
    num_expert_groups=4,
    num_limited_groups=3,
    load_balance_coeff=1e-3,
    aux_loss_coeff=0.01,
    aux_loss_type="global",
)


def build(seed: int = 0, **moe_kw) -> TinyMoE:
    """The model, with routing made uneven on purpose: expert 2 gets no token and the experts
    ``6, 7`` (the last expert-parallel rank's at EP 4) none either, through the expert bias."""
    torch.manual_seed(seed)
    model = TinyMoE(**{**MOE_KW, **moe_kw})
    with torch.no_grad():
        for layer in model.layers:
            if layer.moe.expert_bias is not None:
                layer.moe.expert_bias.copy_(
                    torch.tensor([0.3, 0.0, -10.0, 0.1, 0.0, 0.2, -10.0, -10.0])
                )
    return model


def batch(step: int, n_ranks: int):
    """Tokens and targets of the whole batch of a step: ``n_ranks`` rank batches."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (n_ranks * B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def is_expert(name: str) -> bool:
    return ".experts.w" in name


def sync_grads(model: nn.Module, dp_group, ep: int, expert_dp_group=None) -> None:
    """Plain data parallelism by hand (the FSDP tests use fully_shard instead): dense gradients
    averaged over the ``dp_group`` ranks (all that see different tokens); expert gradients,
    already summed over the tokens of the ``ep`` expert-parallel ranks, summed over the replicas
    of the expert (``expert_dp_group``) and divided by the data-parallel size."""
    platform = hp.get_platform("cpu")
    n = platform.get_world_size(dp_group)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local(p.grad)
        if is_expert(name):
            if expert_dp_group is not None:
                platform.all_reduce(g, "sum", expert_dp_group)
            g.div_(n)
        elif n > 1:
            platform.all_reduce(g, "sum", dp_group)
            g.div_(n)


def train_and_compare(
    model,
    ref,
    *,
    dp_group,
    dp_rank: int,
    dp_size: int,
    steps: int = 5,
    after_backward=None,
    tol: float = 1e-5,
):
    """``steps`` AdamW steps of ``model`` (this rank's slice of each batch) against ``ref`` (the
    whole batch). ``after_backward(model)`` reduces gradients; ``dp_group`` is the load-balance
    group (the ranks that see different tokens). Returns the reference losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    hp_moe.register_expert_bias_update(opt, model, group=dp_group)
    hp_moe.register_expert_bias_update(ref_opt, ref)
    platform = hp.get_platform("cpu")
    ref_params = dict(ref.named_parameters())
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, dp_size)
        mine = slice(dp_rank * B, (dp_rank + 1) * B)
        ref_logits = ref(tokens)
        ref_loss = loss_fn(ref_logits, targets)
        ref_opt.zero_grad()
        ref_loss.backward()
        logits = model(tokens[mine])
        torch.testing.assert_close(
            full(logits), ref_logits[mine], rtol=tol, atol=tol, msg=f"logits step {step}"
        )
        loss = loss_fn(logits, targets[mine])
        opt.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        mean_loss = loss.detach().clone()
        if dp_size > 1:
            platform.all_reduce(mean_loss, "sum", dp_group)
        torch.testing.assert_close(mean_loss / dp_size, ref_loss.detach(), rtol=tol, atol=tol)
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{name} has no gradient at step {step}"
            torch.testing.assert_close(
                full(p.grad),
                ref_params[name].grad,
                rtol=tol,
                atol=tol,
                msg=f"grad {name} step {step}",
            )
        opt.step()
        ref_opt.step()
        for m, r in zip(moes(model), moes(ref)):
            torch.testing.assert_close(m.expert_bias, r.expert_bias, msg=f"bias step {step}")
        losses.append(float(ref_loss))
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.detach()), ref_params[name].detach(), rtol=tol, atol=tol, msg=f"param {name}"
        )
    return losses


def moes(model):
    return [m for m in model.modules() if isinstance(m, MoE)]
