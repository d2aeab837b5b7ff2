"""``clip_grad_norm_`` over parameters with mixed DTensor placements."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

import hp_dtensor as hp
from hp_dtensor import DTensor, Partial, Shard

from ._checks import check_bool, check_number
from .errors import OptimError, OptimTypeError

__all__ = ["clip_grad_norm_", "OptimError", "OptimTypeError"]


def _local_power_sum(locals_: list[torch.Tensor], p: float) -> torch.Tensor:
    if not locals_:
        return torch.zeros(())
    if math.isinf(p):
        return (
            torch.stack([t.detach().abs().max() if t.numel() else t.new_zeros(()) for t in locals_])
            .max()
            .float()
        )
    norms = torch._foreach_norm([t.detach() for t in locals_], p)
    return torch.stack([n.float() ** p for n in norms]).sum()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    foreach: bool | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    The norm is exact across placements: each DTensor gradient contributes the sum of its local
    elements' ``|g|^p``, reduced over the mesh dimensions that shard it (replicated dimensions
    hold copies and are counted once); plain tensors count as they are on every rank. Gradients
    are grouped by (mesh, placements) and each group is reduced once per sharded mesh
    dimension, in a fixed order. ``norm_type=inf`` reduces with max. Returns the total norm (a
    plain tensor, equal on every rank).
    """
    fn = "clip_grad_norm_"
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise OptimTypeError(
            f"max_norm={max_norm!r} is a {type(max_norm).__name__}: give a positive number"
        )
    if not max_norm > 0:
        raise OptimError(f"max_norm={max_norm!r}: give a positive number")
    check_number(norm_type, "norm_type", fn, inf_ok=True)
    if not norm_type > 0:
        raise OptimError(f"{fn}: norm_type={norm_type!r}: give a positive order (2.0, 1.0, inf)")
    check_bool(foreach, "foreach", fn, none_ok=True)
    check_bool(error_if_nonfinite, "error_if_nonfinite", fn)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif isinstance(parameters, torch.nn.Module):
        raise OptimTypeError(
            f"{fn}: parameters is a {type(parameters).__name__} module: pass model.parameters()"
        )
    elif isinstance(parameters, (str, bytes, dict)) or not hasattr(parameters, "__iter__"):
        raise OptimTypeError(
            f"{fn}: parameters is a {type(parameters).__name__}: pass an iterable of tensors "
            "(model.parameters())"
        )
    parameters = list(parameters)
    for i, q in enumerate(parameters):
        if not isinstance(q, torch.Tensor):
            raise OptimTypeError(
                f"{fn}: parameters[{i}] is a {type(q).__name__}, not a tensor: pass "
                "model.parameters() (or a list of tensors)"
            )
    p = float(norm_type)
    grads = [q.grad for q in parameters if q.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    groups: dict = {}
    for g in grads:
        if isinstance(g, DTensor):
            key = (g.device_mesh, g.placements)
            groups.setdefault(key, []).append(g)
    inf = math.isinf(p)
    total = _local_power_sum(plain, p)
    dev = grads[0].device if grads else torch.device("cpu")
    total = total.to(dev)
    for (mesh, placements), gs in groups.items():
        if any(isinstance(x, Partial) for x in placements):
            gs = [
                g.redistribute(
                    mesh, [hp.Replicate() if isinstance(x, Partial) else x for x in placements]
                )
                for g in gs
            ]
        part = _local_power_sum([g.to_local() for g in gs], p).to(dev)
        platform = hp.get_platform(mesh.device_type)
        for d, x in enumerate(placements):
            if isinstance(x, Shard) and mesh.shape[d] > 1:
                platform.all_reduce(part, "max" if inf else "sum", mesh._groups[d])
        total = torch.maximum(total, part) if inf else total + part
    total = total if inf else total ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} is non-finite")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if locals_:
            if foreach is False:
                for t in locals_:
                    t.mul_(coef.to(t.device))
            else:
                torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total
