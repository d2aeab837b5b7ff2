"""``save``, ``load`` and ``async_save``.

A save is two exchanges among the ranks: (1) every rank's description of what it holds (one
``all_gather_object``), after which every rank runs the same deterministic planner and knows
what it writes; (2) after writing, every rank's write results, from which rank 0 builds the
metadata and commits. Rank 0 then broadcasts the outcome, so a failure on any rank raises on
every rank and nothing is committed. Errors in the state dict travel in exchange (1) and raise
on every rank before any byte is written.

A load needs no communication: each rank reads the metadata and exactly the pieces its state
dict needs, into its tensors in place.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import DTensor

from ._codec import CodecError, encode
from ._flatten import flatten
from ._meta import Chunk, Metadata, ObjectEntry, StoredObject, TensorEntry
from ._plan import ReadItem, SavePlanner, WriteItem, plan_reads
from ._storage import FileSystemWriter, HostStaging, dtype_name, open_checkpoint
from .errors import CheckpointError, DCPTypeError, StateDictError

__all__ = ["LoadPlanner", "async_save", "load", "save"]

log = logging.getLogger("hp_dcp")


class LoadPlanner:
    """Decides what to read for each tensor. ``allow_partial_load=True`` leaves keys the
    checkpoint lacks untouched instead of raising."""

    def __init__(self, *, allow_partial_load: bool = False) -> None:
        _check_bool(allow_partial_load, "allow_partial_load", "LoadPlanner")
        self.allow_partial_load = allow_partial_load

    def plan(self, key: str, entry: TensorEntry, offsets, sizes) -> list[ReadItem]:
        """The stored pieces covering the box ``offsets``/``sizes`` of tensor ``key``."""
        return plan_reads(key, entry, offsets, sizes)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _check_bool(value, arg: str, fn: str) -> None:
    if not isinstance(value, bool):
        raise DCPTypeError(f"{fn}: {arg}={value!r} must be True or False")


def _check_args(fn: str, checkpoint_id, planner, planner_cls, *, path: bool = True) -> None:
    """The arguments every rank checks alike before any collective (``path``: the storage is
    opened from ``checkpoint_id``, not given as a writer/reader)."""
    if path and not isinstance(checkpoint_id, (str, os.PathLike)):
        raise DCPTypeError(
            f"{fn}: checkpoint_id={checkpoint_id!r} is a {type(checkpoint_id).__name__}: give "
            "the checkpoint's path (a str or pathlib.Path)"
        )
    if planner is not None and not isinstance(planner, planner_cls):
        what = (
            f"the class {planner.__name__}, not an instance"
            if isinstance(planner, type)
            else f"a {type(planner).__name__}"
        )
        raise DCPTypeError(
            f"{fn}: planner is {what}: give a {planner_cls.__name__}(...) instance (or None)"
        )


def _group(process_group):
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise StateDictError("process_group given but torch.distributed is not initialized")
        return None, 0, 1
    return process_group, dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_gather(obj, group, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj, group, world):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _placements(spec) -> str:
    pl = "".join(str(p) for p in spec.placements)
    return f"{pl} on mesh {tuple(spec.mesh.shape)}"


def _local_box(v: torch.Tensor, key: str):
    """``(local tensor, offsets, sizes, placements)``; local is None when this rank holds none."""
    if isinstance(v, DTensor):
        spec = v._spec
        if spec.has_partial():
            raise StateDictError(
                f"state_dict key {key!r} is a Partial DTensor ({_placements(spec)}): reduce it "
                "(redistribute to Replicate or Shard) before saving"
            )
        if spec.mesh.get_coordinate() is None:
            return None, (), (), ""
        sizes, offsets = spec.local_shape_and_offset()
        return v._local.detach(), tuple(offsets), tuple(sizes), _placements(spec)
    return v.detach(), (0,) * v.ndim, tuple(v.shape), ""


def _describe(leaves) -> tuple[list[WriteItem], dict]:
    items, data = [], {}
    for key, leaf in leaves.items():
        v = leaf.value
        if isinstance(v, torch.Tensor):
            local, offsets, sizes, pl = _local_box(v, key)
            if local is None:
                continue
            it = WriteItem(
                key,
                "tensor",
                local.numel() * local.element_size(),
                dtype=dtype_name(v.dtype),
                shape=tuple(v.shape),
                offsets=offsets,
                sizes=sizes,
                placements=pl,
            )
            data[it.box] = local
        else:
            try:
                blob = encode(v)  # data, never code: loading cannot run anything
            except CodecError as e:
                raise StateDictError(f"state_dict key {key!r}: {e}") from None
            it = WriteItem(key, "object", len(blob), digest=zlib.crc32(blob))
            data[it.box] = blob
        items.append(it)
    return items, data


def _plan_save(state_dict, writer, planner, group, rank, world):
    """Exchange (1). Returns this rank's ``[(item, data)]``."""
    try:
        leaves, _ = flatten(state_dict)
        items, data = _describe(leaves)
        if rank == 0:
            writer.prepare()
        mine: Any = items
    except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised below
        mine, data = e, {}
    gathered = _all_gather(mine, group, world)
    errors = [(r, g) for r, g in enumerate(gathered) if isinstance(g, BaseException)]
    if errors:
        if rank == 0:
            writer.abort()
        r, e = errors[0]
        if r == rank:
            raise e
        raise (
            type(e)(f"rank {r}: {e}")
            if isinstance(e, StateDictError)
            else CheckpointError(f"rank {r} failed before writing: {type(e).__name__}: {e}")
        )
    try:
        plan = (planner or SavePlanner()).plan(gathered)  # the same outcome on every rank
    except Exception:
        if rank == 0:
            writer.abort()
        raise
    return [(it, data[it.box]) for it in plan[rank]]


def _to_cpu(d):
    if isinstance(d, torch.Tensor):
        return d.contiguous() if d.device.type == "cpu" else d.cpu()
    return d


def _host_items(mine):
    """``(item, host data)`` in order. Pieces on a GPU are copied to pinned buffers on a side
    stream one piece ahead, so each device-to-host copy overlaps the write of the piece before
    it (the writer consumes a piece before asking for the next)."""
    on_gpu = [
        isinstance(d, torch.Tensor)
        and d.device.type == "cuda"
        and 0 < it.nbytes <= HostStaging.MAX_BYTES
        for it, d in mine
    ]
    if not any(on_gpu):
        for it, d in mine:
            yield it, _to_cpu(d)
        return
    staging, stream = HostStaging(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def start(i):
        it, d = mine[i]
        if not on_gpu[i]:
            return it, _to_cpu(d), None
        u8, slot = staging.take(it.nbytes)
        host = u8.view(d.dtype).view(d.shape)
        with torch.cuda.stream(stream):
            host.copy_(d, non_blocking=True)
        staging.record(slot, stream)
        return it, host, slot

    ahead = start(0) if mine else None
    for i in range(len(mine)):
        it, host, slot = ahead
        ahead = start(i + 1) if i + 1 < len(mine) else None
        if slot is not None:
            staging.wait(slot)
        yield it, host


def _metadata(results_by_rank, world) -> Metadata:
    md = Metadata(world_size=world)
    objs: dict[str, list] = {}
    for r, res in enumerate(results_by_rank):
        for it, file, off, n, crc in res:
            if it.kind == "tensor":
                e = md.tensors.get(it.key)
                if e is None:
                    e = md.tensors[it.key] = TensorEntry(
                        it.dtype, it.shape, placements=it.placements
                    )
                e.chunks.append(Chunk(it.offsets, it.sizes, file, off, n, crc))
            else:
                objs.setdefault(it.key, []).append((r, StoredObject(file, off, n, crc)))
    for key, held in objs.items():
        md.objects[key] = (
            ObjectEntry(value=held[0][1]) if len(held) == 1 else ObjectEntry(per_rank=dict(held))
        )
    return md


def _write_commit(writer, mine, group, rank, world) -> Metadata:
    """Write, exchange (2), commit on rank 0, broadcast the outcome."""
    try:
        res: Any = writer.write(rank, _host_items(mine))
    except Exception as e:  # noqa: BLE001 - reported to rank 0, raised on every rank
        res = f"{type(e).__name__}: {e}"
    results = _all_gather(res, group, world)
    outcome = None
    md = None
    if rank == 0:
        failed = [(r, x) for r, x in enumerate(results) if isinstance(x, str)]
        if failed:
            writer.abort()
            outcome = "; ".join(f"rank {r} failed to write: {x}" for r, x in failed)
        else:
            try:
                md = _metadata(results, world)
                writer.commit(md)
            except Exception as e:  # noqa: BLE001
                writer.abort()
                outcome = f"rank 0 failed to commit: {type(e).__name__}: {e}"
    outcome = _broadcast(outcome, group, world)
    if outcome is not None:
        raise CheckpointError(
            f"save to {str(getattr(writer, 'path', '?'))!r} failed, nothing was committed "
            f"(the previous checkpoint there, if any, is untouched): {outcome}"
        )
    return md if md is not None else Metadata(world_size=world)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def save(
    state_dict: dict,
    *,
    checkpoint_id: str | Path,
    process_group=None,
    planner: SavePlanner | None = None,
    storage_writer: FileSystemWriter | None = None,
) -> Metadata:
    """Save ``state_dict`` (a collective over ``process_group``, default: all ranks).

    Values may be tensors, hp ``DTensor``s (each rank writes its shard; replicated pieces are
    written once, by one rank, balancing bytes), nested dicts/lists of them, objects with
    ``state_dict()``/``load_state_dict()`` and any picklable value (stored once when equal on
    every rank, per rank otherwise). The folder ``checkpoint_id`` appears only once complete.
    Returns the committed metadata on rank 0 (an empty one elsewhere).
    """
    _check_args("save", checkpoint_id, planner, SavePlanner, path=storage_writer is None)
    _SAVER.wait()
    writer = storage_writer or FileSystemWriter(checkpoint_id)
    group, rank, world = _group(process_group)
    mine = _plan_save(state_dict, writer, planner, group, rank, world)
    return _write_commit(writer, mine, group, rank, world)


def load(
    state_dict: dict,
    *,
    checkpoint_id: str | Path,
    process_group=None,
    planner: LoadPlanner | None = None,
    storage_reader=None,
    allow_pickle: bool = False,
) -> None:
    """Load a checkpoint into ``state_dict`` in place, in whatever sharding its tensors have.
    Values are read as data (never code); ``allow_pickle=True`` also reads the pickled values
    of checkpoints written before hp-dcp stored them as data, with a warning: only for
    checkpoints you trust, since unpickling can run code.

    ``checkpoint_id`` may be an hp_dcp folder, a PyTorch DCP folder, or HuggingFace safetensors
    (a file or a folder of shards). Each rank reads only the pieces it needs. Raises
    :class:`StateDictError` naming the key for a tensor the checkpoint lacks or whose shape
    differs, before reading anything; :class:`CorruptCheckpointError` naming file and key when
    bytes fail their checksum. No communication.
    """
    _check_args("load", checkpoint_id, planner, LoadPlanner, path=storage_reader is None)
    _check_bool(allow_pickle, "allow_pickle", "load")
    planner = planner or LoadPlanner()
    _, rank, _ = _group(process_group)
    reader = storage_reader or open_checkpoint(checkpoint_id)
    md = reader.metadata
    leaves, statefuls = flatten(state_dict)
    tasks, objects, missing = [], [], []
    for key, leaf in leaves.items():
        v = leaf.value
        if isinstance(v, torch.Tensor):
            entry = md.tensors.get(key)
            if entry is None:
                missing.append(key)
                continue
            if tuple(entry.shape) != tuple(v.shape):
                raise StateDictError(
                    f"shape mismatch for {key!r}: the checkpoint has {tuple(entry.shape)}, the "
                    f"state dict {tuple(v.shape)}"
                )
            local, offsets, sizes, _ = _local_box(v, key)
            if local is None:
                continue
            tasks.append((key, entry, local, offsets, planner.plan(key, entry, offsets, sizes)))
        else:
            entry = md.objects.get(key)
            if entry is None:
                missing.append(key)
                continue
            stored = entry.value if entry.value is not None else entry.per_rank.get(rank)
            if stored is None:
                raise StateDictError(
                    f"{key!r} was saved per rank by ranks {sorted(entry.per_rank)}; rank {rank} "
                    "has no value of its own: drop the key or load with the same ranks"
                )
            objects.append((leaf, key, stored))
    if missing and not planner.allow_partial_load:
        raise StateDictError(_missing_message(checkpoint_id, md, missing))
    with reader:
        for key, entry, local, offsets, reads in tasks:
            for item in reads:
                idx = tuple(
                    slice(o - lo, o - lo + s) for o, lo, s in zip(item.offsets, offsets, item.sizes)
                )
                reader.read_into(key, entry, item, local[idx] if idx else local)
        for leaf, key, stored in objects:
            leaf.set(reader.read_object(key, stored, allow_pickle=allow_pickle))
    for obj, sd in statefuls:
        obj.load_state_dict(sd)


def _missing_message(checkpoint_id, md: Metadata, missing: list[str]) -> str:
    known = list(md.tensors) + list(md.objects)
    lines = []
    for key in missing[:5]:
        hint = difflib.get_close_matches(key, known, n=1)
        kind = " (stored as a non-tensor value)" if key in md.objects else ""
        kind = " (stored as a tensor)" if key in md.tensors else kind
        lines.append(f"{key!r}{kind}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    return (
        f"checkpoint {str(checkpoint_id)!r} lacks {', '.join(lines)}{more}: pass "
        "planner=LoadPlanner(allow_partial_load=True) to leave such keys as they are"
    )


# ---------------------------------------------------------------------------------------------
# async save
# ---------------------------------------------------------------------------------------------


class _AsyncSaver:
    """One background writer thread, the staging buffer it reuses, and a gloo group per process
    group for the background exchanges (so they never interleave with the training loop's)."""

    def __init__(self) -> None:
        self.executor: ThreadPoolExecutor | None = None
        self.pending: Future | None = None
        self.buffer: torch.Tensor | None = None
        self.groups: dict = {}
        self.lock = threading.Lock()

    def wait(self) -> None:
        """Block until the previous async save is committed (its error stays in its future)."""
        fut, self.pending = self.pending, None
        if fut is not None:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - the caller of async_save sees it
                log.warning("the previous async_save failed: %s", e)

    def background_group(self, group, world):
        if world == 1:
            return None
        key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        if key not in self.groups:
            local = group is not None and len(key) < dist.get_world_size()
            self.groups[key] = dist.new_group(
                list(key), backend="gloo", use_local_synchronization=local
            )
        return self.groups[key]

    def stage(self, mine):
        """Copy this rank's tensors into the reused (pinned, with CUDA) staging buffer."""
        align = 64
        total = sum(-(-it.nbytes // align) * align for it, d in mine if it.kind == "tensor")
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = torch.empty(
                max(total, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        out, pos, cuda = [], 0, False
        for it, d in mine:
            if it.kind != "tensor":
                out.append((it, d))
                continue
            n = it.nbytes
            dst = self.buffer[pos : pos + n]
            if d.numel():
                view = dst.view(d.dtype).view(d.shape)
                view.copy_(d, non_blocking=d.device.type == "cuda")
                cuda |= d.device.type == "cuda"
            out.append((it, dst.view(d.dtype).view(d.shape) if d.numel() else d.cpu()))
            pos += -(-n // align) * align
        if cuda:
            torch.cuda.synchronize()
        return out


_SAVER = _AsyncSaver()


def async_save(
    state_dict: dict,
    *,
    checkpoint_id: str | Path,
    process_group=None,
    planner: SavePlanner | None = None,
    storage_writer: FileSystemWriter | None = None,
) -> Future:
    """Like :func:`save`, but returns once this rank's data is copied to a staging buffer;
    writing and committing continue in a background thread. Returns a
    ``concurrent.futures.Future`` whose ``result()`` is the metadata (or raises).

    The staging buffer (pinned memory with CUDA) is reused between saves, so a new
    ``async_save`` (or ``save``) first waits for the previous one to commit.
    """
    _check_args("async_save", checkpoint_id, planner, SavePlanner, path=storage_writer is None)
    with _SAVER.lock:
        _SAVER.wait()
        writer = storage_writer or FileSystemWriter(checkpoint_id)
        group, rank, world = _group(process_group)
        bg = _SAVER.background_group(group, world)
        mine = _plan_save(state_dict, writer, planner, group, rank, world)
        staged = _SAVER.stage(mine)
        if _SAVER.executor is None:
            _SAVER.executor = ThreadPoolExecutor(1, thread_name_prefix="hp-dcp-save")
        fut = _SAVER.executor.submit(_write_commit, writer, staged, bg, rank, world)
        _SAVER.pending = fut
        return fut
