"""Symmetric memory: one buffer of the same size on every rank of a group, mapped into every peer.

On CPU ranks of one host the buffers live in one POSIX shared-memory segment. Rank 0 of the
group creates it, every rank maps it, and rank 0 removes its name as soon as all have mapped it:
from then on nothing is left in ``/dev/shm`` whatever happens to the ranks (the memory is freed
when the last mapping goes). Names still pending are removed at exit and on fatal signals.

Beside the buffers the segment holds, per rank, a barrier counter, signal counters (one per peer
and slot) and a small descriptor area used by :mod:`hp_kernels.comm` to check that every rank
called the same op with agreeing arguments. Counters only grow, so there is no reset to race.

Example (every rank of ``group`` runs this)::

    mem = hp_kernels.symm_mem.empty((1024,), torch.float32, group=group)
    mem.buffer.fill_(mem.rank)
    mem.barrier()
    left = mem.peer((mem.rank - 1) % mem.world_size)   # a view of the peer's buffer
    mem.close()
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import uuid
import weakref
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._checks import check_group, check_int
from ._ext import load
from .errors import KernelsError, KernelsTypeError, KernelsValueError

__all__ = [
    "HostSpanError",
    "PeerError",
    "SymmetricMemory",
    "default_timeout",
    "empty",
    "find",
]

NUM_SLOTS = 4  # signal slots per (peer, rank) pair
_ALIGN = 4096
_counter = itertools.count()


class HostSpanError(KernelsError, ValueError):
    """The group's ranks are on more than one host (raised on every rank alike)."""


class PeerError(KernelsError, RuntimeError):
    """A peer did not take part in time (it died, or did not arrive before the timeout)."""


def default_timeout() -> float:
    """Seconds a rank waits on a peer: ``HP_KERNELS_TIMEOUT`` or 300."""
    return float(os.environ.get("HP_KERNELS_TIMEOUT", "300"))


def _host_id() -> str:
    """This host's identity: hostname plus boot id (two containers may share a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SymmetricMemory:
    """Handle of a symmetric allocation (build it with :func:`empty`).

    Attributes:
        rank, world_size: this rank's index in the group and the group's size.
        group: the torch process group.
        shape, dtype, nbytes: of each rank's buffer.
        buffer: this rank's buffer as a tensor.
        pids: process ids of the ranks, indexed by group rank.
    """

    def __init__(
        self,
        *,
        name: str,
        mapping: object,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        pids: Sequence[int],
        timeout: float,
        desc_words: int,
    ) -> None:
        self._c = load()
        self.name = name
        self._mapping = mapping
        self._addr = mapping.addr  # type: ignore[attr-defined]
        self.shape = shape
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.pids = list(pids)
        # a peer in another PID namespace has no /proc entry here: its liveness cannot be
        # watched (waits then end only at the timeout)
        self._watch = [p if os.path.exists(f"/proc/{p}") else 0 for p in self.pids]
        self.timeout = timeout
        self.nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.desc_words = desc_words
        words = 1 + world_size * NUM_SLOTS + desc_words
        self._ctrl_stride = _round_up(words * 8, 64)
        self._ctrl_bytes = _round_up(self._ctrl_stride * world_size, _ALIGN)
        self._buf_stride = _round_up(max(self.nbytes, 1), _ALIGN)
        self._bytes = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)  # type: ignore[arg-type]
        self._gen = 0
        self._expected = [[0] * NUM_SLOTS for _ in range(world_size)]
        self.uid = zlib.crc32(name.encode()) + 1  # the same on every rank, never 0
        self.buffer = self.peer(rank)
        _live[id(self)] = weakref.ref(self)

    # ---- memory -----------------------------------------------------------------------------

    @staticmethod
    def layout_bytes(nbytes: int, world_size: int, desc_words: int) -> int:
        """Size of the shared segment for ``world_size`` buffers of ``nbytes`` each."""
        words = 1 + world_size * NUM_SLOTS + desc_words
        ctrl = _round_up(_round_up(words * 8, 64) * world_size, _ALIGN)
        return ctrl + world_size * _round_up(max(nbytes, 1), _ALIGN)

    def _check_open(self) -> None:
        if self._addr == 0:
            raise RuntimeError("this SymmetricMemory is closed")

    def buffer_addr(self, rank: int) -> int:
        """Address of ``rank``'s buffer in this process."""
        self._check_open()
        return self._addr + self._ctrl_bytes + rank * self._buf_stride

    def peer_bytes(self, rank: int) -> torch.Tensor:
        """``rank``'s buffer as a flat uint8 tensor (writes go straight into the peer)."""
        self._check_peer(rank, "rank")
        start = self._ctrl_bytes + rank * self._buf_stride
        return self._bytes[start : start + self.nbytes]

    def peer(
        self,
        rank: int,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A view of ``rank``'s buffer, by default with the allocation's shape and dtype;
        ``shape``/``dtype``/``offset`` (in bytes) view part of it differently."""
        dtype = dtype or self.dtype
        shape = tuple(self.shape if shape is None else shape)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + size > self.nbytes:
            raise KernelsValueError(
                f"a view of {size} bytes at offset {offset} does not fit the {self.nbytes}-byte "
                "symmetric buffer"
            )
        raw = self.peer_bytes(rank)[offset : offset + size]
        return raw.view(dtype).view(shape)

    # ---- one-sided data movement ----------------------------------------------------------

    def put(self, tensor: torch.Tensor, peer: int, offset: int = 0) -> None:
        """Copy ``tensor`` (contiguous, CPU) into ``peer``'s buffer at byte ``offset``."""
        self._check_peer(peer, "peer")
        _require_contiguous(tensor, "tensor")
        n = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + n > self.nbytes:
            raise KernelsValueError(
                f"put of {n} bytes at offset {offset} overflows the peer buffer"
            )
        self._c.copy(self.buffer_addr(peer) + offset, tensor.data_ptr(), n)

    def get(self, peer: int, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Copy ``out.nbytes`` bytes of ``peer``'s buffer from byte ``offset`` into ``out``."""
        self._check_peer(peer, "peer")
        _require_contiguous(out, "out")
        n = out.numel() * out.element_size()
        if offset < 0 or offset + n > self.nbytes:
            raise KernelsValueError(
                f"get of {n} bytes at offset {offset} overflows the peer buffer"
            )
        self._c.copy(out.data_ptr(), self.buffer_addr(peer) + offset, n)
        return out

    # ---- synchronisation ------------------------------------------------------------------

    def _ctrl(self, rank: int) -> int:
        self._check_open()
        return self._addr + rank * self._ctrl_stride

    def _flag_addr(self, owner: int, source: int, slot: int) -> int:
        return self._ctrl(owner) + 8 * (1 + source * NUM_SLOTS + slot)

    def desc_addr(self, rank: int) -> int:
        """Address of ``rank``'s descriptor words (``desc_words`` int64 values)."""
        return self._ctrl(rank) + 8 * (1 + self.world_size * NUM_SLOTS)

    def signal(self, peer: int, slot: int = 0) -> None:
        """Raise ``peer``'s flag for (this rank, ``slot``) by one (release semantics: writes
        made before the signal are visible to the peer once its :meth:`wait` returns)."""
        self._check_peer(peer, "peer")
        self._check_slot(slot)
        self._c.add_u64(self._flag_addr(peer, self.rank, slot), 1)

    def wait(self, peer: int, slot: int = 0, timeout: float | None = None) -> None:
        """Wait for ``peer``'s next :meth:`signal` on ``slot`` (signals are counted)."""
        self._check_peer(peer, "peer")
        self._check_slot(slot)
        self._expected[peer][slot] += 1
        self._wait(
            self._flag_addr(self.rank, peer, slot),
            self._expected[peer][slot],
            peer,
            timeout,
            f"signal on slot {slot}",
        )

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank of the group has reached this barrier."""
        self._check_open()
        self._gen += 1
        self._c.store_u64(self._ctrl(self.rank), self._gen)
        for i in range(1, self.world_size):
            peer = (self.rank + i) % self.world_size
            self._wait(self._ctrl(peer), self._gen, peer, timeout, "barrier")

    def _wait(self, addr: int, value: int, peer: int, timeout: float | None, what: str) -> None:
        timeout = self.timeout if timeout is None else timeout
        status = self._c.wait_geq(addr, value, timeout, self._watch[peer])
        if status == 0:
            return
        who = f"rank {peer} (pid {self.pids[peer]}) of the symmetric-memory group"
        if status == 2:
            raise PeerError(f"{who} exited while rank {self.rank} waited for its {what}")
        raise PeerError(
            f"{who} did not reach its {what} within {timeout:g} s (rank {self.rank} waited); "
            "did every rank call the same ops in the same order? HP_KERNELS_TIMEOUT sets the limit"
        )

    # ---- life -----------------------------------------------------------------------------

    def contains(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor``'s data in this rank's buffer, or None if it lies elsewhere."""
        if self._addr == 0 or tensor.device.type != "cpu":
            return None
        start = self.buffer_addr(self.rank)
        ptr = tensor.data_ptr()
        end = ptr + tensor.numel() * tensor.element_size()
        return ptr - start if start <= ptr and end <= start + self.nbytes else None

    def close(self) -> None:
        """Release this rank's handle. The mapping goes when the last tensor viewing it does
        (views keep it alive), and the memory when every rank's mapping is gone."""
        self.buffer = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        self._mapping = None
        self._addr = 0
        _live.pop(id(self), None)

    def __enter__(self) -> SymmetricMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SymmetricMemory(shape={self.shape}, dtype={self.dtype}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )

    def _check_peer(self, peer: int, what: str) -> None:
        self._check_open()
        if not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise KernelsValueError(
                f"{what}={peer!r} is not a rank of this group (0..{self.world_size - 1})"
            )

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < NUM_SLOTS:
            raise KernelsValueError(
                f"slot={slot!r}: there are {NUM_SLOTS} signal slots (0..{NUM_SLOTS - 1})"
            )


_live: dict[int, weakref.ref] = {}


def find(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[SymmetricMemory, int] | None:
    """The live symmetric allocation (of ``group``, if given) holding ``tensor`` in this rank's
    buffer, with the byte offset; None when the tensor is ordinary memory."""
    for ref in list(_live.values()):
        mem = ref()
        if mem is None or (group is not None and mem.group is not group):
            continue
        offset = mem.contains(tensor)
        if offset is not None:
            return mem, offset
    return None


def by_uid(uid: int) -> SymmetricMemory | None:
    """This rank's live handle of the symmetric allocation ``uid`` (see ``SymmetricMemory.uid``)."""
    for ref in list(_live.values()):
        mem = ref()
        if mem is not None and mem.uid == uid:
            return mem
    return None


def _require_contiguous(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise KernelsTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise KernelsValueError(f"{what} is on {tensor.device}; this operation takes CPU tensors")
    if not tensor.is_contiguous():
        raise KernelsValueError(f"{what} must be contiguous (call .contiguous() first)")


def empty(
    shape: Sequence[int] | int,
    dtype: torch.dtype,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    desc_words: int | None = None,
    device: torch.device | str | None = None,
) -> SymmetricMemory:
    """Allocate a buffer of ``shape`` and ``dtype`` on every rank of ``group`` (collective).

    Every rank must call it with the same shape and dtype; all ranks must be on one host.
    With a CUDA ``device`` the buffer is GPU memory from PyTorch's symmetric memory (peers
    reached over NVLink) and the handle has the same methods.

    Args:
        shape: each rank's buffer shape.
        dtype: element type.
        group: torch process group (default: the world); its ranks must share a host.
        timeout: seconds to wait on a peer in :meth:`SymmetricMemory.wait` and ``barrier``
            (default :func:`default_timeout`).
        desc_words: int64 words of descriptor space per rank (used by :mod:`hp_kernels.comm`).
        device: ``None``/``"cpu"`` for shared host memory, or a CUDA device.

    Raises:
        KernelsValueError: the ranks disagree on shape or dtype, or the group spans hosts.
        KernelsNotBuiltError: the compiled module is missing.
    """
    c = load()
    group = group if group is not None else dist.group.WORLD
    if not dist.is_initialized():
        raise RuntimeError("hp_kernels.symm_mem.empty needs torch.distributed to be initialized")
    if device is not None and torch.device(device).type == "cuda":
        from ._cuda import CudaSymmetricMemory

        return CudaSymmetricMemory(shape, dtype, group, torch.device(device))  # type: ignore[return-value]
    check_group("symm_mem.empty", group)
    if isinstance(shape, (str, bytes)) or not (
        isinstance(shape, int) or hasattr(shape, "__iter__")
    ):
        raise KernelsTypeError(f"symm_mem.empty: shape={shape!r} must be an int or a tuple of ints")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    shape = tuple(check_int("symm_mem.empty", s, f"shape={shape!r}: size") for s in shape)
    if any(s < 0 for s in shape):
        raise KernelsValueError(f"shape={shape} has a negative size")
    if not isinstance(dtype, torch.dtype):
        raise KernelsTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise KernelsTypeError(
                f"symm_mem.empty: timeout={timeout!r} is a {type(timeout).__name__}: give seconds"
            )
        if not timeout > 0:
            raise KernelsValueError(f"symm_mem.empty: timeout={timeout!r} must be > 0 seconds")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    timeout = default_timeout() if timeout is None else float(timeout)
    desc_words = 16 + 2 * world if desc_words is None else int(desc_words)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    total = SymmetricMemory.layout_bytes(nbytes, world, desc_words)

    name, mapping, error = "", None, None
    if rank == 0:
        name = f"/hp_symm_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:8]}"
        try:
            mapping = c.shm_create(name, total)
        except RuntimeError as exc:
            error = str(exc)
    mine = (_host_id(), os.getpid(), shape, str(dtype), name, error)
    everyone: list = [None] * world
    status: list = [None] * world
    try:
        dist.all_gather_object(everyone, mine, group=group)
        _check_agreement(everyone, shape, dtype)
        name = everyone[0][4]
        attach_error = None
        if rank != 0:
            try:
                mapping = c.shm_attach(name, total)
            except RuntimeError as exc:
                attach_error = str(exc)
        dist.all_gather_object(status, attach_error, group=group)
    finally:
        if rank == 0 and name:
            c.shm_unlink(name)  # everyone has mapped it (or gave up): nothing stays in /dev/shm
    bad = [(r, e) for r, e in enumerate(status) if e]
    if bad:
        raise RuntimeError(
            "could not map the shared segment on " + "; ".join(f"rank {r}: {e}" for r, e in bad)
        )
    return SymmetricMemory(
        name=name,
        mapping=mapping,
        shape=shape,
        dtype=dtype,
        rank=rank,
        world_size=world,
        group=group,
        pids=[e[1] for e in everyone],
        timeout=timeout,
        desc_words=desc_words,
    )


def _check_agreement(everyone: list, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise the same error on every rank when the gathered requests disagree."""
    hosts: dict[str, list[int]] = {}
    for r, entry in enumerate(everyone):
        hosts.setdefault(entry[0], []).append(r)
    if len(hosts) > 1:
        where = "; ".join(f"{h.split('/')[0]}: ranks {r}" for h, r in hosts.items())
        raise HostSpanError(
            f"group spans more than one host ({where}): symmetric memory joins the ranks of one "
            "host only; pass a group per host (e.g. the intra-node dimension of a DeviceMesh)"
        )
    first = everyone[0]
    for r, entry in enumerate(everyone):
        if (entry[2], entry[3]) != (first[2], first[3]):
            raise KernelsValueError(
                f"ranks disagree on the symmetric buffer: rank 0 asked for shape {first[2]} "
                f"{first[3]}, rank {r} for shape {entry[2]} {entry[3]}; every rank must pass the "
                "same shape and dtype"
            )
    if first[5]:
        raise RuntimeError(f"rank 0 could not create the shared segment: {first[5]}")
