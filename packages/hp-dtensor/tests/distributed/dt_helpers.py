"""Helpers shared by the distributed tests (imported inside the ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hp_dtensor import DTensor, Partial, Shard, chunk_size_and_offset, distribute_tensor
from hp_testing import assert_close


def noise_like(x: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)


def make_dtensor(full: torch.Tensor, mesh, placements, *, requires_grad=False) -> DTensor:
    """A DTensor equal to ``full`` with any placements, Partial ones included.

    Partial locals are uneven on purpose (sum: split by noise; avg: +-noise; max/min: the first
    coordinate holds the extreme).
    """
    coord = mesh.get_coordinate()
    x = full.detach()
    for d, p in enumerate(placements):
        n, i = mesh.shape[d], coord[d]
        if isinstance(p, Shard):
            length, start = chunk_size_and_offset(x.shape[p.dim], n, i)
            x = x.narrow(p.dim, start, length)
        elif isinstance(p, Partial):
            r = noise_like(x, seed=17 + d)
            if p.reduce_op == "sum":
                x = x - (n - 1) * r if i == 0 else r
            elif p.reduce_op == "avg":
                x = x + r * (2 * i - (n - 1))
            elif p.reduce_op == "max":
                x = x - i * r.abs()
            else:
                x = x + i * r.abs()
    local = x.clone().contiguous().requires_grad_(requires_grad)
    return DTensor.from_local(local, mesh, placements, shape=full.shape)


def check_op(fn, inputs, placements, mesh, *, rtol=1e-5, atol=1e-5, grad=True, name=""):
    """Run ``fn`` on DTensors and on whole tensors; compare outputs and input gradients.

    ``inputs`` are whole tensors (equal on every rank); ``placements[i]`` gives the placements
    of input i, or None to pass it through unchanged (a Python value). Gradients are compared
    twice: through ``full_tensor()`` and through a loss computed on DTensors.
    """
    ref_in = [
        t.detach().clone().requires_grad_(grad and t.is_floating_point())
        if isinstance(t, torch.Tensor)
        else t
        for t in inputs
    ]
    ref_out = fn(*ref_in)
    outs = ref_out if isinstance(ref_out, (tuple, list)) else (ref_out,)
    dts = [
        make_dtensor(t, mesh, pl, requires_grad=grad and t.is_floating_point())
        if pl is not None
        else t
        for t, pl in zip(inputs, placements)
    ]
    out = fn(*dts)
    douts = out if isinstance(out, (tuple, list)) else (out,)
    assert len(douts) == len(outs), name
    for o, r in zip(douts, outs):
        assert isinstance(o, DTensor), f"{name}: output is {type(o)}"
        assert tuple(o.shape) == tuple(r.shape), f"{name}: shape {o.shape} vs {r.shape}"
        assert_close(
            o.full_tensor(),
            r,
            rtol=rtol,
            atol=atol,
            msg=f"{name}: forward {o.placements}",
        )
    if not grad:
        return out
    weights = [
        noise_like(r, seed=99 + i) if r.is_floating_point() else None for i, r in enumerate(outs)
    ]
    ref_loss = sum((r * w).sum() for r, w in zip(outs, weights) if w is not None)
    ref_loss.backward()
    ref_grads = [t.grad if isinstance(t, torch.Tensor) else None for t in ref_in]
    for variant in ("full_tensor", "dtensor_loss"):
        for d in dts:
            if isinstance(d, DTensor):
                d.grad = None
        out = fn(*dts)
        douts = out if isinstance(out, (tuple, list)) else (out,)
        if variant == "full_tensor":
            loss = sum((o.full_tensor() * w).sum() for o, w in zip(douts, weights) if w is not None)
            loss.backward()
        else:
            loss = None
            for o, w in zip(douts, weights):
                if w is None:
                    continue
                wd = distribute_tensor(w, mesh, [_r() for _ in range(mesh.ndim)])
                term = (o * wd).sum()
                loss = term if loss is None else loss + term
            loss.backward()
        for i, (d, g) in enumerate(zip(dts, ref_grads)):
            if not isinstance(d, DTensor) or g is None:
                continue
            assert d.grad is not None, f"{name}: no grad for input {i} ({variant})"
            assert_close(
                d.grad.full_tensor(),
                g,
                rtol=rtol,
                atol=atol,
                msg=f"{name}: grad of input {i} {d.placements} ({variant})",
            )
    return out


def _r():
    from hp_dtensor import Replicate

    return Replicate()


def rank() -> int:
    return dist.get_rank()
