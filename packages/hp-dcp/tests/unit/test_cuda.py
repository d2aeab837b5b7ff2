"""GPU tensors (skipped without CUDA): save through the pinned double buffer, load into GPU
tensors whole and by part, async_save from GPU memory."""

import pytest
import torch

import hp_dcp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(4096, 1024, generator=g).cuda(),  # 16 MiB
        "bf16": torch.randn(333, 77, generator=g).bfloat16().cuda(),
        "ints": torch.arange(1000, dtype=torch.int64).cuda(),
        "cpu": torch.randn(10, generator=g),
        "scalar": torch.tensor(2.5).cuda(),
        **{f"w{i}": torch.randn(512, 256, generator=g).cuda() for i in range(6)},
    }


def test_save_load_gpu_tensors(tmp_path):
    src = _tensors()
    hp_dcp.save(src, checkpoint_id=tmp_path / "c")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    hp_dcp.load(dst, checkpoint_id=tmp_path / "c")
    for k in src:
        assert dst[k].device == src[k].device and torch.equal(dst[k], src[k]), k
    # parts of a chunk into GPU tensors (the row-range path), several in a row
    reader = hp_dcp.open_checkpoint(tmp_path / "c")
    e = reader.metadata.tensors["big"]
    parts = []
    for r in range(0, 4096, 1000):
        rows = min(1000, 4096 - r)
        dest = torch.empty(rows, 300, device="cuda")
        reader.read_into("big", e, hp_dcp.ReadItem(e.chunks[0], (r, 100), (rows, 300)), dest)
        parts.append(dest)
    reader.close()
    assert torch.equal(torch.cat(parts), src["big"][:, 100:400])


def test_async_save_from_gpu(tmp_path):
    src = _tensors()
    snap = {k: v.clone() for k, v in src.items()}
    fut = hp_dcp.async_save(src, checkpoint_id=tmp_path / "a")
    for v in src.values():
        v.zero_()  # training goes on
    fut.result()
    dst = {k: torch.zeros_like(v) for k, v in snap.items()}
    hp_dcp.load(dst, checkpoint_id=tmp_path / "a")
    for k in snap:
        assert torch.equal(dst[k], snap[k]), k
