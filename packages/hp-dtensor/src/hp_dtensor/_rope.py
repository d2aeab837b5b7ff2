"""A distributed rotary position embedding op (the torch binding of the ``rotary`` rule)."""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .errors import HPDTensorTypeError, ShardingError

__all__ = ["rotary_position_embedding"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    s, d = cos.shape[-2], cos.shape[-1]
    cos = cos.reshape(1, s, 1, d)
    sin = sin.reshape(1, s, 1, d)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _check_shapes(q, k, cos, sin) -> None:
    """q/k ``[batch, seq, heads, head_dim]``, cos/sin ``[seq, head_dim]`` (a seq of 1
    broadcasts), or raise naming the argument that does not fit."""
    for name, t in (("q", q), ("k", k)):
        if t.ndim != 4:
            raise ShardingError(
                f"rotary_position_embedding: {name} has shape {tuple(t.shape)}: give "
                "[batch, seq, heads, head_dim]"
            )
    if cos.shape != sin.shape or cos.ndim < 2:
        raise ShardingError(
            f"rotary_position_embedding: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must "
            "have one shape, [seq, head_dim]"
        )
    s, d = cos.shape[-2], cos.shape[-1]
    for name, t in (("q", q), ("k", k)):
        if t.shape[-1] != d or (s not in (t.shape[1], 1) and t.shape[1] != 1):
            raise ShardingError(
                f"rotary_position_embedding: {name} {tuple(t.shape)} does not fit cos/sin "
                f"{tuple(cos.shape)}: they must be [seq, head_dim] with {name}'s seq and head_dim "
                "([batch, seq, heads, head_dim])"
            )


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
    for name, t in zip(("q", "k", "cos", "sin"), args):
        if not isinstance(t, torch.Tensor):
            raise HPDTensorTypeError(
                f"rotary_position_embedding: {name} is a {type(t).__name__}: pass a torch.Tensor"
            )
    _check_shapes(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
