"""One-sided collectives over symmetric memory, for the ranks of one host.

Same argument order as ``torch.distributed``. Each call on CPU tensors:

1. writes a descriptor (op, dtype, sizes, split sizes, call number) and its input into its own
   slot of a per-group shared workspace, then arrives at a barrier;
2. checks every rank's descriptor (a mismatch raises the same error on every rank, naming the
   ranks and the argument) and grows the workspace collectively when some input did not fit;
3. reads what it needs straight from the peers' slots (copies, or reductions accumulating in
   float32) and arrives at a closing barrier, after which the slots may be reused.

So an all-gather moves each byte through memory twice (into the slot, out of it), where gloo
sends it through a socket. CUDA tensors take the same path over PyTorch's symmetric memory
(peer buffers reached over NVLink, copies done by the copy engines) when it is available.
"""

from __future__ import annotations

import atexit
import math
import operator
import os

import torch
import torch.distributed as dist

from . import _dtypes
from ._checks import check_group, is_tensor_on
from ._ext import load
from .errors import KernelsTypeError, KernelsValueError
from .symm_mem import SymmetricMemory, _require_contiguous, by_uid, empty, find

__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "release_workspaces",
]

_OPS = {
    "all_gather": 1,
    "all_to_all": 2,
    "reduce_scatter": 3,
    "all_reduce": 4,
    "mc2_ag": 5,
    "mc2_rs": 6,
}
_OP_NAMES = {v: k for k, v in _OPS.items()}
# Descriptor words: 0 op, 1 dtype, 2 numel in, 3 numel out, 4 wire dtype, 5 reduce op,
# 6 bytes needed, 7 call number, 8 row numel, 9 input address (for single-copy reads),
# 10 uid of the symmetric allocation holding the input (0: none), 11 its byte offset there,
# 12..15 op-specific; then split sizes in, out.
(
    _D_OP,
    _D_DTYPE,
    _D_NIN,
    _D_NOUT,
    _D_WIRE,
    _D_ROP,
    _D_NEED,
    _D_SEQ,
    _D_ROW,
    _D_ADDR,
    _D_SYM,
    _D_SYMOFF,
    _D_OPARG,  # op-specific, unused so far
    _D_ERR,
) = range(14)
_HEAD = 16


def _threads() -> int:
    return int(os.environ.get("HP_KERNELS_THREADS", "1"))


class _Workspace:
    """The shared slots of one group, grown collectively when a call needs more room."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.mem: SymmetricMemory | None = None
        self.seq = 0
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.cma = False  # single-copy reads from the peers' memory (decided on first use)

    def first_use(self, need: int) -> None:
        """Size the workspace, and find out whether every rank may read its peers' memory
        directly (Linux cross-memory attach: same user, ptrace allowed). Collective."""
        probe = torch.tensor([7_000_000 + self.rank], dtype=torch.int64)
        mine = (need, os.getpid(), probe.data_ptr())
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        ok = False
        if os.environ.get("HP_KERNELS_CMA", "1") != "0":
            peer = (self.rank + 1) % self.world
            got = torch.zeros(1, dtype=torch.int64)
            err = load().cma_read(everyone[peer][1], got.data_ptr(), everyone[peer][2], 8)
            ok = err == 0 and int(got) == 7_000_000 + peer
        oks: list = [None] * self.world
        dist.all_gather_object(oks, ok, group=self.group)  # probe stays alive until here
        self.cma = all(oks)
        self.grow(max(e[0] for e in everyone))

    def capacity(self) -> int:
        return 0 if self.mem is None else self.mem.nbytes

    def grow(self, needed: int) -> SymmetricMemory:
        """Collective: every rank calls it with the same ``needed`` (the largest request)."""
        size = max(needed, 2 * self.capacity(), 1 << 16)
        size = 1 << (size - 1).bit_length() if size < (1 << 26) else -(-size // (1 << 24)) << 24
        old, self.mem = self.mem, None  # a failed allocation must not leave a closed handle
        if old is not None:
            old.close()
        self.mem = empty((size,), torch.uint8, group=self.group)
        return self.mem


_workspaces: dict[int, tuple[dist.ProcessGroup, _Workspace]] = {}


def _workspace(group: dist.ProcessGroup | None, name: str = "hp_kernels.comm") -> _Workspace:
    check_group(name, group)
    if not dist.is_initialized():
        raise RuntimeError("hp_kernels.comm needs torch.distributed to be initialized")
    group = group if group is not None else dist.group.WORLD
    entry = _workspaces.get(id(group))
    if entry is None or entry[0] is not group:
        entry = (group, _Workspace(group))
        _workspaces[id(group)] = entry
    return entry[1]


def release_workspaces() -> None:
    """Drop the cached shared workspaces (each is freed once every rank dropped it). Runs at
    exit too: a workspace holds its process group, and a group left to the interpreter's
    final teardown (after ``destroy_process_group``, with gloo work done on it) aborted the
    process now and then ("terminate called without an active exception")."""
    for _, ws in _workspaces.values():
        if ws.mem is not None:
            ws.mem.close()
    _workspaces.clear()


atexit.register(release_workspaces)


class _Call:
    """One collective call: descriptor exchange, fit check, data phase, closing barrier."""

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        *,
        dtype: torch.dtype,
        n_in: int,
        n_out: int,
        need: int,
        wire: torch.dtype | None = None,
        rop: int = 0,
        row: int = 0,
        addr: int = 0,
        sym: tuple[SymmetricMemory, int] | None = None,
        splits_in: list[int] | None = None,
        splits_out: list[int] | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.c = load()
        self.ws = _workspace(group)
        self.name = name
        self.world, self.rank = self.ws.world, self.ws.rank
        self.ws.seq += 1
        desc = [0] * (_HEAD + 2 * self.world)
        desc[_D_OP] = _OPS[name]
        desc[_D_DTYPE] = _dtypes.CODES.get(dtype, -1)
        desc[_D_NIN], desc[_D_NOUT] = n_in, n_out
        desc[_D_WIRE] = -1 if wire is None else _dtypes.CODES[wire]
        desc[_D_ROP], desc[_D_NEED], desc[_D_SEQ] = rop, need, self.ws.seq
        desc[_D_ROW], desc[_D_ADDR] = row, addr
        self.sym = sym
        if sym is not None:
            desc[_D_SYM], desc[_D_SYMOFF] = sym[0].uid, sym[1]
        if splits_in is not None:
            desc[_HEAD : _HEAD + self.world] = splits_in
        if splits_out is not None:
            desc[_HEAD + self.world :] = splits_out
        self.error = error
        if error is not None:  # published, so that every rank raises instead of waiting
            desc[_D_ERR], desc[_D_NEED] = 1, 0
            need = 0
        self.desc = desc
        self.need = need

    # The first call on a group has no workspace yet: size it with one object exchange.
    def start(self, write, between=None) -> list[list[int]]:
        """Publish the descriptor (and the data when it fits), exchange, check, return all
        descriptors. ``write(mem)`` writes this rank's input into its slot; it may return a
        handle with ``wait()`` (a native copy), in which case ``between()`` runs meanwhile."""
        ws = self.ws
        if ws.mem is None:
            ws.first_use(self.need)
        mem = ws.mem
        assert mem is not None
        fits = self.need <= mem.nbytes
        self._publish(mem)
        ok = self.error is None
        pending = write(mem) if fits and ok else None
        if between is not None and ok:
            between()
        if pending is not None:
            pending.wait()
        mem.barrier()
        descs = self._read_all(mem)
        self._check_same_call(descs, check_types=False)  # out of step: nothing to recover
        try:
            bad = [r for r, d in enumerate(descs) if d[_D_ERR]]
            if bad:  # no data moved; every rank leaves the call together
                if self.error is not None:
                    raise self.error
                raise KernelsValueError(
                    f"{self.name}: rank(s) {bad} passed invalid arguments (their own error says "
                    f"which); rank {self.rank} gives up the call too, and no data moved"
                )
            self._check_same_call(descs)
        except (TypeError, ValueError):
            # every rank raises here; meet once more so that no rank's next descriptor
            # overwrites this one while a slower rank still reads it
            mem.barrier()
            raise
        biggest = max(d[_D_NEED] for d in descs)
        if biggest > mem.nbytes:  # someone did not fit: everyone grows, then writes again
            mem = ws.grow(biggest)
            self._publish(mem)
            pending = write(mem)
            if pending is not None:
                pending.wait()
            mem.barrier()
        self.mem = mem
        return descs

    def finish(self) -> None:
        self.mem.barrier()  # peers are done reading our slot: it may be reused

    def _publish(self, mem: SymmetricMemory) -> None:
        t = torch.tensor(self.desc, dtype=torch.int64)
        self.c.copy(mem.desc_addr(self.rank), t.data_ptr(), 8 * len(self.desc))

    def _read_all(self, mem: SymmetricMemory) -> list[list[int]]:
        out = torch.empty((self.world, len(self.desc)), dtype=torch.int64)
        for r in range(self.world):
            self.c.copy(out[r].data_ptr(), mem.desc_addr(r), 8 * len(self.desc))
        return out.tolist()

    def _check_same_call(self, descs: list[list[int]], check_types: bool = True) -> None:
        mine = descs[self.rank]
        for r, d in enumerate(descs):
            if d[_D_SEQ] != mine[_D_SEQ] or d[_D_OP] != mine[_D_OP]:
                raise RuntimeError(
                    f"hp_kernels.comm: rank {r} is in call #{d[_D_SEQ]} "
                    f"({_OP_NAMES.get(d[_D_OP], '?')}) while rank {self.rank} is in call "
                    f"#{mine[_D_SEQ]} ({self.name}) on the same group: every rank must issue the "
                    "same collectives in the same order"
                )
        if not check_types:
            return
        first = descs[0]
        for r, d in enumerate(descs):
            if (d[_D_DTYPE], d[_D_WIRE], d[_D_ROP]) != (
                first[_D_DTYPE],
                first[_D_WIRE],
                first[_D_ROP],
            ):
                raise KernelsTypeError(
                    f"{self.name}: ranks disagree on dtype/op: rank 0 has dtype "
                    f"{_dtypes.from_code(first[_D_DTYPE])}, wire {_wire_name(first[_D_WIRE])}, "
                    f"op {first[_D_ROP]}; rank {r} has dtype {_dtypes.from_code(d[_D_DTYPE])}, "
                    f"wire {_wire_name(d[_D_WIRE])}, op {d[_D_ROP]}"
                )

    def slot(self, rank: int) -> int:
        return self.mem.buffer_addr(rank)

    def peer_symmetric(self, desc: list[int], peer: int) -> int | None:
        """Address (here) of ``peer``'s input when it lies in a symmetric allocation this rank
        shares with it (then it is read in place: no copy into a slot, no cross-process read)."""
        if desc[_D_SYM] == 0:
            return None
        mem = by_uid(desc[_D_SYM])
        if mem is None:
            raise RuntimeError(
                f"{self.name}: rank {peer}'s input lies in a symmetric allocation that rank "
                f"{self.rank} has closed; keep the allocation open on every rank while it is used"
            )
        return mem.buffer_addr(peer) + desc[_D_SYMOFF]

    def stage(self, mem: SymmetricMemory, ptr: int, nbytes: int) -> None:
        """Copy this rank's input into its slot, unless peers read it where it is (in place
        from symmetric memory, or by cross-process reads)."""
        if not (self.ws.cma or self.sym is not None):
            self.c.copy(mem.buffer_addr(self.rank), ptr, nbytes, _threads())

    def fetch(
        self, peer: int, desc: list[int], dst: int, offset: int, nbytes: int, own: int
    ) -> None:
        """Copy ``nbytes`` at byte ``offset`` of ``peer``'s input into ``dst``, by the cheapest
        path: this rank's own input (``own``), the peer's symmetric allocation in place, a
        cross-process read, or the peer's slot."""
        if nbytes == 0:
            return
        if peer == self.rank:
            if dst != own + offset:  # in place (input is output's own slot): nothing to do
                self.c.copy(dst, own + offset, nbytes, _threads())
            return
        shared = self.peer_symmetric(desc, peer)
        if shared is not None:
            self.c.copy(dst, shared + offset, nbytes, _threads())
        elif self.ws.cma:
            self.read_peer(peer, dst, desc[_D_ADDR] + offset, nbytes)
        else:
            self.c.copy(dst, self.slot(peer) + offset, nbytes, _threads())

    def read_peer(self, peer: int, local: int, remote: int, nbytes: int) -> None:
        """One copy of ``nbytes`` at ``remote`` in ``peer``'s memory into ``local``."""
        if nbytes == 0:
            return
        err = self.c.cma_read(self.mem.pids[peer], local, remote, nbytes)
        if err:
            raise RuntimeError(
                f"{self.name}: reading rank {peer}'s memory failed ({self.c.strerror(err)}); set "
                "HP_KERNELS_CMA=0 to use the two-copy shared-memory path"
            )


def _wire_name(code: int) -> str:
    return "none" if code < 0 else str(_dtypes.from_code(code))


def _sizes_error(name: str, descs: list[list[int]], index: int, what: str) -> KernelsValueError:
    values = ", ".join(f"rank {r}: {d[index]}" for r, d in enumerate(descs))
    return KernelsValueError(f"{name}: ranks disagree on {what} ({values})")


def _is_cuda(*tensors: object) -> bool:
    return is_tensor_on("cuda", *tensors)


def _tensors(name: str, **tensors: object) -> KernelsTypeError | None:
    """The error for an argument that is not a tensor (None when all are). The caller still
    joins the call with empty stand-ins, so that every rank raises, not only this one."""
    for what, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return KernelsTypeError(
                f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}"
            )
    return None


def _check_pair(name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """Both contiguous CPU tensors of one dtype (the local checks every collective makes)."""
    _require_contiguous(input, "input")
    _require_contiguous(output, "output")
    if output.dtype != input.dtype:
        raise KernelsTypeError(
            f"{name}: output has dtype {output.dtype} but input has {input.dtype}; they must match"
        )


# ---------------------------------------------------------------------------------------------
# all_gather_into_tensor
# ---------------------------------------------------------------------------------------------


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()``
    elements, rank order), as ``torch.distributed.all_gather_into_tensor``. Returns ``output``."""
    if _is_cuda(output, input):
        from . import _cuda

        return _cuda.all_gather_into_tensor(output, input, group=group)
    error = _tensors("all_gather_into_tensor", output=output, input=input)
    if error is not None:
        output = input = torch.empty(0)
    es = input.element_size()
    n = input.numel()
    ws = _workspace(group, "all_gather_into_tensor")  # with single-copy reads: no data in slot
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        _check_pair("all_gather_into_tensor", output, input)
        if output.numel() != ws.world * n:
            raise KernelsValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements; it needs "
                f"world_size ({ws.world}) x input ({n}) = {ws.world * n}"
            )
    except (TypeError, ValueError) as exc:
        error = exc
    sym = find(input, ws.group)
    direct = ws.cma or sym is not None
    call = _Call(
        "all_gather",
        group,
        dtype=input.dtype,
        n_in=n,
        n_out=output.numel(),
        need=0 if direct else n * es,
        addr=input.data_ptr(),
        sym=sym,
        error=error,
    )
    descs = call.start(lambda mem: call.stage(mem, input.data_ptr(), n * es))
    if any(d[_D_NIN] != n for d in descs):
        call.finish()
        raise _sizes_error("all_gather_into_tensor", descs, _D_NIN, "input.numel()")
    base = output.data_ptr()
    try:  # a failing read still meets the others at the closing barrier
        for i in range(call.world):
            r = (call.rank + i) % call.world
            call.fetch(r, descs[r], base + r * n * es, 0, n * es, input.data_ptr())
    finally:
        call.finish()
    return output


# ---------------------------------------------------------------------------------------------
# all_to_all_single
# ---------------------------------------------------------------------------------------------


def _splits(arg: list[int] | None, rows: int, world: int, what: str) -> list[int]:
    if arg is None:
        if rows % world:
            raise KernelsValueError(
                f"all_to_all_single: {what} is None, so dim 0 ({rows}) must divide by world_size "
                f"({world}); pass {what} for uneven splits"
            )
        return [rows // world] * world
    if isinstance(arg, (str, bytes, torch.Tensor)) or not hasattr(arg, "__iter__"):
        raise KernelsTypeError(
            f"all_to_all_single: {what}={arg!r} is a {type(arg).__name__}: give a list of ints"
        )
    splits = []
    for s in arg:
        try:
            if isinstance(s, bool):
                raise TypeError
            splits.append(operator.index(s))
        except TypeError:
            raise KernelsTypeError(
                f"all_to_all_single: {what}={list(arg)!r} holds {s!r}; give a list of ints"
            ) from None
    if len(splits) != world or any(s < 0 for s in splits):
        raise KernelsValueError(
            f"all_to_all_single: {what}={list(arg)} needs {world} non-negative sizes"
        )
    if sum(splits) != rows:
        raise KernelsValueError(
            f"all_to_all_single: {what}={splits} sums to {sum(splits)}, not dim 0 ({rows})"
        )
    return splits


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scatter slices of ``input`` (dim 0, ``input_split_sizes``) to the ranks and gather theirs
    into ``output`` (``output_split_sizes``), as ``torch.distributed.all_to_all_single``."""
    if _is_cuda(output, input):
        from . import _cuda

        return _cuda.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group
        )
    error = _tensors("all_to_all_single", output=output, input=input)
    if error is not None:
        output = input = torch.empty(0)
    ws = _workspace(group, "all_to_all_single")
    world = ws.world
    row, s_in, s_out = 0, [0] * world, [0] * world
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        _check_pair("all_to_all_single", output, input)
        if input.dim() == 0 or output.dim() == 0:
            raise KernelsValueError(
                "all_to_all_single: input and output need at least one dimension"
            )
        row = math.prod(input.shape[1:])
        if math.prod(output.shape[1:]) != row:
            raise KernelsValueError(
                f"all_to_all_single: input rows hold {row} elements but output rows hold "
                f"{math.prod(output.shape[1:])}; shapes after dim 0 must match"
            )
        s_in = _splits(input_split_sizes, input.shape[0], world, "input_split_sizes")
        s_out = _splits(output_split_sizes, output.shape[0], world, "output_split_sizes")
    except (TypeError, ValueError) as exc:
        error = exc
    es = input.element_size()
    nbytes = input.numel() * es
    sym = find(input, ws.group)
    direct = ws.cma or sym is not None
    call = _Call(
        "all_to_all",
        group,
        dtype=input.dtype,
        n_in=input.numel(),
        n_out=output.numel(),
        need=0 if direct else nbytes,
        row=row,
        splits_in=s_in,
        splits_out=s_out,
        addr=input.data_ptr(),
        sym=sym,
        error=error,
    )
    descs = call.start(lambda mem: call.stage(mem, input.data_ptr(), nbytes))
    me = call.rank
    problems = []  # checked over every pair, so every rank raises the same error
    for p, d in enumerate(descs):
        if d[_D_ROW] != row:
            problems.append(
                f"rank {p} has rows of {d[_D_ROW]} elements, rank 0 of {descs[0][_D_ROW]}"
            )
        for q, e in enumerate(descs):
            sent, expected = e[_HEAD + p], d[_HEAD + world + q]
            if sent != expected:
                problems.append(
                    f"rank {q} sends {sent} rows to rank {p}, whose "
                    f"output_split_sizes[{q}] is {expected}"
                )
    if problems:
        call.finish()
        raise KernelsValueError(
            "all_to_all_single: split sizes do not agree between ranks: " + "; ".join(problems)
        )
    row_bytes = row * es
    out_base = output.data_ptr()
    out_offsets = [sum(s_out[:p]) for p in range(world)]
    try:  # a failing read still meets the others at the closing barrier
        for i in range(world):
            p = (me + i) % world
            src = sum(descs[p][_HEAD : _HEAD + me]) * row_bytes
            dst = out_base + out_offsets[p] * row_bytes
            call.fetch(p, descs[p], dst, src, s_out[p] * row_bytes, input.data_ptr())
    finally:
        call.finish()
    return output


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------


def _reduce_args(
    name: str, op: str, dtype: torch.dtype, wire_dtype: torch.dtype | None
) -> tuple[int, torch.dtype]:
    if not isinstance(op, str):
        raise KernelsTypeError(
            f"{name}: op={op!r} is a {type(op).__name__}; choose one of "
            f"{sorted(_dtypes.REDUCE_OPS)}"
        )
    if wire_dtype is not None and not isinstance(wire_dtype, torch.dtype):
        raise KernelsTypeError(
            f"{name}: wire_dtype={wire_dtype!r} must be a torch.dtype (e.g. torch.bfloat16) or None"
        )
    if op not in _dtypes.REDUCE_OPS:
        raise KernelsValueError(f"{name}: op={op!r}; choose one of {sorted(_dtypes.REDUCE_OPS)}")
    _dtypes.code(dtype, "the tensor")
    if op == "avg" and dtype not in _dtypes.FLOATING:
        raise KernelsTypeError(f"{name}: op='avg' needs a floating dtype, got {dtype}")
    wire = dtype if wire_dtype is None else wire_dtype
    if wire_dtype is not None:
        if dtype not in _dtypes.FLOATING or wire_dtype not in _dtypes.FLOATING:
            raise KernelsTypeError(
                f"{name}: wire_dtype={wire_dtype} applies to floating tensors only"
            )
    return _dtypes.REDUCE_OPS[op], wire


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    *,
    group: dist.ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reduce ``input`` (``world_size * output.numel()`` elements) over the ranks and leave
    block ``rank`` in ``output``, as ``torch.distributed.reduce_scatter_tensor``.

    ``op`` is ``"sum"``, ``"avg"`` or ``"max"``. With ``wire_dtype`` (e.g. ``torch.bfloat16``)
    the inputs travel in that type and are accumulated in float32 (half the bytes; the result is
    within the wire type's rounding of the exact one, closer than reducing in it)."""
    if _is_cuda(output, input):
        from . import _cuda

        return _cuda.reduce_scatter_tensor(output, input, op, group=group, wire_dtype=wire_dtype)
    error = _tensors("reduce_scatter_tensor", output=output, input=input)
    if error is not None:
        output = input = torch.empty(0)
    ws = _workspace(group, "reduce_scatter_tensor")
    n_out = output.numel()
    rop, wire = 0, input.dtype
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        _check_pair("reduce_scatter_tensor", output, input)
        rop, wire = _reduce_args("reduce_scatter_tensor", op, input.dtype, wire_dtype)
        if input.numel() != ws.world * n_out:
            raise KernelsValueError(
                f"reduce_scatter_tensor: input has {input.numel()} elements; it needs "
                f"world_size ({ws.world}) x output ({n_out}) = {ws.world * n_out}"
            )
    except (TypeError, ValueError) as exc:
        error = exc
    wes = torch.empty((), dtype=wire).element_size()
    sym = find(input, ws.group) if wire == input.dtype else None  # reduced in place
    call = _Call(
        "reduce_scatter",
        group,
        dtype=input.dtype,
        n_in=input.numel(),
        n_out=n_out,
        need=0 if sym else input.numel() * wes,
        wire=wire_dtype if error is None else None,
        rop=rop,
        sym=sym,
        error=error,
    )
    c = call.c
    wcode, dcode = _dtypes.CODES.get(wire, -1), _dtypes.CODES.get(input.dtype, -1)

    def write(mem: SymmetricMemory) -> None:
        if sym is None:
            c.convert(
                mem.buffer_addr(call.rank),
                wcode,
                input.data_ptr(),
                dcode,
                input.numel(),
                _threads(),
            )

    descs = call.start(write)
    if any(d[_D_NOUT] != n_out for d in descs):
        call.finish()
        raise _sizes_error("reduce_scatter_tensor", descs, _D_NOUT, "output.numel()")
    me = call.rank
    srcs = []
    for i in range(call.world):
        p = (me + i) % call.world
        shared = call.peer_symmetric(descs[p], p)
        srcs.append((call.slot(p) if shared is None else shared) + me * n_out * wes)
    c.reduce(output.data_ptr(), dcode, srcs, wcode, n_out, rop, 1.0 / call.world, _threads())
    call.finish()
    return output


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append((start, size))
        start += size
    return out


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    group: dist.ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks in place (``"sum"``, ``"avg"``, ``"max"``), as
    ``torch.distributed.all_reduce``: a reduce-scatter then an all-gather through the shared
    slots. ``wire_dtype`` as in :func:`reduce_scatter_tensor` (both phases travel in it)."""
    if _is_cuda(tensor):
        from . import _cuda

        return _cuda.all_reduce(tensor, op, group=group, wire_dtype=wire_dtype)
    error = _tensors("all_reduce", tensor=tensor)
    if error is not None:
        tensor = torch.empty(0)
    _workspace(group, "all_reduce")  # checks the group before anything else
    rop, wire = 0, tensor.dtype
    try:  # a bad argument on one rank must stop every rank, not leave them waiting
        if error is not None:
            raise error
        _require_contiguous(tensor, "tensor")
        rop, wire = _reduce_args("all_reduce", op, tensor.dtype, wire_dtype)
    except (TypeError, ValueError) as exc:
        error = exc
    n = tensor.numel()
    wes = torch.empty((), dtype=wire).element_size()
    call = _Call(
        "all_reduce",
        group,
        dtype=tensor.dtype,
        n_in=n,
        n_out=n,
        need=2 * n * wes,
        wire=wire_dtype if error is None else None,
        rop=rop,
        error=error,
    )
    c = call.c
    wcode, dcode = _dtypes.CODES.get(wire, -1), _dtypes.CODES.get(tensor.dtype, -1)
    descs = call.start(
        lambda mem: c.convert(
            mem.buffer_addr(call.rank), wcode, tensor.data_ptr(), dcode, n, _threads()
        )
    )
    if any(d[_D_NIN] != n for d in descs):
        call.finish()
        raise _sizes_error("all_reduce", descs, _D_NIN, "tensor.numel()")
    me, world = call.rank, call.world
    chunks = _chunks(n, world)
    start, size = chunks[me]
    result = n * wes  # byte offset of the result half of a slot
    srcs = [call.slot((me + i) % world) + start * wes for i in range(world)]
    c.reduce(
        call.slot(me) + result + start * wes, wcode, srcs, wcode, size, rop, 1.0 / world, _threads()
    )
    call.mem.barrier()
    des = tensor.element_size()
    for i in range(world):
        p = (me + i) % world
        s, m = chunks[p]
        c.convert(
            tensor.data_ptr() + s * des,
            dcode,
            call.slot(p) + result + s * wes,
            wcode,
            m,
            _threads(),
        )
    call.finish()
    return tensor
