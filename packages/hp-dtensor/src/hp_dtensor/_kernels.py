"""Local kernels that sharding rules name when running the op itself on local pieces is not
enough (the torch binding). Each takes ``(func, local_args, local_kwargs, input_specs,
output_spec)`` and returns the local output."""

from __future__ import annotations

import torch.nn.functional as F

from ._backend import get_platform
from ._placement import Partial

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


def _loss_mean(func, args, kwargs, specs, out_spec):
    """cross_entropy / nll_loss, reduction="mean", sharded over samples: local sum divided by
    the global weight of the valid targets (what the single-device mean divides by)."""
    names = (
        "input",
        "target",
        "weight",
        "size_average",
        "ignore_index",
        "reduce",
        "reduction",
        "label_smoothing",
    )
    vals = dict(zip(names, args))
    vals.update(kwargs)
    vals["reduction"] = "sum"
    target = vals["target"]
    weight = vals.get("weight")
    ignore = vals.get("ignore_index", -100)
    valid = target != ignore
    if weight is None:
        den = valid.sum().to(vals["input"].dtype)
    else:
        den = (weight[target.masked_fill(~valid, 0)] * valid).sum().to(vals["input"].dtype)
    den = den.detach().clone().reshape(1)
    mesh = out_spec.mesh
    platform = get_platform(mesh.device_type)
    for d, p in enumerate(out_spec.placements):
        if type(p) is Partial and mesh.shape[d] > 1:
            platform.all_reduce(den, "sum", mesh._groups[d])
    total = func(**vals)
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


_KERNELS = {"embedding_vocab": _embedding_vocab, "loss_mean": _loss_mean, "reshape": _reshape}


def get(name: str):
    """The kernel registered as ``name``."""
    return _KERNELS[name]
