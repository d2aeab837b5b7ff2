"""Local kernels that sharding rules name when running the op itself on local pieces is not
enough (the torch binding). Each takes ``(func, local_args, local_kwargs, input_specs,
output_spec)`` and returns the local output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import get_platform
from ._placement import Partial, Shard

__all__ = ["get"]


def _embedding_vocab(func, args, kwargs, specs, out_spec):
    """Embedding with a row-sharded (vocab-parallel) weight: ids outside this rank's rows give
    zeros; the Partial(sum) output adds up to the full lookup."""
    names = (
        "input",
        "weight",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    )
    vals = dict(zip(names, args))
    vals.update(kwargs)
    idx, w = vals.pop("input"), vals.pop("weight")
    rows = w.shape[0]
    start = specs[1].local_shape_and_offset()[1][0]
    outside = (idx < start) | (idx >= start + rows)
    pad = vals.pop("padding_idx", None)
    if pad is not None:
        pad = pad % specs[1].shape[0]
        pad = pad - start if start <= pad < start + rows else None
    vals.pop("max_norm", None)
    vals.pop("norm_type", None)
    if rows == 0:
        return w.new_zeros(tuple(idx.shape) + (w.shape[1],)) + w.sum() * 0
    local_idx = (idx - start).masked_fill(outside, 0)
    out = F.embedding(local_idx, w, pad, None, 2.0, **vals)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def _groups_of(spec, pred):
    mesh = spec.mesh
    return [mesh._groups[d] for d, p in enumerate(spec.placements) if pred(p) and mesh.shape[d] > 1]


class _SumAcross(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward: the sum is consumed by replicated work."""

    @staticmethod
    def forward(ctx, x, platform, groups):
        out = x.clone()
        for g in groups:
            platform.all_reduce(out, "sum", g)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ShardedLogSoftmax(torch.autograd.Function):
    """log_softmax over a class dim split across ``groups``."""

    @staticmethod
    def forward(ctx, x, dim, platform, groups):
        xf = x.float()
        if xf.shape[dim]:
            m = xf.detach().amax(dim, keepdim=True)
        else:  # this rank holds no classes
            shape = list(xf.shape)
            shape[dim] = 1
            m = xf.new_full(shape, float("-inf"))
        for g in groups:
            platform.all_reduce(m, "max", g)
        s = (xf - m).exp().sum(dim, keepdim=True)
        for g in groups:
            platform.all_reduce(s, "sum", g)
        out = xf - (m + s.log())
        ctx.save_for_backward(out)
        ctx.dim, ctx.platform, ctx.groups = dim, platform, groups
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        gf = g.float()
        total = gf.sum(ctx.dim, keepdim=True)
        for grp in ctx.groups:
            ctx.platform.all_reduce(total, "sum", grp)
        return (gf - out.exp() * total).to(g.dtype), None, None, None


def _log_softmax_sharded(func, args, kwargs, specs, out_spec):
    """log_softmax whose dim is split over mesh dims: log-sum-exp across the shards."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dim = dim % x.ndim
    dtype = kwargs.get("dtype")
    for a in args[2:]:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is not None:
        x = x.to(dtype)
    groups = _groups_of(specs[0], lambda p: isinstance(p, Shard) and p.dim == dim)
    return _ShardedLogSoftmax.apply(x, dim, get_platform(specs[0].mesh.device_type), groups)


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-sample cross-entropy (with label smoothing and class weights) over class-sharded
    logits. Returns zeros at ignored targets."""

    @staticmethod
    def forward(ctx, x, target, weight, ignore, eps, n_classes, offset, platform, groups):
        xf = x.float()
        c_local = xf.shape[1]
        m = (
            xf.detach().amax(1, keepdim=True)
            if c_local
            else xf.new_full((xf.shape[0], 1) + tuple(xf.shape[2:]), float("-inf"))
        )
        for g in groups:
            platform.all_reduce(m, "max", g)
        s = (xf - m).exp().sum(1, keepdim=True)
        for g in groups:
            platform.all_reduce(s, "sum", g)
        lse = (m + s.log()).squeeze(1)
        valid = target != ignore
        t = target.masked_fill(~valid, 0)
        local_t = t - offset
        inside = (local_t >= 0) & (local_t < c_local)
        idx = local_t.clamp(0, max(c_local - 1, 0)).unsqueeze(1)
        picked = (
            torch.where(inside, xf.gather(1, idx).squeeze(1), 0.0)
            if c_local
            else torch.zeros_like(lse)
        )
        for g in groups:
            platform.all_reduce(picked, "sum", g)
        w_t = weight.float()[t] if weight is not None else torch.ones_like(lse)
        loss = (1 - eps) * w_t * (lse - picked)
        wl = None
        if eps:
            wl = weight.float()[offset : offset + c_local] if weight is not None else None
            shape = [1, c_local] + [1] * (xf.ndim - 2)
            wx = (xf * wl.view(shape)).sum(1) if wl is not None else xf.sum(1)
            for g in groups:
                platform.all_reduce(wx, "sum", g)
            w_total = weight.float().sum() if weight is not None else float(n_classes)
            loss = loss + (eps / n_classes) * (lse * w_total - wx)
        loss = loss * valid
        ctx.save_for_backward(xf, lse, local_t, inside, valid, w_t)
        ctx.eps, ctx.n, ctx.wl, ctx.c_local = eps, n_classes, wl, c_local
        ctx.w_total = weight.float().sum() if weight is not None else float(n_classes)
        ctx.in_dtype = x.dtype
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xf, lse, local_t, inside, valid, w_t = ctx.saved_tensors
        eps, n = ctx.eps, ctx.n
        gi = g.float() * valid
        p = (xf - lse.unsqueeze(1)).exp()
        coef = (1 - eps) * w_t + (eps / n) * ctx.w_total
        grad = p * (gi * coef).unsqueeze(1)
        if ctx.c_local:
            onehot = torch.zeros_like(xf)
            idx = local_t.clamp(0, ctx.c_local - 1).unsqueeze(1)
            onehot.scatter_(1, idx, (inside * (1 - eps) * w_t).unsqueeze(1))
            grad = grad - onehot * gi.unsqueeze(1)
            if eps:
                shape = [1, ctx.c_local] + [1] * (xf.ndim - 2)
                wl = ctx.wl.view(shape) if ctx.wl is not None else 1.0
                grad = grad - (eps / n) * wl * gi.unsqueeze(1)
        return grad.to(ctx.in_dtype), None, None, None, None, None, None, None, None


_LOSS_NAMES = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)


def _class_loss(func, args, kwargs, specs, out_spec):
    """cross_entropy / nll_loss with sharded samples and/or classes (see ``loss_rule``)."""
    vals = dict(zip(_LOSS_NAMES, args))
    vals.update(kwargs)
    x, target = vals["input"], vals["target"]
    weight = vals.get("weight")
    ignore = vals.get("ignore_index", -100)
    reduction = vals.get("reduction", "mean")
    eps = float(vals.get("label_smoothing", 0.0) or 0.0)
    xspec = specs[0]
    platform = get_platform(xspec.mesh.device_type)
    vocab = _groups_of(xspec, lambda p: isinstance(p, Shard) and p.dim == 1)
    offset = xspec.local_shape_and_offset()[1][1]
    n_classes = xspec.shape[1]
    if getattr(func, "__name__", "") == "nll_loss":
        valid = target != ignore
        t = target.masked_fill(~valid, 0)
        local_t = t - offset
        c_local = x.shape[1]
        inside = (local_t >= 0) & (local_t < c_local)
        idx = local_t.clamp(0, max(c_local - 1, 0)).unsqueeze(1)
        if c_local:
            picked = torch.where(inside, x.gather(1, idx).squeeze(1), 0.0)
        else:  # this rank holds no classes; keep the graph connected to x
            picked = x.sum(1) * 0.0
        picked = _SumAcross.apply(picked, platform, vocab) if vocab else picked
        w_t = weight[t] if weight is not None else torch.ones_like(picked)
        per = -(w_t * picked) * valid
    else:
        per = _ShardedCrossEntropy.apply(
            x, target, weight, ignore, eps, n_classes, offset, platform, vocab
        )
    if reduction == "none":
        return per
    total = per.sum()
    if reduction == "sum":
        return total
    valid = target != ignore
    if weight is None:
        den = valid.sum().to(total.dtype)
    else:
        den = (weight[target.masked_fill(~valid, 0)] * valid).sum().to(total.dtype)
    den = den.detach().clone().reshape(1)
    for g in _groups_of(out_spec, lambda p: type(p) is Partial):
        platform.all_reduce(den, "sum", g)
    return total / den[0]


def _reshape(func, args, kwargs, specs, out_spec):
    """view / reshape / expand / flatten / unflatten and friends: shapes given to the op are
    global, so the local op is asked for this rank's piece of the output shape instead."""
    shape = out_spec.local_shape_and_offset()[0]
    x = args[0]
    name = getattr(func, "__name__", "")
    if name.startswith("expand"):
        return x.expand(shape)
    if name.startswith("view"):
        return x.view(shape)
    return x.reshape(shape)


_KERNELS = {
    "embedding_vocab": _embedding_vocab,
    "class_loss": _class_loss,
    "log_softmax_sharded": _log_softmax_sharded,
    "reshape": _reshape,
}


def get(name: str):
    """The kernel registered as ``name``."""
    return _KERNELS[name]
