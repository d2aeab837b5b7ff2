"""JSON data between ranks through the platform: metadata (names, shapes, dtypes, channel
lists) that every rank must agree on, as data, never code (no pickle: what another rank sent is
parsed, not executed). Bytes travel as int32, which every backend's collectives carry."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ._backend import get_platform

__all__ = ["all_gather_json", "broadcast_json"]


def _platform(platform):
    return get_platform() if platform is None else platform


def broadcast_json(value: Any, src: int, group: Any = None, *, device: Any = "cpu", platform=None):
    """``value`` (JSON data, given on global rank ``src``; ignored elsewhere) on every rank of
    ``group``."""
    plat = _platform(platform)
    me = plat.get_rank()
    blob = json.dumps(value).encode() if me == src else b""
    n = plat.from_numpy(np.array([len(blob)], dtype=np.int32), device)
    plat.broadcast(n, src, group)
    size = int(plat.to_numpy(n)[0])
    data = np.frombuffer(blob, dtype=np.uint8) if me == src else np.zeros(size, dtype=np.uint8)
    buf = plat.from_numpy(data.astype(np.int32), device)
    plat.broadcast(buf, src, group)
    return json.loads(plat.to_numpy(buf).astype(np.uint8).tobytes().decode())


def all_gather_json(value: Any, group: Any = None, *, device: Any = "cpu", platform=None) -> list:
    """Every rank's ``value`` (JSON data), in the group's rank order, on every rank of
    ``group``."""
    plat = _platform(platform)
    n = plat.get_world_size(group)
    blob = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8).astype(np.int32)
    sizes = plat.from_numpy(np.zeros(n, dtype=np.int32), device)
    plat.all_gather_into(
        sizes, plat.from_numpy(np.array([blob.size], dtype=np.int32), device), group
    )
    sizes = plat.to_numpy(sizes).tolist()
    width = max(sizes)
    padded = np.zeros(width, dtype=np.int32)
    padded[: blob.size] = blob
    out = plat.from_numpy(np.zeros(n * width, dtype=np.int32), device)
    plat.all_gather_into(out, plat.from_numpy(padded, device), group)
    rows = plat.to_numpy(out).reshape(n, width)
    return [json.loads(row[:k].astype(np.uint8).tobytes().decode()) for row, k in zip(rows, sizes)]
