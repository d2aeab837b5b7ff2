"""torch's autograd binding of the redistribution between two meshes over the same ranks: the
forward runs the transfer plan, the backward the plan that brings the gradient back (both
from :func:`~hp_dtensor._transfer_run.across_mesh_plans`)."""

from __future__ import annotations

import torch

from ._transfer import TransferPlan
from ._transfer_run import across_mesh_plans, run_transfer

__all__ = ["redistribute_across_meshes"]


class _AcrossMeshes(torch.autograd.Function):
    """Local piece on the source mesh -> local piece on the destination mesh (same ranks);
    backward runs the reverse plan on the gradient."""

    @staticmethod
    def forward(ctx, local, plan: TransferPlan, back: TransferPlan):
        ctx.back = back
        return run_transfer(plan, local).to_local()

    @staticmethod
    def backward(ctx, grad):
        return run_transfer(ctx.back, grad.contiguous()).to_local(), None, None


def redistribute_across_meshes(x, device_mesh, placements):
    """``x`` (a DTensor) on ``device_mesh`` (the same ranks as ``x``'s mesh, in another shape
    or order) with ``placements``: a differentiable transfer."""
    from ._dtensor import DTensor

    spec = x._spec
    plan, back, dst_pl, back_pl = across_mesh_plans(spec, device_mesh, placements)
    local = x.to_local(grad_placements=back_pl)
    out = _AcrossMeshes.apply(local, plan, back)
    return DTensor.from_local(out, device_mesh, dst_pl, run_check=False, shape=spec.shape)
