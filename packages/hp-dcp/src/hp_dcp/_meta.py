"""Checkpoint metadata and box arithmetic: pure Python, no framework.

A stored tensor is a set of *chunks*. A chunk is a box of the global tensor (``offsets`` and
``sizes`` per dimension) stored row-major and contiguous at a byte range of one file, with a
CRC-32 of those bytes. The same description covers our own checkpoints, HuggingFace safetensors
files (one chunk per tensor) and PyTorch DCP checkpoints (chunks stored as ``torch.save`` blobs:
``encoding="torch_save"``).

Non-tensor values ("objects") are stored as data (tagged JSON, ``_codec``), never pickled. One
object equal on every rank is stored once; values that differ are stored per rank, and ``load``
gives each rank its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "VERSION",
    "Chunk",
    "Metadata",
    "ObjectEntry",
    "StoredObject",
    "TensorEntry",
    "element_size",
    "intersect",
    "numel",
]

FORMAT = "hp-dcp"
VERSION = 1
METADATA_FILE = "metadata.json"

# dtype name -> bytes per element. Names are torch's (``str(torch.float32)[6:]``).
_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
}


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as torch names it (``"bfloat16"``)."""
    try:
        return _SIZES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} cannot be stored: use one of {sorted(_SIZES)}") from None


def numel(sizes) -> int:
    """Number of elements of a box."""
    return math.prod(sizes)


def intersect(a_off, a_size, b_off, b_size):
    """The box where two boxes overlap as ``(offsets, sizes)``, or None when they do not.

    >>> intersect((0, 0), (4, 6), (2, 3), (4, 4))
    ((2, 3), (2, 3))
    """
    off, size = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int  # byte offset in ``file``
    nbytes: int
    crc32: int | None = None  # None where the source has no checksum (safetensors, torch DCP)
    encoding: str = "raw"  # "raw" (row-major bytes) or "torch_save"


@dataclass
class TensorEntry:
    """A tensor: global shape, dtype, the placements it was saved with, and its chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)
    placements: str = ""  # e.g. "S(0)R on mesh (2, 2)"; informational

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)


@dataclass(frozen=True)
class StoredObject:
    """The stored bytes of one object value: hp-dcp's JSON encoding of data (``_codec``),
    PyTorch DCP's ``torch.save`` (``"torch_save"``), or the pickles of hp-dcp checkpoints
    written before values were data (``"pickle"``, read only when allowed)."""

    file: str
    offset: int
    nbytes: int
    crc32: int | None = None
    encoding: str = "json"


@dataclass
class ObjectEntry:
    """A non-tensor value: one copy (``per_rank`` empty) or one per saving rank."""

    value: StoredObject | None = None
    per_rank: dict[int, StoredObject] = field(default_factory=dict)


@dataclass
class Metadata:
    """Everything ``load`` needs to find every byte."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    world_size: int = 1
    source: str = FORMAT  # "hp-dcp", "safetensors" or "torch-dcp"
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """The committed form: one JSON document."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "extra": self.extra,
            "tensors": {
                k: {
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "placements": e.placements,
                    "chunks": [_chunk_doc(c) for c in e.chunks],
                }
                for k, e in self.tensors.items()
            },
            "objects": {
                k: {
                    "value": None if e.value is None else asdict(e.value),
                    "per_rank": {str(r): asdict(v) for r, v in e.per_rank.items()},
                }
                for k, e in self.objects.items()
            },
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str = "metadata") -> Metadata:
        """Parse :meth:`to_json` output; ``where`` names the file in errors."""
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(
                f"{where} is not an {FORMAT} checkpoint (format={doc.get('format')!r})"
            )
        if doc.get("version", 0) > VERSION:
            raise ValueError(
                f"{where} has format version {doc['version']}; this hp_dcp reads up to {VERSION}: "
                "upgrade hp-dcp"
            )
        md = cls(world_size=doc["world_size"], extra=doc.get("extra", {}))
        for k, e in doc["tensors"].items():
            md.tensors[k] = TensorEntry(
                dtype=e["dtype"],
                shape=tuple(e["shape"]),
                placements=e.get("placements", ""),
                chunks=[
                    Chunk(
                        offsets=tuple(c["o"]),
                        sizes=tuple(c["s"]),
                        file=c["f"],
                        offset=c["b"],
                        nbytes=c["n"],
                        crc32=c.get("c"),
                        encoding=c.get("e", "raw"),
                    )
                    for c in e["chunks"]
                ],
            )
        for k, e in doc["objects"].items():
            md.objects[k] = ObjectEntry(
                value=None if e["value"] is None else StoredObject(**e["value"]),
                per_rank={int(r): StoredObject(**v) for r, v in e["per_rank"].items()},
            )
        return md


def _chunk_doc(c: Chunk) -> dict:
    d = {"o": list(c.offsets), "s": list(c.sizes), "f": c.file, "b": c.offset, "n": c.nbytes}
    if c.crc32 is not None:
        d["c"] = c.crc32
    if c.encoding != "raw":
        d["e"] = c.encoding
    return d
