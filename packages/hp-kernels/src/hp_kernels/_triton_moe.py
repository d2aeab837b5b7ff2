"""Triton kernels for the expert activation: ``h = silu(a) * b * w[row]`` and its backward.

Imported only for CUDA tensors when Triton is installed (``hp_kernels.moe.swiglu`` falls back
to torch ops otherwise). One pass over the operands each way: the forward reads ``a`` and ``b``
once and writes ``h``; the backward reads ``dh``, ``a``, ``b`` once and writes ``da``, ``db``
and, per row, ``dw = sum(dh * silu(a) * b)``. Arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["swiglu_backward", "swiglu_forward"]


@triton.jit
def _fwd(a_ptr, b_ptr, w_ptr, h_ptr, cols, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < cols
    base = row.to(tl.int64) * cols
    a = tl.load(a_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    h = a * tl.sigmoid(a) * b
    if HAS_W:
        h = h * tl.load(w_ptr + row).to(tl.float32)
    tl.store(h_ptr + base + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(
    dh_ptr,
    a_ptr,
    b_ptr,
    w_ptr,
    da_ptr,
    db_ptr,
    dw_ptr,
    cols,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = row.to(tl.int64) * cols
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        dh = tl.load(dh_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        silu = a * sig
        if HAS_W:
            acc += dh * silu * b
        g = dh * w
        tl.store(db_ptr + base + offs, (g * silu).to(db_ptr.dtype.element_ty), mask=mask)
        da = g * b * (sig + silu * (1.0 - sig))
        tl.store(da_ptr + base + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(dw_ptr + row, tl.sum(acc, axis=0))


def _block(cols: int) -> int:
    return min(1024, triton.next_power_of_2(max(cols, 16)))


def swiglu_forward(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``silu(a) * b`` (times ``w[:, None]``) for contiguous ``(R, H)`` CUDA tensors."""
    rows, cols = a.shape
    h = torch.empty_like(a)
    if rows == 0 or cols == 0:
        return h
    block = _block(cols)
    grid = (rows, triton.cdiv(cols, block))
    _fwd[grid](a, b, w if w is not None else a, h, cols, HAS_W=w is not None, BLOCK=block)
    return h


def swiglu_backward(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(da, db, dw)`` of :func:`swiglu_forward` (``dw`` float32, None without ``w``)."""
    rows, cols = a.shape
    da, db = torch.empty_like(a), torch.empty_like(b)
    dw = torch.empty(rows, dtype=torch.float32, device=a.device) if w is not None else None
    if rows == 0 or cols == 0:
        if dw is not None:
            dw.zero_()
        return da, db, dw
    _bwd[(rows,)](
        dh,
        a,
        b,
        w if w is not None else a,
        da,
        db,
        dw if dw is not None else a,
        cols,
        HAS_W=w is not None,
        BLOCK=_block(cols),
    )
    return da, db, dw
