"""The output projection and the cross-entropy loss in one pass over token chunks, without the
``[tokens, vocabulary]`` logits of the whole batch (the Liger-kernel idea, in plain torch).

For each chunk of tokens the logits are computed, the loss and the gradient of the logits
(``softmax - one_hot``) taken at once in float32, and the gradients of the hidden states and
of the weight accumulated; only those two are kept for backward. With a 129K vocabulary and 8K
tokens a step, the float32 logits alone are 4.2 GB and the unfused loss makes several passes
over them; here one chunk of logits lives at a time, and on CUDA the chunk's softmax, loss and
gradient are one compiled kernel. The result equals ``F.cross_entropy(h @ weight.T, target)``
(mean over the tokens that are not ``ignore_index``), up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy"]


def _loss_and_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """(sum of the chunk's losses, gradient of that sum w.r.t. ``logits`` in its dtype)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)[:, None]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = x.gather(1, safe)
    loss = torch.where(valid[:, None], lse - picked, 0.0).sum()
    grad = torch.exp(x - lse)  # softmax, then minus one at each target
    grad.scatter_add_(1, safe, -torch.ones_like(picked))
    grad.masked_fill_(~valid[:, None], 0.0)
    return loss, grad.to(logits.dtype)


def _loss_only(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction="sum")


_compiled: dict = {}


def _chunk_fn(device_type: str):
    """The chunk's loss and gradient: compiled on CUDA (one graph per shape; the last chunk
    is padded to the chunk size, so a run makes one), eager elsewhere."""
    if device_type != "cuda":
        return _loss_and_grad
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(_loss_and_grad, dynamic=False)
    return _compiled["fn"]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, chunk: int, ignore_index: int, dtype):
        ctx.weight_dtype = weight.dtype  # its gradient goes back in its own dtype
        if dtype is not None and weight.dtype != dtype:
            weight = weight.to(dtype)
        fn = _chunk_fn(h.device.type)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (target != ignore_index).sum()  # 0: a NaN loss, as F.cross_entropy gives
        dh = torch.empty_like(h) if need_h else None
        acc = torch.promote_types(h.dtype, torch.float32)  # sums in float32 at least
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, tc = h[s : s + chunk], target[s : s + chunk]
            logits = hc @ weight.t()
            short = chunk - hc.shape[0]
            if short and fn is not _loss_and_grad:  # one compiled shape: pad with ignored rows
                logits = F.pad(logits, (0, 0, 0, short))
                tc = F.pad(tc, (0, short), value=ignore_index)
            loss, g = fn(logits, tc, ignore_index)
            g = g[: hc.shape[0]]
            total += loss
            if need_h:
                torch.mm(g, weight, out=dh[s : s + chunk])
            if need_w:  # the chunks' products summed in float32 (at least)
                if dw.dtype == g.dtype:
                    dw.addmm_(g.t(), hc)
                else:
                    dw += (g.t() @ hc).to(acc)
        scale = 1.0 / count.to(acc)
        ctx.save_for_backward(dh, dw, scale)
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dh, dw, scale = ctx.saved_tensors
        f = grad * scale
        gh = (dh * f.to(dh.dtype)) if dh is not None else None
        gw = (dw * f).to(ctx.weight_dtype) if dw is not None else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, target)`` (the mean over non-ignored tokens), computed
    ``chunk_size`` tokens at a time so the logits of the whole batch never exist. ``h``:
    ``[..., dim]`` hidden states; ``weight``: ``[vocab, dim]``; ``target``: ``h``'s leading
    shape. Differentiable in ``h`` and ``weight``. Under autocast both are cast to its dtype
    first, as ``F.linear`` would be."""
    from ..errors import check_instance

    check_instance(h, torch.Tensor, "h", "linear_cross_entropy", "give the hidden states")
    check_instance(weight, torch.Tensor, "weight", "linear_cross_entropy", "give [vocab, dim]")
    check_instance(target, torch.Tensor, "target", "linear_cross_entropy", "give token ids")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size!r} must be an int >= 1")
    if weight.ndim != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: h is {tuple(h.shape)} and weight {tuple(weight.shape)}: "
            "weight must be [vocab, dim] with dim = h.shape[-1]"
        )
    if tuple(target.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: target is {tuple(target.shape)}; h's tokens are "
            f"{tuple(h.shape[:-1])}: give one target per token"
        )
    target = target.long()
    dev = h.device.type
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        return _loss_without_grad(h, weight, target, chunk_size, ignore_index)
    # under autocast h is cast here and the weight inside, so the weight's gradient (summed
    # in float32) reaches an fp32 master weight without a round trip through bf16
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    h = h.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(
            h.reshape(-1, h.shape[-1]), weight, target.reshape(-1), chunk_size, ignore_index, dtype
        )


def _loss_without_grad(h, weight, target, chunk, ignore_index):
    """The loss alone, chunk by chunk (evaluation: no gradient buffers)."""
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    h, weight = h.to(dtype), weight.to(dtype)
    h, target = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    with torch.autocast(dev, enabled=False):
        for s in range(0, h.shape[0], chunk):
            total += _loss_only(h[s : s + chunk] @ weight.t(), target[s : s + chunk], ignore_index)
    return total / (target != ignore_index).sum()
