"""A distributed rotary position embedding op (the torch binding of the ``rotary`` rule)."""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

__all__ = ["rotary_position_embedding"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    s, d = cos.shape[-2], cos.shape[-1]
    cos = cos.reshape(1, s, 1, d)
    sin = sin.reshape(1, s, 1, d)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_position_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (``[batch, seq, heads, head_dim]``) by ``cos``/``sin``
    (``[seq, head_dim]``, the rotate-half convention of Llama/HF).

    On DTensors the sharding rule keeps batch, head and sequence sharding local: with the
    sequence split, ``cos``/``sin`` are split the same way (no communication when they are
    replicated); a split head_dim is gathered first.
    """
    args = (q, k, cos, sin)
    if has_torch_function(args):
        return handle_torch_function(rotary_position_embedding, args, q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
