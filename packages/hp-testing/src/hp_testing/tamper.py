"""Crafted-checkpoint helpers for the "checkpoints are data, not code" tests.

``RunsCommand`` is an object whose unpickling runs ``touch <marker>``; ``plant_value`` swaps a
stored value of an hp-dcp checkpoint for arbitrary bytes and fixes its offset, size, checksum
and encoding in ``metadata.json`` to match, as an attacker would. Tests then assert the loader
refuses the value and that the marker file never appears. Development only.
"""

from __future__ import annotations

import json
import os
import shlex
import zlib
from pathlib import Path

__all__ = ["RunsCommand", "plant_value"]


class RunsCommand:
    """Unpickling this runs ``touch <marker>`` (the witness that code ran on load)."""

    def __init__(self, marker: str | os.PathLike) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def plant_value(ckpt: str | os.PathLike, key: str, blob: bytes, encoding: str) -> None:
    """Replace value ``key``'s stored bytes in checkpoint ``ckpt`` with ``blob`` (appended to
    its data file) and rewrite the metadata's offset, size, crc32 and encoding to match."""
    ckpt = Path(ckpt)
    meta_path = ckpt / "metadata.json"
    doc = json.loads(meta_path.read_text())
    entry = doc["objects"][key]
    stored = (
        entry["value"] if entry["value"] is not None else next(iter(entry["per_rank"].values()))
    )
    data = ckpt / stored["file"]
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob)
    stored.update(offset=offset, nbytes=len(blob), crc32=zlib.crc32(blob), encoding=encoding)
    meta_path.write_text(json.dumps(doc))
