"""The CUDA path of :mod:`hp_kernels.comm` and :mod:`hp_kernels.mc2`: one-sided collectives on
PyTorch's symmetric memory (peer buffers mapped into each GPU's address space over NVLink).

Data moves by the copy engines (``Tensor.copy_`` between a local tensor and a peer's buffer is
a peer-to-peer ``cudaMemcpyAsync``, no SMs taken from the matmuls), reductions by the compiled
kernel ``cuda_reduce`` (float32 accumulation over the peers' pointers), and ranks meet at the
symmetric-memory barrier, enqueued on the stream like any kernel. Every call is stream-ordered
on the current stream and does not synchronise the host, except ``all_to_all_single`` with
explicit split sizes (it reads the peers' sizes, as NCCL's does through the host).

Unlike the CPU path, ranks' arguments are not cross-checked here (that would cost a host
round trip per call); PyTorch's symmetric memory barrier times out on a missing peer.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from . import _dtypes
from ._ext import load
from .comm import _chunks
from .errors import KernelsValueError

_BARRIER_MS = 60_000
_META = 4096  # bytes at the start of each buffer for split sizes
# How a peer's bytes are moved: "ce" (copy engines, cudaMemcpyAsync; leaves the SMs to compute),
# "sm" (a 16-byte-per-thread copy kernel) or "mixed" (big copies cut between the two). Copies
# may also be cut in _SPLIT pieces spread over side streams (several copy engines at once).
_COPY = os.environ.get("HP_KERNELS_GPU_COPY", "ce")
_SPLIT = int(os.environ.get("HP_KERNELS_GPU_SPLIT", "1"))
_CE_SHARE = float(os.environ.get("HP_KERNELS_GPU_CE_SHARE", "0.6"))  # for _COPY == "mixed"
_STREAMS = 4
# matmul_reduce_scatter on 2 GPUs: "pull" the peer's partial beside the own GEMM then add, or
# let the own GEMM's epilogue read it in place ("remote").
_MMRS = os.environ.get("HP_KERNELS_GPU_MMRS", "pull")


def _symm():
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError as exc:  # pragma: no cover - torch >= 2.5 has it
        raise RuntimeError(
            "hp_kernels' CUDA collectives need torch.distributed._symmetric_memory (torch >= 2.5)"
        ) from exc
    return symm


class _GpuWorkspace:
    """A symmetric byte buffer per group and device, grown collectively."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.buf: torch.Tensor | None = None
        self.hdl = None
        self.side = torch.cuda.Stream(device=device)
        self.streams = [torch.cuda.Stream(device=device) for _ in range(_STREAMS)]
        self.last: torch.cuda.Event | None = None  # the end of the previous call on any stream

    def enter(self) -> None:
        """Order this call after the previous one on this workspace, whatever streams they use
        (one buffer and one barrier channel are shared)."""
        if self.last is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last)

    def leave(self) -> None:
        self.last = torch.cuda.Event()
        self.last.record(torch.cuda.current_stream(self.device))

    def ensure(self, nbytes: int) -> None:
        """Collective when it grows: every rank must pass the same ``nbytes``."""
        if self.buf is not None and self.buf.numel() >= nbytes:
            return
        symm = _symm()
        size = max(nbytes, 1 << 20)
        size = 1 << (size - 1).bit_length()
        name = self.group.group_name
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                enable(name)
            except Exception:  # noqa: BLE001 - already enabled, or not needed in this torch
                pass
        torch.cuda.synchronize(self.device)  # no stream may still use the old buffer
        self.buf = symm.empty(size, dtype=torch.uint8, device=self.device)
        self.hdl = symm.rendezvous(self.buf, name)
        self._peers = [
            self.buf if r == self.rank else self.hdl.get_buffer(r, (size,), torch.uint8, 0)
            for r in range(self.world)
        ]

    def view(self, rank: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of ``rank``'s buffer, as seen from this GPU."""
        return self._peers[rank][offset : offset + nbytes]

    def ptr(self, rank: int) -> int:
        return int(self.hdl.buffer_ptrs[rank])

    def barrier(self) -> None:
        self.hdl.barrier(channel=0, timeout_ms=_BARRIER_MS)


class CudaSymmetricMemory:
    """GPU symmetric allocation (see :func:`hp_kernels.symm_mem.empty` with a CUDA device):
    the same methods as the CPU handle, over PyTorch's symmetric memory. Collectives of
    :mod:`hp_kernels.comm` read an input that lies in one in place (no staging copy); every rank
    must then pass a tensor at the same offset of the allocation, as symmetric code does."""

    def __init__(
        self, shape, dtype: torch.dtype, group: dist.ProcessGroup, device: torch.device
    ) -> None:
        symm = _symm()
        self.shape = (shape,) if isinstance(shape, int) else tuple(int(x) for x in shape)
        self.dtype = dtype
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                enable(group.group_name)
            except Exception:  # noqa: BLE001 - already enabled, or not needed in this torch
                pass
        numel = 1
        for x in self.shape:
            numel *= x
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = symm.empty(max(self.nbytes, 16), dtype=torch.uint8, device=device)
        self._hdl = symm.rendezvous(raw, group.group_name)
        self._raw = [
            raw if r == self.rank else self._hdl.get_buffer(r, (raw.numel(),), torch.uint8, 0)
            for r in range(self.world_size)
        ]
        self.buffer = self.peer(self.rank)
        _cuda_live.append(self)

    def peer_bytes(self, rank: int) -> torch.Tensor:
        """``rank``'s buffer as bytes, mapped into this GPU's address space."""
        return self._raw[rank][: self.nbytes]

    def peer(self, rank: int, shape=None, dtype=None, offset: int = 0) -> torch.Tensor:
        """A view of ``rank``'s buffer (shape/dtype/byte offset as on CPU)."""
        dtype = dtype or self.dtype
        shape = tuple(self.shape if shape is None else shape)
        numel = 1
        for x in shape:
            numel *= x
        size = numel * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + size > self.nbytes:
            raise KernelsValueError(
                f"a view of {size} bytes at offset {offset} does not fit the buffer"
            )
        return self._raw[rank][offset : offset + size].view(dtype).view(shape)

    def put(self, tensor: torch.Tensor, peer: int, offset: int = 0) -> None:
        """Copy ``tensor`` into ``peer``'s buffer (a peer-to-peer copy on the current stream)."""
        n = tensor.numel() * tensor.element_size()
        self._raw[peer][offset : offset + n].copy_(_bytes(tensor))

    def get(self, peer: int, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Copy ``out.nbytes`` bytes of ``peer``'s buffer into ``out``."""
        n = out.numel() * out.element_size()
        _bytes(out).copy_(self._raw[peer][offset : offset + n])
        return out

    def barrier(self, timeout: float | None = None) -> None:
        """All ranks meet (enqueued on the current stream)."""
        ms = _BARRIER_MS if timeout is None else int(timeout * 1000)
        self._hdl.barrier(channel=0, timeout_ms=ms)

    def signal(self, peer: int, slot: int = 0) -> None:
        """Signal ``peer`` on channel ``slot`` (stream-ordered)."""
        self._hdl.put_signal(peer, channel=1 + slot)

    def wait(self, peer: int, slot: int = 0, timeout: float | None = None) -> None:
        """Wait for ``peer``'s signal on channel ``slot`` (stream-ordered)."""
        ms = _BARRIER_MS if timeout is None else int(timeout * 1000)
        self._hdl.wait_signal(peer, channel=1 + slot, timeout_ms=ms)

    def contains(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor`` in this rank's buffer, or None."""
        if self._raw is None or tensor.device != self._raw[self.rank].device:
            return None
        start = self._raw[self.rank].data_ptr()
        ptr = tensor.data_ptr()
        end = ptr + tensor.numel() * tensor.element_size()
        return ptr - start if start <= ptr and end <= start + self.nbytes else None

    def close(self) -> None:
        """Drop this handle (PyTorch frees the memory when the last reference goes)."""
        if self in _cuda_live:
            _cuda_live.remove(self)
        self._raw = None  # type: ignore[assignment]
        self.buffer = None  # type: ignore[assignment]


_cuda_live: list[CudaSymmetricMemory] = []


def _find(tensor: torch.Tensor, group: dist.ProcessGroup):
    for mem in _cuda_live:
        if mem.group is group:
            off = mem.contains(tensor)
            if off is not None:
                return mem, off
    return None


_workspaces: dict[tuple[int, int], tuple[dist.ProcessGroup, _GpuWorkspace]] = {}


def _ws(group: dist.ProcessGroup | None, device: torch.device) -> _GpuWorkspace:
    group = group if group is not None else dist.group.WORLD
    key = (id(group), device.index if device.index is not None else torch.cuda.current_device())
    entry = _workspaces.get(key)
    if entry is None or entry[0] is not group:
        entry = (group, _GpuWorkspace(group, torch.device("cuda", key[1])))
        _workspaces[key] = entry
    return entry[1]


def _ordered(fn):
    """Run a collective after the previous one on its workspace (see ``enter``)."""

    def wrapper(*args, **kwargs):
        t = next(a for a in args if isinstance(a, torch.Tensor))
        ws = _ws(kwargs.get("group"), t.device)
        with torch.cuda.device(t.device):
            ws.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                ws.leave()

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _move(dst: torch.Tensor, src: torch.Tensor, how: str | None = None) -> None:
    """Copy bytes (either side may be a peer's buffer) on the current stream, by the copy
    engines (``"ce"``) or a copy kernel (``"sm"``)."""
    if (how or _COPY) == "sm":
        c = load()
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        err = c.cuda_copy(dst.data_ptr(), src.data_ptr(), dst.numel(), 132, stream)
        if err:
            raise RuntimeError(f"hp_kernels cuda_copy failed: {err}")
    else:
        dst.copy_(src)


def _fan_out(ws: _GpuWorkspace, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Byte copies ``dst <- src`` spread over the side streams after the current stream's work
    so far; the current stream then waits for all of them."""
    if sum(dst.numel() for dst, _ in pairs) < (32 << 20):  # small: streams cost more than they give
        for dst, src in pairs:
            _move(dst, src)
        return
    cur = torch.cuda.current_stream(ws.device)
    start = torch.cuda.Event()
    start.record(cur)
    pieces = []
    for dst, src in pairs:
        n = dst.numel()
        if _COPY == "mixed" and n >= (8 << 20):
            # the copy engines and a copy kernel side by side on one big copy: together they
            # draw more from NVLink than either alone
            cut = int(n * _CE_SHARE) // 4096 * 4096
            pieces += [(dst[:cut], src[:cut], "ce"), (dst[cut:], src[cut:], "sm")]
            continue
        k = _SPLIT if n >= (8 << 20) else 1
        step = -(-n // k)
        step = -(-step // 4096) * 4096
        for lo in range(0, n, step):
            pieces.append(
                (dst[lo : lo + step], src[lo : lo + step], "sm" if _COPY == "sm" else "ce")
            )
    used = ws.streams[: min(len(pieces), len(ws.streams))]
    for s in used:
        s.wait_event(start)
    for i, (dst, src, how) in enumerate(pieces):
        with torch.cuda.stream(used[i % len(used)]):
            _move(dst, src, how)
    for s in used:
        done = torch.cuda.Event()
        done.record(s)
        cur.wait_event(done)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise KernelsValueError(
            "CUDA collectives take contiguous tensors (call .contiguous() first)"
        )
    return t.reshape(-1).view(torch.uint8)


def _reduce(
    dst: torch.Tensor,
    srcs: list[int],
    src_dtype: torch.dtype,
    n: int,
    op: str,
    world: int,
    peer_views: list[torch.Tensor],
) -> None:
    """dst[:n] = op over the sources, accumulated in float32."""
    c = load()
    rop = _dtypes.REDUCE_OPS[op]
    if (
        getattr(c, "HAS_CUDA", False)
        and dst.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and n
    ):
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        err = c.cuda_reduce(
            dst.data_ptr(),
            _dtypes.CODES[dst.dtype],
            srcs,
            _dtypes.CODES[src_dtype],
            n,
            rop,
            1.0 / world,
            stream,
        )
        if err:
            raise RuntimeError(f"hp_kernels cuda_reduce failed: {err}")
        return
    acc = torch.stack(
        [
            (v.double() if v.dtype == torch.float64 else v.float()) if v.is_floating_point() else v
            for v in peer_views
        ]
    )
    res = {"sum": acc.sum(0), "avg": acc.float().mean(0), "max": acc.max(0).values}[op]
    dst.copy_(res)


@_ordered
def all_gather_into_tensor(output, input, *, group=None):
    ws = _ws(group, input.device)
    n = input.numel() * input.element_size()
    if output.numel() != ws.world * input.numel() or output.dtype != input.dtype:
        raise KernelsValueError(
            f"all_gather_into_tensor: output needs world_size x input = "
            f"{ws.world * input.numel()} elements of {input.dtype}"
        )
    me = ws.rank
    src, out = _bytes(input), _bytes(output)
    sym = _find(input, ws.group)
    if sym is None:
        ws.ensure(n)
        ws.view(me, n).copy_(src)
        ws.barrier()
        peers = {p: ws.view(p, n) for p in range(ws.world) if p != me}
    else:  # read the peers' inputs in place
        ws.ensure(1)
        mem, off = sym
        out_sym = _find(output, ws.group)
        if out_sym is not None and out_sym[0] is mem and off == out_sym[1] + me * n:
            starts = {p: out_sym[1] + p * n for p in range(ws.world)}  # in place: own chunks
        else:
            starts = {p: off for p in range(ws.world)}  # the same offset on every rank
        ws.barrier()
        peers = {
            p: mem.peer_bytes(p)[starts[p] : starts[p] + n] for p in range(ws.world) if p != me
        }
    pairs = [(out[me * n : (me + 1) * n], src)]
    pairs += [(out[p * n : (p + 1) * n], peers[p]) for p in sorted(peers)]
    _fan_out(ws, pairs)
    ws.barrier()  # peers have finished reading this rank's buffer
    return output


@_ordered
def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, *, group=None
):
    ws = _ws(group, input.device)
    world, me = ws.world, ws.rank
    if input.dim() == 0 or input.shape[1:] != output.shape[1:] or input.dtype != output.dtype:
        raise KernelsValueError(
            "all_to_all_single: input and output need the same dtype and row shape"
        )
    row = math.prod(input.shape[1:]) * input.element_size()
    if input_split_sizes is None:
        if input.shape[0] % world:
            raise KernelsValueError(
                "all_to_all_single: dim 0 must divide by world_size without splits"
            )
        s_in = [input.shape[0] // world] * world
    else:
        s_in = [int(s) for s in input_split_sizes]
    if output_split_sizes is None:
        s_out = [output.shape[0] // world] * world
    else:
        s_out = [int(s) for s in output_split_sizes]
    if (
        len(s_in) != world
        or len(s_out) != world
        or sum(s_in) != input.shape[0]
        or (sum(s_out) != output.shape[0])
    ):
        raise KernelsValueError(
            "all_to_all_single: split sizes must have world_size entries summing to dim 0"
        )
    nbytes = input.numel() * input.element_size()
    uneven = input_split_sizes is not None or output_split_sizes is not None
    out_sym = _find(output, ws.group)
    if out_sym is not None:
        return _all_to_all_push(ws, output, input, out_sym, s_in, row, uneven)
    # every rank must grow alike: size by the largest input (one small all-reduce, uneven only)
    need = nbytes
    if uneven:
        t = torch.tensor([nbytes], device=input.device, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ws.group)
        need = int(t)
    sym = _find(input, ws.group)
    ws.ensure(_META + (0 if sym else need))
    src = _bytes(input)
    in_off = [sum(s_in[:p]) * row for p in range(world)]
    for p in range(world):  # stage what the peers will pull (the own part goes directly)
        if p != me and s_in[p] and sym is None:
            lo = in_off[p]
            ws.view(me, s_in[p] * row, _META + lo).copy_(src[lo : lo + s_in[p] * row])
    sizes = _meet_with_splits(ws, s_in, uneven, input.device)
    out = _bytes(output)
    pairs = []
    offset = 0
    for p in range(world):
        size = s_out[p] * row
        if size:
            if p == me:
                pairs.append((out[offset : offset + size], src[in_off[me] : in_off[me] + size]))
            else:
                start = sum(sizes[p][:me]) * row
                if sym is None:
                    pairs.append((out[offset : offset + size], ws.view(p, size, _META + start)))
                else:
                    mem, off = sym
                    peer = mem.peer_bytes(p)[off + start : off + start + size]
                    pairs.append((out[offset : offset + size], peer))
        offset += size
    _fan_out(ws, pairs)
    ws.barrier()
    return output


def _meet_with_splits(ws, s_in, uneven, device) -> list[list[int]]:
    """Barrier; with ``uneven`` also every rank's input splits (written into the workspace's
    metadata before the barrier, read after it: one host round trip). ``sizes[p][q]`` is the
    rows rank ``p`` sends to rank ``q``."""
    if uneven:
        meta = torch.tensor(s_in, dtype=torch.int64).view(torch.uint8).to(device)
        ws.view(ws.rank, meta.numel()).copy_(meta)
    ws.barrier()
    if not uneven:
        return [s_in] * ws.world
    return torch.stack(
        [ws.view(p, 8 * ws.world).view(torch.int64) for p in range(ws.world)]
    ).tolist()


def _all_to_all_push(ws, output, input, out_sym, s_in, row, uneven):
    """all_to_all into outputs that lie in symmetric memory (at the same offset on every rank,
    the symmetric contract): each rank writes its rows for ``p`` straight into ``p``'s output
    over NVLink. Writes need no staging copy, and one-way peer writes move more bytes per
    second than peer reads, which wait on a round trip."""
    world, me = ws.world, ws.rank
    mem, off = out_sym
    ws.ensure(_META if uneven else 1)
    # every rank is here after this: its output may now be written
    sizes = _meet_with_splits(ws, s_in, uneven, input.device)
    src, out = _bytes(input), _bytes(output)
    pairs = []
    lo = 0
    for p in range(world):
        size = s_in[p] * row
        if size:
            at = sum(sizes[q][p] for q in range(me)) * row  # after earlier ranks' rows
            dst = out[at : at + size] if p == me else mem.peer_bytes(p)[off + at : off + at + size]
            pairs.append((dst, src[lo : lo + size]))
        lo += size
    _fan_out(ws, pairs)
    ws.barrier()  # every rank's rows have arrived
    return output


def _wire(op, dtype, wire_dtype):
    if op not in _dtypes.REDUCE_OPS:
        raise KernelsValueError(f"op={op!r}; choose one of {sorted(_dtypes.REDUCE_OPS)}")
    return dtype if wire_dtype is None else wire_dtype


def _stage_others(ws, flat, wire, bounds):
    """Copy (and cast to the wire type) the chunks the peers will reduce into this rank's
    buffer; the own chunk is read in place when no cast is needed."""
    wes = torch.empty((), dtype=wire).element_size()
    for p, (s, m) in enumerate(bounds):
        if m and (p != ws.rank or wire != flat.dtype):
            ws.view(ws.rank, m * wes, s * wes).view(wire).copy_(flat[s : s + m])


@_ordered
def reduce_scatter_tensor(output, input, op="sum", *, group=None, wire_dtype=None):
    ws = _ws(group, input.device)
    _bytes(input), _bytes(output)  # contiguity, checked before any barrier
    wire = _wire(op, input.dtype, wire_dtype)
    n_out = output.numel()
    if input.numel() != ws.world * n_out:
        raise KernelsValueError("reduce_scatter_tensor: input needs world_size x output elements")
    wes = torch.empty((), dtype=wire).element_size()
    ws.ensure(input.numel() * wes)
    flat = input.reshape(-1)
    me = ws.rank
    _stage_others(ws, flat, wire, [(p * n_out, n_out) for p in range(ws.world)])
    ws.barrier()
    off = me * n_out * wes
    views = [ws.view(p, n_out * wes, off).view(wire) for p in range(ws.world)]
    if wire == input.dtype:
        views[me] = flat[me * n_out : (me + 1) * n_out]
    _reduce(output.reshape(-1), [v.data_ptr() for v in views], wire, n_out, op, ws.world, views)
    ws.barrier()
    return output


@_ordered
def all_reduce(tensor, op="sum", *, group=None, wire_dtype=None):
    ws = _ws(group, tensor.device)
    _bytes(tensor)  # contiguity, checked before any barrier
    wire = _wire(op, tensor.dtype, wire_dtype)
    n = tensor.numel()
    wes = torch.empty((), dtype=wire).element_size()
    ws.ensure(2 * n * wes)
    flat = tensor.reshape(-1)
    me = ws.rank
    bounds = _chunks(n, ws.world)
    _stage_others(ws, flat, wire, bounds)
    ws.barrier()
    s, m = bounds[me]
    views = [ws.view(p, m * wes, s * wes).view(wire) for p in range(ws.world)]
    if wire == tensor.dtype:
        views[me] = flat[s : s + m]
    result = ws.view(me, m * wes, n * wes + s * wes).view(wire)
    _reduce(result, [v.data_ptr() for v in views], wire, m, op, ws.world, views)
    ws.barrier()
    if wire == tensor.dtype:
        out = _bytes(tensor)
        pairs = [
            (out[s * wes : (s + m) * wes], ws.view(p, m * wes, n * wes + s * wes))
            for p, (s, m) in enumerate(bounds)
            if m
        ]
        _fan_out(ws, pairs)
    else:
        for p, (s, m) in enumerate(bounds):
            if m:
                flat[s : s + m].copy_(ws.view(p, m * wes, n * wes + s * wes).view(wire))
    ws.barrier()
    return tensor


# ---------------------------------------------------------------------------------------------
# MC2 on GPUs
# ---------------------------------------------------------------------------------------------


@_ordered
def all_gather_matmul(x_shard, weights, *, group=None, gather_dim=0, return_gathered=False):
    """Own shard's products on the current stream while the side stream pulls the peers'
    shards (copy engines); each peer's products start as soon as its shard has landed."""
    weights = list(weights)
    dim = gather_dim % x_shard.dim()
    if dim == x_shard.dim() - 1:
        raise KernelsValueError(
            "all_gather_matmul: gather_dim must not be the last (contraction) dim"
        )
    if dim != 0:
        res = all_gather_matmul(
            x_shard.movedim(dim, 0).contiguous(),
            weights,
            group=group,
            return_gathered=return_gathered,
        )
        if return_gathered:
            g, outs = res
            return g.movedim(0, dim), [o.movedim(0, dim) for o in outs]
        return [o.movedim(0, dim) for o in res]
    ws = _ws(group, x_shard.device)
    world, me = ws.world, ws.rank
    x = x_shard.contiguous()
    m = x.shape[0]
    nbytes = x.numel() * x.element_size()
    ws.ensure(nbytes)
    ws.view(me, nbytes).copy_(_bytes(x))
    ws.barrier()
    compute = torch.cuda.current_stream(x.device)
    gathered = torch.empty((world * m, *x.shape[1:]), dtype=x.dtype, device=x.device)
    gbytes = _bytes(gathered)
    ready = torch.cuda.Event()
    ready.record(compute)
    events = {}
    with torch.cuda.stream(ws.side):
        ws.side.wait_event(ready)
        gathered.record_stream(ws.side)
        for i in range(1, world):
            p = (me + i) % world
            gbytes[p * nbytes : (p + 1) * nbytes].copy_(ws.view(p, nbytes))
            ev = torch.cuda.Event()
            ev.record(ws.side)
            events[p] = ev
    outs = [
        torch.empty((world * m, *x.shape[1:-1], w.shape[1]), dtype=x.dtype, device=x.device)
        for w in weights
    ]
    for w, out in zip(weights, outs):
        torch.matmul(x, w, out=out[me * m : (me + 1) * m])
    if return_gathered:
        gathered[me * m : (me + 1) * m].copy_(x)
    for i in range(1, world):
        p = (me + i) % world
        compute.wait_event(events[p])
        for w, out in zip(weights, outs):
            torch.matmul(gathered[p * m : (p + 1) * m], w, out=out[p * m : (p + 1) * m])
    ws.barrier()  # after the pulls (waited above): peers may reuse their buffers
    return (gathered, outs) if return_gathered else outs


@_ordered
def matmul_reduce_scatter(x, weight, *, group=None, scatter_dim=0, reduce_op="sum"):
    """Peers' partial products first, written straight into this rank's symmetric buffer; the
    side stream pulls the partials meant for this rank while the own chunk's product runs;
    then one float32-accumulating sum."""
    if reduce_op not in ("sum", "avg"):
        raise KernelsValueError(
            f"matmul_reduce_scatter: reduce_op={reduce_op!r}; choose 'sum' or 'avg'"
        )
    out_dims = x.dim()
    dim = scatter_dim % out_dims
    if dim == out_dims - 1:  # split the weight's columns: the same as scattering rows of x @ w^T
        res = matmul_reduce_scatter(
            weight.t().contiguous(),
            x.reshape(-1, x.shape[-1]).t(),
            group=group,
            scatter_dim=0,
            reduce_op=reduce_op,
        )
        return res.t().reshape(*x.shape[:-1], -1)
    if dim != 0:
        res = matmul_reduce_scatter(
            x.movedim(dim, 0).contiguous(), weight, group=group, reduce_op=reduce_op
        )
        return res.movedim(0, dim)
    ws = _ws(group, x.device)
    world, me = ws.world, ws.rank
    if x.shape[0] % world:
        raise KernelsValueError(
            f"matmul_reduce_scatter: dim 0 ({x.shape[0]}) must divide by {world}"
        )
    rows = x.shape[0] // world
    chunk_shape = (rows, *x.shape[1:-1], weight.shape[1])
    numel = 1
    for s in chunk_shape:
        numel *= s
    es = x.element_size()
    cb = numel * es
    ws.ensure(world * cb)
    compute = torch.cuda.current_stream(x.device)
    for i in range(1, world):
        j = (me + i) % world
        region = ws.view(me, cb, j * cb).view(x.dtype).view(chunk_shape)
        torch.matmul(x[j * rows : (j + 1) * rows], weight, out=region)
    ws.barrier()  # every rank's partials for every other rank are in place
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    a = x[me * rows : (me + 1) * rows].reshape(-1, x.shape[-1])
    if world == 2 and _MMRS == "remote":
        # the GEMM's epilogue adds the peer's partial, read in place over NVLink
        peer = ws.view(1 - me, cb, me * cb).view(x.dtype).view(-1, weight.shape[1])
        out = torch.addmm(peer, a, weight, beta=scale, alpha=scale).view(chunk_shape)
    else:
        # pull the partials meant for this rank on the side stream (copy engines) while the
        # own chunk's product runs, then one float32-accumulating sum
        ready = torch.cuda.Event()
        ready.record(compute)
        pulled = torch.empty((world - 1, numel), dtype=x.dtype, device=x.device)
        with torch.cuda.stream(ws.side):
            ws.side.wait_event(ready)
            pulled.record_stream(ws.side)
            for i in range(1, world):
                p = (me + i) % world
                pulled[i - 1].view(torch.uint8).copy_(ws.view(p, cb, me * cb))
            done = torch.cuda.Event()
            done.record(ws.side)
        own = torch.matmul(a, weight)
        compute.wait_event(done)
        out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
        views = [own.reshape(-1)] + [pulled[i] for i in range(world - 1)]
        _reduce(
            out.reshape(-1), [v.data_ptr() for v in views], x.dtype, numel, reduce_op, world, views
        )
    ws.barrier()  # peers have pulled their partials from this rank's buffer
    return out
