"""The compiled module: conversions and reductions against torch, the lazy-import error."""

import os
import subprocess
import sys

import pytest
import torch

import hp_kernels
from hp_kernels import _dtypes, _ext


def test_built_here():
    assert hp_kernels.is_built()


@pytest.mark.parametrize(
    "src",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32],
    ids=str,
)
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_convert_matches_torch(src, dst):
    c = _ext.load()
    x = (torch.randn(1000) * 300).to(src)
    if src.is_floating_point:
        x[:3] = torch.tensor([float("inf"), float("-inf"), 0.0]).to(src)
    out = torch.empty(1000, dtype=dst)
    c.convert(out.data_ptr(), _dtypes.CODES[dst], x.data_ptr(), _dtypes.CODES[src], 1000, 2)
    assert torch.equal(out, x.to(dst))


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_matches_torch(op):
    c = _ext.load()
    srcs = [torch.randn(70_001).to(torch.bfloat16) for _ in range(3)]
    out = torch.empty(70_001, dtype=torch.float32)
    c.reduce(
        out.data_ptr(), 0, [s.data_ptr() for s in srcs], 1, 70_001, _dtypes.REDUCE_OPS[op], 1 / 3, 3
    )
    stack = torch.stack([s.float() for s in srcs])
    ref = {"sum": stack.sum(0), "avg": stack.sum(0) / 3, "max": stack.max(0).values}[op]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_missing_module_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setattr(_ext, "_error", ImportError("No module named 'hp_kernels._C'"))
    with pytest.raises(_ext.KernelsNotBuiltError, match="pip install -e packages/hp-kernels"):
        _ext.load()
    assert not _ext.is_built()


def test_unsupported_dtype_names_argument():
    with pytest.raises(TypeError, match="the tensor has dtype torch.complex64"):
        _dtypes.code(torch.complex64, "the tensor")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 3), (15, 8)])
def test_large_copies_stream_past_the_caches_exactly(threads, dst_off, src_off):
    """Copies of 4 MiB and more use non-temporal stores (aligned to 16 bytes, with a head and
    a tail copied plainly): every byte lands, at any alignment of either end, and nothing
    next to the destination is touched."""
    c = _ext.load()
    n = (4 << 20) + 37
    src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8)
    dst = torch.zeros(n + 64, dtype=torch.uint8)
    c.copy(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n, threads)
    assert torch.equal(dst[dst_off : dst_off + n], src[src_off : src_off + n])
    assert not dst[:dst_off].any() and not dst[dst_off + n :].any()


@pytest.mark.parametrize("shift", [1, 64, 4096, -1, -4096])
def test_overlapping_copies_behave_like_memmove(shift):
    """SymmetricMemory.put/get may shift data inside one buffer: a large overlapping copy
    (where streaming stores would read bytes they already overwrote) is a memmove."""
    c = _ext.load()
    n = (4 << 20) + 5
    buf = torch.randint(0, 256, (n + 8192,), dtype=torch.uint8)
    src_off = 4096
    want = buf.clone()
    want[src_off + shift : src_off + shift + n] = buf[src_off : src_off + n].clone()
    c.copy(buf.data_ptr() + src_off + shift, buf.data_ptr() + src_off, n, 2)
    assert torch.equal(buf, want)


def test_stream_threshold_is_read_once_and_parsed_strictly():
    """HP_KERNELS_STREAM_MIN is a byte count; anything else keeps the 4 MiB default."""
    code = "import hp_kernels._ext as e; print(e.load().STREAM_MIN_BYTES)"
    got = {}
    for value in ("123", "4M", "abc", "", "-1", "0x400000"):
        env = {**os.environ, "HP_KERNELS_STREAM_MIN": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        got[value] = int(out.stdout.strip())
    default = 4 << 20
    assert got == {
        "123": 123,
        "4M": default,
        "abc": default,
        "": default,
        "-1": default,
        "0x400000": default,
    }
