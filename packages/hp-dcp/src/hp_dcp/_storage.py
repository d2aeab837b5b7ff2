"""Storage: where bytes go and come from.

``FileSystemWriter`` writes one data file per rank into a hidden sibling folder
(``.<name>.partial``); rank 0 writes ``metadata.json`` last, fsyncs, and renames the folder to
its final name, so a checkpoint folder either is complete or does not exist. Readers present
three formats through one :class:`~hp_dcp._meta.Metadata`: our own folders, HuggingFace
safetensors (a file or a folder of shards) and PyTorch DCP folders.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ._codec import CodecError, decode
from ._meta import (
    METADATA_FILE,
    Chunk,
    Metadata,
    ObjectEntry,
    StoredObject,
    TensorEntry,
    element_size,
    numel,
)
from ._plan import ReadItem
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

__all__ = [
    "FileSystemReader",
    "FileSystemWriter",
    "HostStaging",
    "SafetensorsReader",
    "TorchDCPReader",
    "byte_view",
    "data_file",
    "open_checkpoint",
    "partial_path",
    "torch_dtype",
]


def data_file(rank: int) -> str:
    """Name of rank ``rank``'s data file."""
    return f"data_{rank:05d}.bin"


def partial_path(path: Path) -> Path:
    """Where a save into ``path`` writes before it commits."""
    return path.parent / f".{path.name}.partial"


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dt).removeprefix("torch.")


def byte_view(t: torch.Tensor):
    """A contiguous CPU tensor's bytes as a writable NumPy uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _write_all(fd: int, buf) -> None:
    mv = memoryview(buf).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


_OVERLAP_BYTES = 1 << 20
_POOL: ThreadPoolExecutor | None = None


def _crc_pool() -> ThreadPoolExecutor:
    """One helper thread computing CRC-32s (zlib releases the GIL for large buffers, as the
    write system call does, so checksum and write run at the same time)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="hp-dcp-crc")
    return _POOL


def _load_sync_file_range():
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):  # not Linux: the final fsync does all the work
        return None


_SYNC_FILE_RANGE = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a just-written range to disk without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux), so the disk works while the next chunk
    is copied and the final fsync has little left to do. Page-cache pages stay cached."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSystemWriter:
    """Writes a checkpoint folder at ``path``.

    ``sync_files`` fsyncs data and metadata before the rename (a power cut then cannot leave a
    committed checkpoint with missing bytes). An existing checkpoint at ``path`` is replaced only
    at commit time; until then it stays loadable.
    """

    def __init__(self, path: str | os.PathLike, *, sync_files: bool = True) -> None:
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        self.sync_files = sync_files

    def prepare(self) -> None:
        """Rank 0, before any rank writes: a fresh, empty partial folder."""
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"checkpoint_id {str(self.path)!r} exists and is not a folder")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)  # the remains of an interrupted save
        self.tmp.mkdir()

    def write(self, rank: int, items: list[tuple[Any, Any]]) -> list[tuple]:
        """Write ``(item, data)`` pairs (data: a contiguous CPU tensor or bytes) to this rank's
        file. Returns ``(item, file, offset, nbytes, crc32)`` per item."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        name = data_file(rank)
        out = []
        fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            for item, data in items:
                buf = data if isinstance(data, (bytes, bytearray)) else byte_view(data)
                n = len(buf) if isinstance(buf, (bytes, bytearray)) else buf.nbytes
                if n >= _OVERLAP_BYTES:  # checksum on a helper thread while this thread writes
                    fut = _crc_pool().submit(zlib.crc32, buf)
                    _write_all(fd, buf)
                    crc = fut.result()
                else:
                    crc = zlib.crc32(buf)
                    _write_all(fd, buf)
                if n >= _OVERLAP_BYTES:  # also without fsync: keeps the kernel from
                    _start_writeback(fd, pos, n)  # throttling a writer with many dirty pages
                out.append((item, name, pos, n, crc))
                pos += n
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        return out

    def commit(self, metadata: Metadata) -> None:
        """Rank 0, after every rank wrote: metadata last, then the atomic rename."""
        meta = self.tmp / METADATA_FILE
        with open(meta, "w") as f:
            f.write(metadata.to_json())
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        if self.sync_files:
            _fsync_dir(self.tmp)
        old = None
        if self.path.exists():
            old = self.path.parent / f".{self.path.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        if self.sync_files:
            _fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Rank 0, when a rank failed: remove the partial folder."""
        shutil.rmtree(self.tmp, ignore_errors=True)


class HostStaging:
    """Two reusable host buffers, pinned, for copies between a GPU and the file that overlap with
    file I/O (double buffering): while one buffer's device copy runs, the other is read from or
    written to the file. ``take`` waits until the buffer's previous copy is done."""

    MAX_BYTES = 1 << 30  # larger pieces go through an ordinary synchronous copy

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.turn = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        slot = self.turn
        self.turn ^= 1
        if self.events[slot] is not None:
            self.events[slot].synchronize()
            self.events[slot] = None
        slab = self.slabs[slot]
        if slab is None or slab.numel() < nbytes:
            size = 1 << max(nbytes - 1, 1).bit_length()  # powers of two: few reallocations
            slab = self.slabs[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return slab[:nbytes], slot

    def record(self, slot: int, stream=None) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)
        self.events[slot] = ev

    def wait(self, slot: int) -> None:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
            self.events[slot] = None

    def drain(self) -> None:
        for slot in (0, 1):
            self.wait(slot)


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


class _Reader:
    """Reads byte ranges of files under ``root`` with cached descriptors."""

    kind = "?"

    def __init__(self, root: Path, metadata: Metadata) -> None:
        self.root = root
        self.metadata = metadata
        self._fds: dict[str, int] = {}
        self._staging: HostStaging | None = None

    def _host_buffer(self, shape, dtype, dest: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Where to read a piece bound for ``dest``: a pinned staging buffer when ``dest`` is on
        a GPU (then the copy to it is asynchronous), else fresh host memory."""
        nbytes = numel(shape) * element_size(str(dtype).removeprefix("torch."))
        if dest.device.type != "cuda" or nbytes > HostStaging.MAX_BYTES or nbytes == 0:
            return torch.empty(shape, dtype=dtype), None
        if self._staging is None:
            self._staging = HostStaging()
        u8, slot = self._staging.take(nbytes)
        return u8.view(dtype).view(shape), slot

    def _to_dest(self, dest: torch.Tensor, src: torch.Tensor, slot: int | None) -> None:
        if slot is None:
            dest.copy_(src)
        else:
            dest.copy_(src, non_blocking=True)
            self._staging.record(slot)

    def sync(self) -> None:
        """Wait for the asynchronous copies into GPU tensors."""
        if self._staging is not None:
            self._staging.drain()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Finish pending copies and close the open files."""
        self.sync()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = os.open(self.root / file, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(
                    f"checkpoint {str(self.root)!r} lacks its data file {file!r}"
                ) from None
            self._fds[file] = fd
        return fd

    def read_bytes_into(self, file: str, offset: int, buf) -> None:
        """Fill ``buf`` (a writable uint8 buffer) from ``file`` at ``offset``."""
        fd = self._fd(file)
        mv = memoryview(buf).cast("B")
        pos = offset
        while mv:
            n = os.preadv(fd, [mv], pos)
            if n == 0:
                raise CheckpointError(
                    f"{self.root / file} ends before byte {pos}: the file is truncated"
                )
            mv = mv[n:]
            pos += n

    def read_bytes(self, file: str, offset: int, n: int) -> bytearray:
        buf = bytearray(n)
        self.read_bytes_into(file, offset, buf)
        return buf

    def _check(self, key: str, c, got: int) -> None:
        if c.crc32 is not None and got != c.crc32:
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.root / c.file} "
                f"(bytes {c.offset}..{c.offset + c.nbytes})"
                f" for {key!r}: stored crc32 {c.crc32:#010x}, read {got:#010x}; the file is "
                "damaged: restore it or load an older checkpoint"
            )

    def read_into(self, key: str, entry: TensorEntry, item: ReadItem, dest: torch.Tensor) -> int:
        """Copy the box ``item`` of tensor ``key`` into ``dest`` (a tensor of the box's shape).
        Returns the bytes read from storage."""
        c = item.chunk
        dt = torch_dtype(entry.dtype)
        whole = tuple(item.sizes) == tuple(c.sizes)
        if c.encoding == "torch_save":
            return self._read_torch_save(key, entry, item, dest)
        if whole:
            direct = dest.device.type == "cpu" and dest.dtype == dt and dest.is_contiguous()
            buf, slot = (dest, None) if direct else self._host_buffer(c.sizes, dt, dest)
            view = byte_view(buf)
            if view.nbytes != c.nbytes:
                raise CheckpointError(
                    f"{key!r}: chunk at {c.file}:{c.offset} holds {c.nbytes} bytes, its box "
                    f"{tuple(c.sizes)} of {entry.dtype} needs {view.nbytes}"
                )
            self.read_bytes_into(c.file, c.offset, view)
            self._check(key, c, zlib.crc32(view))
            if not direct:
                self._to_dest(dest, buf, slot)
            return c.nbytes
        # a part of the chunk: read only the rows (first dimension) it spans
        rel = [o - co for o, co in zip(item.offsets, c.offsets)]
        row = numel(c.sizes[1:]) * element_size(entry.dtype)
        r0, r1 = rel[0], rel[0] + item.sizes[0]
        buf, slot = self._host_buffer((r1 - r0, *c.sizes[1:]), dt, dest)
        self.read_bytes_into(c.file, c.offset + r0 * row, byte_view(buf))
        idx = (slice(None),) + tuple(slice(r, r + s) for r, s in zip(rel[1:], item.sizes[1:]))
        self._to_dest(dest, buf[idx], slot)
        return buf.numel() * buf.element_size()

    def _read_torch_save(self, key, entry, item, dest) -> int:
        c = item.chunk
        blob = self.read_bytes(c.file, c.offset, c.nbytes)
        if blob[:2] == b"PK":
            t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        else:  # torch DCP's raw (safetensors-style) serialization
            t = torch.frombuffer(blob, dtype=torch_dtype(entry.dtype)).view(c.sizes)
        idx = tuple(
            slice(o - co, o - co + s) for o, co, s in zip(item.offsets, c.offsets, item.sizes)
        )
        dest.copy_(t[idx])
        return c.nbytes

    def read_object(self, key: str, stored: StoredObject, *, allow_pickle: bool = False) -> Any:
        """The value of a stored object, read as data: hp-dcp's JSON encoding, or PyTorch DCP's
        ``torch.save`` with ``weights_only=True``. Pickles (hp-dcp checkpoints written before
        values were data) are refused unless ``allow_pickle`` (with a warning)."""
        blob = self.read_bytes(stored.file, stored.offset, stored.nbytes)
        self._check(key, stored, zlib.crc32(blob))
        if stored.encoding == "json":
            try:
                return decode(blob)
            except CodecError as e:
                raise CorruptCheckpointError(f"value {key!r} in {stored.file}: {e}") from None
        if stored.encoding == "torch_save":
            try:
                return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - anything beyond plain data is refused
                raise CheckpointError(
                    f"value {key!r}: PyTorch DCP stored it as a pickle that is not plain data "
                    f"(weights_only refused it: {type(e).__name__}); hp-dcp does not unpickle "
                    "objects"
                ) from None
        if stored.encoding != "pickle":
            raise CheckpointError(f"value {key!r}: unknown encoding {stored.encoding!r}")
        if not allow_pickle:
            raise CheckpointError(
                f"value {key!r} is stored as a pickle (an hp-dcp checkpoint written before "
                "values were stored as data); unpickling can run code: pass "
                "allow_pickle=True (hp-dcp --allow-pickle) only for a checkpoint you trust, and "
                "save it again to convert it"
            )
        warnings.warn(
            f"unpickling value {key!r} of an old hp-dcp checkpoint (allow_pickle=True)",
            stacklevel=2,
        )
        return pickle.loads(blob)


class FileSystemReader(_Reader):
    """Reads an hp_dcp checkpoint folder (``metadata.json`` plus ``data_*.bin``)."""

    kind = "hp-dcp"

    def __init__(self, path: str | os.PathLike) -> None:
        root = Path(path)
        meta = root / METADATA_FILE
        if not meta.exists():
            raise IncompleteCheckpointError(
                f"{str(root)!r} has no {METADATA_FILE}: it is not a committed checkpoint (a save "
                "into it did not finish). Load the previous checkpoint instead"
            )
        try:
            md = Metadata.from_json(meta.read_text(), where=str(meta))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read {meta}: {e}") from e
        super().__init__(root, md)


_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a ``.safetensors`` file and the byte where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    return header, 8 + n


class SafetensorsReader(_Reader):
    """Reads HuggingFace safetensors: one file, or a folder of shards (with or without
    ``model.safetensors.index.json``). Each tensor is one chunk; parts are read by byte range."""

    kind = "safetensors"

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if path.is_file():
            root, files = path.parent, [path.name]
        else:
            root = path
            files = sorted(p.name for p in path.glob("*.safetensors"))
        md = Metadata(source="safetensors")
        for name in files:
            header, start = read_safetensors_header(root / name)
            meta = header.pop("__metadata__", None) or {}
            md.extra.setdefault("file_metadata", {})[name] = meta
            for key, h in header.items():
                if h["dtype"] not in _ST_DTYPES:
                    raise CheckpointError(f"{root / name}: tensor {key!r} has dtype {h['dtype']}")
                b, e = h["data_offsets"]
                shape = tuple(h["shape"])
                md.tensors[key] = TensorEntry(
                    dtype=_ST_DTYPES[h["dtype"]],
                    shape=shape,
                    chunks=[Chunk((0,) * len(shape), shape, name, start + b, e - b)],
                )
        super().__init__(root, md)


class TorchDCPReader(_Reader):
    """Reads a folder written by ``torch.distributed.checkpoint.save`` (``.metadata`` plus
    ``*.distcp``), without a process group."""

    kind = "torch-dcp"

    def __init__(self, path: str | os.PathLike) -> None:
        from torch.distributed.checkpoint import FileSystemReader as _TorchReader
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            MetadataIndex,
            TensorStorageMetadata,
        )

        root = Path(path)
        tmd = _TorchReader(str(root)).read_metadata()
        md = Metadata(source="torch-dcp")
        storage = tmd.storage_data
        for fqn, m in tmd.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                chunks = []
                for ch in m.chunks:
                    info = storage[MetadataIndex(fqn, ch.offsets)]
                    if getattr(info, "transform_descriptors", None):
                        raise CheckpointError(
                            f"{root}: {fqn!r} is stored with transforms "
                            f"{info.transform_descriptors}; hp_dcp reads untransformed DCP only"
                        )
                    chunks.append(
                        Chunk(
                            tuple(ch.offsets),
                            tuple(ch.sizes),
                            info.relative_path,
                            info.offset,
                            info.length,
                            encoding="torch_save",
                        )
                    )
                md.tensors[fqn] = TensorEntry(
                    dtype=dtype_name(m.properties.dtype), shape=tuple(m.size), chunks=chunks
                )
            elif isinstance(m, BytesStorageMetadata):
                info = storage[MetadataIndex(fqn)]
                md.objects[fqn] = ObjectEntry(
                    value=StoredObject(
                        info.relative_path, info.offset, info.length, encoding="torch_save"
                    )
                )
        super().__init__(root, md)


def open_checkpoint(checkpoint_id: str | os.PathLike) -> _Reader:
    """A reader for whatever is at ``checkpoint_id``: an hp_dcp folder, a PyTorch DCP folder, a
    safetensors file or folder. Raises a clear error for a missing or unfinished checkpoint."""
    path = Path(checkpoint_id)
    if not path.exists():
        partial = partial_path(path)
        hint = (
            f" A partial save exists at {str(partial)!r}: that save did not finish; load the "
            "previous checkpoint."
            if partial.exists()
            else ""
        )
        raise CheckpointError(f"no checkpoint at checkpoint_id={str(path)!r}.{hint}")
    if path.is_file():
        if path.suffix == ".safetensors":
            return SafetensorsReader(path)
        raise CheckpointError(
            f"checkpoint_id={str(path)!r} is a file; give a checkpoint folder or a "
            ".safetensors file"
        )
    if (path / METADATA_FILE).exists():
        return FileSystemReader(path)
    if (path / ".metadata").exists():
        return TorchDCPReader(path)
    if any(path.glob("*.safetensors")):
        return SafetensorsReader(path)
    if any(path.glob("data_*.bin")) or path.name.endswith(".partial"):
        return FileSystemReader(path)  # raises IncompleteCheckpointError
    raise CheckpointError(
        f"{str(path)!r} holds no checkpoint: expected {METADATA_FILE} (hp_dcp), .metadata "
        "(PyTorch DCP) or *.safetensors files"
    )
