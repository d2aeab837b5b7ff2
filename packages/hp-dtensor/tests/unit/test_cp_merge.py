"""Context parallelism's merge of one attention block into the running output and
log-sum-exp: the compiled form (what CUDA runs) against the eager one, on CPU, on the slices
the forward hands it; and fake tensors (a dry run) never take the compiled form."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hp_dtensor.parallel import _context as ctxp


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, s, d, lo, hi = 2, 3, 12, 8, 4, 10
    out = torch.randn(b, h, s, d, dtype=dtype, generator=g)
    lse = torch.randn(b, h, s, dtype=dtype, generator=g)
    lse[0, 0, 5] = float("-inf")  # a row no earlier block reached
    wide = torch.randn(b, h, hi - lo, d + 4, dtype=dtype, generator=g)
    o = wide[..., :d]  # not contiguous, as a padded kernel output is
    lb = torch.randn(b, h, hi - lo, dtype=dtype, generator=g)
    return out, lse, o, lb, lo, hi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_merge_equals_eager_on_slices(monkeypatch, dtype):
    out, lse, o, lb, lo, hi = _case(dtype)
    want_out, want_lse = out.clone(), lse.clone()
    ctxp._merge_rows(want_out[:, :, lo:hi], want_lse[:, :, lo:hi], o, lb)
    monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    assert ctxp._merge_fn(out) is ctxp._compiled_merge()
    ctxp._merge(out, lse, lo, hi, o, lb, first=False)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    # rows outside the slice untouched, to the bit; the merge moved the slice
    assert torch.equal(out[:, :, :lo], _case(dtype)[0][:, :, :lo])
    assert not torch.allclose(out[:, :, lo:hi], _case(dtype)[0][:, :, lo:hi])


def test_fake_tensors_merge_eagerly(monkeypatch):
    monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    with FakeTensorMode():
        out = torch.empty(1, 2, 4, 8)
        assert ctxp._merge_fn(out) is ctxp._merge_rows
    assert ctxp._merge_fn(torch.empty(1)) is ctxp._compiled_merge()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_merge_equals_eager_and_fake_cuda_tensors_run_eagerly():
    """On a GPU host: CUDA tensors take the compiled merge, with eager's values; fake CUDA
    tensors (a dry run on that host) take the eager one and run through it."""
    out, lse, o, lb, lo, hi = (t.cuda() if torch.is_tensor(t) else t for t in _case(torch.float32))
    want_out, want_lse = out.clone(), lse.clone()
    ctxp._merge_rows(want_out[:, :, lo:hi], want_lse[:, :, lo:hi], o, lb)
    assert ctxp._merge_fn(out) is ctxp._compiled_merge()
    ctxp._merge(out, lse, lo, hi, o, lb, first=False)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    with FakeTensorMode() as mode:
        f_out, f_lse, f_o, f_lb = (mode.from_tensor(t) for t in (out, lse, o, lb))
        assert f_out.device.type == "cuda"
        assert ctxp._merge_fn(f_out) is ctxp._merge_rows
        ctxp._merge(f_out, f_lse, lo, hi, f_o, f_lb, first=False)  # shapes only: no error
