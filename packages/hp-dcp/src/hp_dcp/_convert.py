"""Offline tools over any readable checkpoint (hp_dcp, PyTorch DCP, safetensors), one process,
one tensor in memory at a time: HuggingFace export/import, consolidation, resharding to a target
layout, checksum verification and listing.
"""

from __future__ import annotations

import fnmatch
import json
import numbers
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from hp_dtensor import DTensor, Replicate, Shard, local_shape_and_offset

from ._api import _check_bool, _metadata
from ._codec import encode
from ._meta import Metadata, TensorEntry, element_size, numel
from ._plan import SavePlanner, WriteItem, plan_reads
from ._storage import (
    ST_CODES,
    FileSystemWriter,
    byte_view,
    open_checkpoint,
    torch_dtype,
)
from .errors import CheckpointError, CorruptCheckpointError, DCPTypeError, StateDictError

__all__ = [
    "consolidate",
    "convert",
    "export_hf",
    "save_hf",
    "import_hf",
    "inspect",
    "parse_placements",
    "reshard",
    "verify",
]

NameMap = Mapping[str, str | None] | Callable[[str], str | None] | None
HF_INDEX = "model.safetensors.index.json"


def _check_path(value, arg: str, fn: str) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise DCPTypeError(
            f"{fn}: {arg}={value!r} is a {type(value).__name__}: give a path (a str or "
            "pathlib.Path)"
        )


def _check_name_map(name_map, fn: str) -> None:
    """None, a callable, or a mapping of regex -> new name (or None: drop)."""
    if name_map is None or callable(name_map):
        return
    if not isinstance(name_map, Mapping):
        raise DCPTypeError(
            f"{fn}: name_map is a {type(name_map).__name__}: give a dict of regex -> new name "
            "(or None to drop), a function name -> new name, or None"
        )
    for pat, rep in name_map.items():
        if not isinstance(pat, str) or not (rep is None or isinstance(rep, str)):
            bad = pat if not isinstance(pat, str) else rep
            raise DCPTypeError(
                f"{fn}: name_map[{pat!r}]={rep!r}: {bad!r} is a {type(bad).__name__}; keys are "
                "regex strs, values new-name strs (or None to drop)"
            )
        try:
            re.compile(pat)
        except re.error as e:
            raise StateDictError(
                f"{fn}: name_map pattern {pat!r} is not a regular expression: {e}"
            ) from None


def _check_common(fn: str, *, progress, name_map=None, allow_pickle=False) -> None:
    _check_name_map(name_map, fn)
    _check_bool(progress, "progress", fn)
    _check_bool(allow_pickle, "allow_pickle", fn)


def _check_hf(fn: str, max_shard_bytes, dtype) -> torch.dtype | None:
    """Check the HF export arguments; returns ``dtype`` as a torch.dtype (a str such as
    ``"bfloat16"`` is taken by name)."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, numbers.Real):
        raise DCPTypeError(
            f"{fn}: max_shard_bytes={max_shard_bytes!r} is a {type(max_shard_bytes).__name__}: "
            "give a number of bytes >= 1, e.g. 5 * 2**30"
        )
    if not max_shard_bytes >= 1 or max_shard_bytes == float("inf"):
        raise StateDictError(
            f"{fn}: max_shard_bytes={max_shard_bytes!r}: give a finite number of bytes >= 1"
        )
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(named, torch.dtype):
            return named
        raise StateDictError(
            f"{fn}: dtype={dtype!r} names no torch dtype: give e.g. torch.bfloat16 or 'bfloat16'"
        )
    raise DCPTypeError(
        f"{fn}: dtype={dtype!r} is a {type(dtype).__name__}: give a torch.dtype (e.g. "
        "torch.bfloat16) or None"
    )


def _renamer(name_map: NameMap) -> Callable[[str], str | None]:
    """A function from a name to its new name (None: drop it). A mapping's keys are regular
    expressions matched against the whole name, tried in order; replacements may use groups
    (``r"\\1"``). Names no pattern matches keep their name."""
    if name_map is None:
        return lambda n: n
    if callable(name_map):
        return name_map
    rules = [(re.compile(p), r) for p, r in name_map.items()]

    def rename(name: str) -> str | None:
        for pat, rep in rules:
            m = pat.fullmatch(name)
            if m:
                return None if rep is None else m.expand(rep)
        return name

    return rename


def _full(reader, key: str, entry: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One whole tensor read from its chunks."""
    return _box(reader, key, entry, (0,) * len(entry.shape), tuple(entry.shape), dtype)


def _box(reader, key, entry, offsets, sizes, dtype=None) -> torch.Tensor:
    out = torch.empty(sizes, dtype=dtype or torch_dtype(entry.dtype))
    for item in plan_reads(key, entry, offsets, sizes):
        idx = tuple(
            slice(o - lo, o - lo + s) for o, lo, s in zip(item.offsets, offsets, item.sizes)
        )
        reader.read_into(key, entry, item, out[idx] if idx else out)
    return out


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm  # imported when a tool runs, not with the package

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress)


# ---------------------------------------------------------------------------------------------
# safetensors writing (streamed: the header is known from shapes before any data is read)
# ---------------------------------------------------------------------------------------------


def write_safetensors(
    path: Path,
    entries: list[tuple[str, str, tuple[int, ...]]],
    fetch: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    bar=None,
) -> None:
    """Write ``entries`` (name, dtype name, shape) to a ``.safetensors`` file, asking ``fetch``
    for one tensor at a time. Written under a temporary name, then renamed."""
    header: dict = {}
    pos = 0
    for name, dt, shape in entries:
        if dt not in ST_CODES:
            raise StateDictError(f"tensor {name!r}: dtype {dt} has no safetensors code")
        n = numel(shape) * element_size(dt)
        header[name] = {"dtype": ST_CODES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name, dt, shape in entries:
            t = fetch(name).to(torch_dtype(dt)).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{name!r}: got shape {tuple(t.shape)}, expected {shape}")
            f.write(byte_view(t))
            if bar is not None:
                bar.update(t.numel() * t.element_size())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_hf_shards(dst: Path, plan, fetch, max_shard_bytes: int, progress: bool) -> dict:
    """``plan``: (name, dtype name, shape) in file order; ``fetch(name)`` gives one tensor.
    Writes ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own) and the index."""
    dst.mkdir(parents=True, exist_ok=True)
    shards: list[list] = [[]]
    size = 0
    for p in plan:
        n = numel(p[2]) * element_size(p[1])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += n
    weight_map, total = {}, 0
    with _bar(sum(numel(s) * element_size(d) for _, d, s in plan), "export", progress) as bar:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(dst / fname, shard, fetch, metadata={"format": "pt"}, bar=bar)
            for name, dt, shape in shard:
                weight_map[name] = fname
                total += numel(shape) * element_size(dt)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / HF_INDEX).write_text(json.dumps(index, indent=2))
    return index


def _cast_name(dt: str, dtype) -> str:
    if dtype is not None and torch_dtype(dt).is_floating_point:
        return str(dtype).removeprefix("torch.")
    return dt


def export_hf(
    src,
    dst,
    *,
    name_map: NameMap = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict:
    """Export the tensors of checkpoint ``src`` to HuggingFace safetensors shards
    (``model-0000i-of-0000n.safetensors``) plus ``model.safetensors.index.json`` in folder
    ``dst``, renaming with ``name_map`` and casting floating tensors to ``dtype`` if given.
    Non-tensor values are not exported. One tensor is in memory at a time. Returns the index."""
    _check_path(src, "src", "export_hf")
    _check_path(dst, "dst", "export_hf")
    _check_common("export_hf", progress=progress, name_map=name_map)
    dtype = _check_hf("export_hf", max_shard_bytes, dtype)
    rename = _renamer(name_map)
    with open_checkpoint(src) as reader:
        md = reader.metadata
        plan, old_of = [], {}
        for key, e in md.tensors.items():
            new = rename(key)
            if new is None:
                continue
            if new in old_of:
                raise StateDictError(f"name_map maps {old_of[new]!r} and {key!r} to {new!r}")
            old_of[new] = key
            plan.append((new, _cast_name(e.dtype, dtype), e.shape))
        return _write_hf_shards(
            Path(dst),
            plan,
            lambda new: _full(reader, old_of[new], md.tensors[old_of[new]]),
            max_shard_bytes,
            progress,
        )


def save_hf(
    state_dict: Mapping[str, torch.Tensor],
    dst,
    *,
    name_map: NameMap = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict:
    """Write an in-memory dict of whole (unsharded) tensors as HuggingFace safetensors shards +
    index in ``dst`` (one process; for sharded state save with :func:`hp_dcp.save` and
    :func:`export_hf`). Tensors sharing storage (tied weights) must be given once."""
    if not isinstance(state_dict, Mapping):
        hint = " (pass model.state_dict())" if isinstance(state_dict, torch.nn.Module) else ""
        raise DCPTypeError(
            f"save_hf: state_dict is a {type(state_dict).__name__}: give a dict of name -> "
            f"tensor{hint}"
        )
    _check_path(dst, "dst", "save_hf")
    _check_common("save_hf", progress=progress, name_map=name_map)
    dtype = _check_hf("save_hf", max_shard_bytes, dtype)
    rename = _renamer(name_map)
    plan, by_new = [], {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise StateDictError(f"save_hf: {key!r} is not a plain tensor (gather DTensors first)")
        new = rename(key)
        if new is None:
            continue
        if new in by_new:
            raise StateDictError(f"name_map maps two tensors to {new!r}")
        by_new[new] = t
        plan.append((new, _cast_name(str(t.dtype).removeprefix("torch."), dtype), tuple(t.shape)))
    return _write_hf_shards(
        Path(dst), plan, lambda n: by_new[n].detach().cpu(), max_shard_bytes, progress
    )


def consolidate(src, out, *, name_map: NameMap = None, progress: bool = False) -> None:
    """All tensors of checkpoint ``src``, unsharded, into the single safetensors file ``out``
    (non-tensor values are listed in its ``__metadata__`` but not stored)."""
    _check_path(src, "src", "consolidate")
    _check_path(out, "out", "consolidate")
    _check_common("consolidate", progress=progress, name_map=name_map)
    rename = _renamer(name_map)
    with open_checkpoint(src) as reader:
        md = reader.metadata
        entries, old_of = [], {}
        for key, e in md.tensors.items():
            new = rename(key)
            if new is not None:
                entries.append((new, e.dtype, e.shape))
                old_of[new] = key
        with _bar(
            sum(numel(s) * element_size(d) for _, d, s in entries), "consolidate", progress
        ) as bar:
            write_safetensors(
                Path(out),
                entries,
                lambda new: _full(reader, old_of[new], md.tensors[old_of[new]]),
                metadata={"format": "pt", "hp_dcp_skipped_objects": json.dumps(sorted(md.objects))},
                bar=bar,
            )


# ---------------------------------------------------------------------------------------------
# rewriting into an hp_dcp checkpoint with a target layout
# ---------------------------------------------------------------------------------------------


def parse_placements(text: str) -> tuple:
    """``"S(0)R"`` or ``"Shard(0), Replicate()"`` -> ``(Shard(0), Replicate())``."""
    if not isinstance(text, str):
        raise DCPTypeError(
            f"placements={text!r} is a {type(text).__name__}: write a str with one placement per "
            "mesh dimension as S(<dim>) or R, e.g. 'S(0)R'"
        )
    out = []
    for tok in re.findall(r"S(?:hard)?\((\d+)\)|(R)(?:eplicate\(\))?", text.replace(" ", "")):
        out.append(Shard(int(tok[0])) if tok[0] else Replicate())
    canon = "".join(f"S({p.dim})" if isinstance(p, Shard) else "R" for p in out)
    plain = re.sub(r"Shard\((\d+)\)", r"S(\1)", text.replace(" ", "").replace(",", ""))
    plain = plain.replace("Replicate()", "R")
    if not out or canon != plain:
        raise StateDictError(
            f"placements {text!r}: write one per mesh dimension as S(<dim>) or R, e.g. 'S(0)R'"
        )
    return tuple(out)


def _target_boxes(shape, mesh_shape, placements):
    """Per rank (row-major over the mesh): (offsets, sizes) of its shard. Shard dims beyond the
    tensor's rank (e.g. a scalar step) replicate."""
    pl = tuple(
        p if not isinstance(p, Shard) or p.dim < len(shape) else Replicate() for p in placements
    )
    boxes = []
    for r in range(numel(mesh_shape)):
        coord, rest = [], r
        for s in reversed(mesh_shape):
            coord.append(rest % s)
            rest //= s
        sizes, offs = local_shape_and_offset(shape, mesh_shape, tuple(reversed(coord)), pl)
        boxes.append((tuple(offs), tuple(sizes)))
    return boxes, pl


def _rewrite(
    reader,
    dst,
    *,
    mesh_shape: tuple[int, ...] = (1,),
    rules: Mapping[str, str] | None = None,
    default: str | None = None,
    name_map: NameMap = None,
    progress: bool = False,
    desc: str = "rewrite",
    allow_pickle: bool = False,
) -> Metadata:
    md = reader.metadata
    rename = _renamer(name_map)
    world = numel(mesh_shape)
    default_pl = parse_placements(default) if default else (Replicate(),) * len(mesh_shape)
    rule_pl = [(pat, parse_placements(pl)) for pat, pl in (rules or {}).items()]
    for _, pl in rule_pl + [("", default_pl)]:
        if len(pl) != len(mesh_shape):
            raise StateDictError(
                f"placements {pl} do not match mesh_shape={tuple(mesh_shape)}: give one "
                f"placement per mesh dimension ({len(mesh_shape)})"
            )
    items_by_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    source_of: dict[str, str] = {}
    for key, e in md.tensors.items():
        new = rename(key)
        if new is None:
            continue
        if new in source_of:
            raise StateDictError(f"name_map maps {source_of[new]!r} and {key!r} to {new!r}")
        source_of[new] = key
        pl = next((p for pat, p in rule_pl if fnmatch.fnmatchcase(new, pat)), default_pl)
        boxes, pl = _target_boxes(e.shape, mesh_shape, pl)
        text = "".join(str(p) for p in pl) + f" on mesh {tuple(mesh_shape)}"
        for r, (offs, sizes) in enumerate(boxes):
            nbytes = numel(sizes) * element_size(e.dtype)
            items_by_rank[r].append(
                WriteItem(
                    new, "tensor", nbytes, e.dtype, tuple(e.shape), offs, sizes, placements=text
                )
            )
    obj_src: dict[tuple, tuple[str, object]] = {}
    for key, o in md.objects.items():
        new = rename(key)
        if new is None:
            continue
        held = {0: o.value} if o.value is not None else o.per_rank
        for r, stored in held.items():
            if r < world:
                blob = None
                if stored.encoding != "json":  # PyTorch DCP's (or old pickles): as data
                    value = reader.read_object(key, stored, allow_pickle=allow_pickle)
                    blob = encode(value)
                nbytes = stored.nbytes if blob is None else len(blob)
                it = WriteItem(new, "object", nbytes, digest=hash((r, len(held))))
                items_by_rank[r].append(it)
                obj_src[(r, new)] = (key, stored, blob)
    plan = SavePlanner().plan(items_by_rank)
    writer = FileSystemWriter(dst)
    writer.prepare()
    total = sum(it.nbytes for items in plan for it in items)

    def data(rank: int, items: list[WriteItem]) -> Iterator:
        for it in items:
            if it.kind == "tensor":
                src = source_of[it.key]
                t = _box(reader, src, md.tensors[src], it.offsets, it.sizes)
            else:
                key, stored, blob = obj_src[(rank, it.key)]
                if blob is None:
                    t = bytes(reader.read_bytes(stored.file, stored.offset, stored.nbytes))
                else:
                    t = blob
            bar.update(it.nbytes)
            yield it, t

    results = []
    with _bar(total, desc, progress) as bar:
        try:
            for r in range(world):
                results.append(writer.write(r, data(r, plan[r])))
            out = _metadata(results, world)
            out.extra["converted_from"] = md.source
            writer.commit(out)
        except BaseException:
            writer.abort()
            raise
    return out


def import_hf(src, dst, *, name_map: NameMap = None, progress: bool = False) -> Metadata:
    """A HuggingFace safetensors checkpoint (file or folder) as an hp_dcp checkpoint in ``dst``
    (one process, tensors renamed by ``name_map``), streaming one tensor at a time."""
    _check_path(src, "src", "import_hf")
    _check_path(dst, "dst", "import_hf")
    _check_common("import_hf", progress=progress, name_map=name_map)
    with open_checkpoint(src) as reader:
        return _rewrite(reader, dst, name_map=name_map, progress=progress, desc="import")


def convert(
    src,
    dst,
    *,
    to: str,
    name_map: NameMap = None,
    progress: bool = False,
    allow_pickle: bool = False,
    **kwargs,
):
    """Convert checkpoint ``src`` (hp_dcp, PyTorch DCP or safetensors) into ``dst``:
    ``to="hf"`` (safetensors shards + index; see :func:`export_hf` for ``kwargs``) or
    ``to="dcp"`` (an hp_dcp checkpoint written by one process, its values stored as data;
    ``allow_pickle`` reads an old checkpoint's pickled values, only for one you trust)."""
    _check_path(src, "src", "convert")
    _check_path(dst, "dst", "convert")
    if to not in ("hf", "dcp"):
        raise StateDictError(f"convert: to={to!r}: use 'hf' or 'dcp'")
    _check_common("convert", progress=progress, name_map=name_map, allow_pickle=allow_pickle)
    if to == "hf":
        return export_hf(src, dst, name_map=name_map, progress=progress, **kwargs)
    if to == "dcp":
        if kwargs:
            raise DCPTypeError(
                f"convert(to='dcp') takes no {sorted(kwargs)}: those are export_hf's (to='hf')"
            )
        with open_checkpoint(src) as reader:
            return _rewrite(
                reader,
                dst,
                name_map=name_map,
                progress=progress,
                desc="convert",
                allow_pickle=allow_pickle,
            )
    raise AssertionError(to)  # checked above


def reshard(
    src,
    dst,
    *,
    mesh_shape: Iterable[int],
    placements: str = "S(0)",
    rules: Mapping[str, str] | None = None,
    progress: bool = False,
    allow_pickle: bool = False,
) -> Metadata:
    """Rewrite checkpoint ``src`` offline into ``dst`` laid out as a job with ``mesh_shape``
    would save it: each tensor gets the placements of the first ``rules`` pattern (fnmatch on
    its name) it matches, else ``placements``; rank ``r``'s shards land in its own data file,
    so loading with that layout reads one contiguous range per tensor."""
    fn = "reshard"
    _check_path(src, "src", fn)
    _check_path(dst, "dst", fn)
    _check_common(fn, progress=progress, allow_pickle=allow_pickle)
    if isinstance(mesh_shape, (str, bytes)) or not hasattr(mesh_shape, "__iter__"):
        raise DCPTypeError(
            f"{fn}: mesh_shape={mesh_shape!r} is a {type(mesh_shape).__name__}: give a tuple of "
            "positive ints, e.g. (2,) or (2, 4)"
        )
    mesh_shape = tuple(mesh_shape)
    for i, n in enumerate(mesh_shape):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise DCPTypeError(
                f"{fn}: mesh_shape[{i}]={n!r} is a {type(n).__name__}: give a positive int"
            )
        if n < 1:
            raise StateDictError(f"{fn}: mesh_shape[{i}]={n!r}: give a positive int")
    if not mesh_shape:
        raise StateDictError(f"{fn}: mesh_shape=(): give at least one mesh dimension, e.g. (2,)")
    mesh_shape = tuple(int(n) for n in mesh_shape)
    if placements is not None and placements != "":  # empty: replicate everything
        parse_placements(placements)
    if rules is not None:
        if not isinstance(rules, Mapping):
            raise DCPTypeError(
                f"{fn}: rules is a {type(rules).__name__}: give a dict of fnmatch pattern -> "
                "placements str, e.g. {'*.norm.*': 'R'}"
            )
        for pat, pl in rules.items():
            if not isinstance(pat, str):
                raise DCPTypeError(f"{fn}: rules key {pat!r} is a {type(pat).__name__}: give a str")
            parse_placements(pl)
    with open_checkpoint(src) as reader:
        return _rewrite(
            reader,
            dst,
            mesh_shape=mesh_shape,
            rules=rules,
            default=placements,
            progress=progress,
            desc="reshard",
            allow_pickle=allow_pickle,
        )


def verify(src, *, progress: bool = False, allow_pickle: bool = False) -> list[str]:
    """Read every stored byte of ``src`` and check it against its checksum, and every value as
    data (a pickled one is a problem unless ``allow_pickle``, for a checkpoint you trust).
    Returns one line per problem (empty when the checkpoint is sound): the file, byte range
    and key."""
    _check_path(src, "src", "verify")
    _check_common("verify", progress=progress, allow_pickle=allow_pickle)
    problems = []
    with open_checkpoint(src) as reader:
        md = reader.metadata
        total = sum(c.nbytes for e in md.tensors.values() for c in e.chunks)
        with _bar(total, "verify", progress) as bar:
            for key, e in md.tensors.items():
                for c in e.chunks:
                    try:
                        part = TensorEntry(e.dtype, e.shape, [c])
                        _box(reader, key, part, c.offsets, c.sizes)
                    except (CheckpointError, RuntimeError) as err:
                        problems.append(str(err))
                    bar.update(c.nbytes)
            for key, o in md.objects.items():
                for stored in [o.value] if o.value is not None else list(o.per_rank.values()):
                    try:
                        reader.read_object(key, stored, allow_pickle=allow_pickle)
                    except CorruptCheckpointError as err:
                        problems.append(str(err))
                    except Exception as err:  # noqa: BLE001 - reported, not raised
                        problems.append(f"{key!r}: cannot read the stored value: {err}")
    return problems


def inspect(src) -> str:
    """A table of the checkpoint's tensors (dtype, shape, placements, chunks, bytes) and
    values."""
    _check_path(src, "src", "inspect")
    with open_checkpoint(src) as reader:
        md = reader.metadata
    lines = [f"{src}: {md.source}, saved by {md.world_size} rank(s)"]
    rows = [("key", "dtype", "shape", "placements", "chunks", "bytes")]
    for key, e in md.tensors.items():
        rows.append(
            (
                key,
                e.dtype,
                "x".join(map(str, e.shape)) or "scalar",
                e.placements or "-",
                str(len(e.chunks)),
                str(e.nbytes),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for key, o in md.objects.items():
        how = "one value" if o.value is not None else f"per rank {sorted(o.per_rank)}"
        stored = o.value if o.value is not None else next(iter(o.per_rank.values()))
        enc = {"json": "data", "torch_save": "torch.save", "pickle": "pickle, not read"}
        lines.append(f"{key}  (value, {how}, {enc.get(stored.encoding, stored.encoding)})")
    total = sum(e.nbytes for e in md.tensors.values())
    lines.append(f"{len(md.tensors)} tensors, {len(md.objects)} values, {total} bytes")
    return "\n".join(lines)
