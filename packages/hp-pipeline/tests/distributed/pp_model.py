"""A tiny Llama-style model and its split into pipeline stages (plain modules, no parallelism)."""

import torch
import torch.nn.functional as F

from hp_testing.models import LlamaStage, TinyLlama

VOCAB, SEQ = 37, 8


def make_model(layers: int, seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(vocab=VOCAB, dim=16, layers=layers, heads=4, kv_heads=2, hidden=24, seq=SEQ)


Stage = LlamaStage


def split(full: TinyLlama, num_stages: int) -> list[Stage]:
    """One layer per stage (the model has ``num_stages`` layers)."""
    n = len(full.layers)
    assert n == num_stages
    return [Stage(full, s, s + 1, s == 0, s == num_stages - 1) for s in range(num_stages)]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batches(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (batch, SEQ), generator=g),
            torch.randint(0, VOCAB, (batch, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def reference(layers: int, data, lr: float):
    """Single-process losses, gradients (last step) and parameters after the steps."""
    model = make_model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
