"""Activation swap: tensors saved for backward inside a swap region go to (pinned) host memory
during forward, on a side stream, and come back ahead of need during backward: when backward
first touches region k, region k-1's tensors start coming back (prefetch)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ._checks import check_bool, check_callable, check_int, check_module, check_type
from .errors import OffloadError, OffloadTypeError

__all__ = ["SwapManager", "SwapPolicy", "SwapStats", "swap", "swap_tensor_wrapper", "swap_wrapper"]


@dataclass(frozen=True)
class SwapPolicy:
    """Which saved tensors a swap region moves: those of at least ``min_bytes``; tensors
    under ``fuse_below`` bytes are packed into one transfer per region (swap fusion)."""

    min_bytes: int = 0
    fuse_below: int = 1 << 16

    def __post_init__(self) -> None:
        check_int(self.min_bytes, "min_bytes", "SwapPolicy")
        check_int(self.fuse_below, "fuse_below", "SwapPolicy")


@dataclass
class SwapStats:
    """Per-step counters: bytes and tensors out (device -> host) and in, transfers (a fused
    group counts once), host seconds spent waiting for transfers, and the peak of device bytes
    held by saved tensors of swap regions (kept ones, and swapped ones until their copy is done
    and once they are back)."""

    bytes_out: int = 0
    bytes_in: int = 0
    tensors_out: int = 0
    transfers_out: int = 0
    wait_s: float = 0.0
    device_bytes: int = 0
    peak_device_bytes: int = 0


class _Handle:
    __slots__ = (
        "__weakref__",
        "buf",
        "device",
        "dtype",
        "group",
        "nbytes",
        "off",
        "restored",
        "shape",
        "stride",
        "tensor",
    )

    def __init__(self, group, tensor):
        self.group = group
        self.tensor = tensor  # on device until its copy is done (or for good if kept)
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.dtype, self.device = tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.buf = None  # host bytes
        self.off = None  # offset in the group's fused buffer
        self.restored = None


@dataclass
class _Group:
    index: int
    handles: list = field(default_factory=list)  # weak: the autograd graph owns the handles
    small: list = field(default_factory=list)
    fused: object = None  # host buffer of the small tensors
    small_total: int = 0
    event: object = None  # device->host copies done
    back: object = None  # host->device copies done (prefetch)
    restored: bool = False
    waited: bool = False
    nbytes: int = 0
    pending: list = field(default_factory=list)  # device tensors kept alive until `event`


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in storage order (1-D): its bytes, whatever its strides."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill exactly ``numel`` slots of storage."""
    if t.numel() == 0:
        return False
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


class SwapManager:
    """The host side of activation swap: a pool of (pinned) byte buffers reused across steps, a
    byte budget, per-step statistics and the prefetch order.

    ``budget_bytes`` caps the host bytes held at once (None: no cap); a region whose tensors
    alone exceed it is an error. ``max_inflight_bytes`` caps the device bytes still waiting for
    their copy to the host: beyond it, forward waits for the oldest copies. Device-to-host
    bandwidth is finite (about 55 GB/s on an H200's PCIe link); without the cap the copies fall
    behind the forward and the swapped tensors are all still on the device at its end. Call
    :meth:`step` after each backward: it returns the step's :class:`SwapStats` and puts the
    buffers back in the pool.
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        pin_memory: bool | None = None,
        max_inflight_bytes: int | None = 1 << 30,
    ):
        check_int(budget_bytes, "budget_bytes", "SwapManager", low=1, none_ok=True)
        check_int(max_inflight_bytes, "max_inflight_bytes", "SwapManager", low=1, none_ok=True)
        check_bool(pin_memory, "pin_memory", "SwapManager", none_ok=True)
        self.budget_bytes = budget_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._held = 0
        self._step_bufs: list[torch.Tensor] = []  # back to the pool at step()
        self._inflight = 0  # device bytes whose copy to the host is not known to be done
        self._pending = 0  # entries in the groups' pending lists (nothing to drain when 0)
        self._groups: list[_Group] = []
        self._marked: set[int] = set()
        self.stats = SwapStats()
        self._streams: dict = {}
        # per-framework state of the bindings' regions this step (hp_offload._backend; the
        # binding's own objects, keyed by framework), dropped by step()
        self._bindings: dict[str, object] = {}

    # -- buffers ------------------------------------------------------------------------------
    def _buffer(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(nbytes - 1, 0).bit_length()  # power-of-two buckets: reuse across steps
        bucket = self._pool.get(size)
        if bucket:
            buf = bucket.pop()
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self._held += size
        self._step_bufs.append(buf)
        return buf

    def _host_bytes(self, nbytes: int):
        """A pooled host buffer of at least ``nbytes`` bytes as a 1-D numpy uint8 array (shares
        memory with the pool's buffer; back to the pool at :meth:`step`): what the bindings
        of other frameworks copy saved tensors into."""
        return self._buffer(nbytes).numpy()

    def _release(self, buf: torch.Tensor) -> None:
        self._held -= buf.numel()
        self._pool.setdefault(buf.numel(), []).append(buf)

    def _stream(self, device: torch.device, kind: str):
        if device.type != "cuda":
            return None
        s = self._streams.get((device, kind))
        if s is None:
            s = self._streams[(device, kind)] = torch.cuda.Stream(device)
        return s

    def _track(self, delta: int) -> None:
        st = self.stats
        st.device_bytes += delta
        st.peak_device_bytes = max(st.peak_device_bytes, st.device_bytes)

    # -- regions --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(
        self,
        policy: SwapPolicy | None = None,
        *,
        only_marked: bool = False,
        framework: str = "torch",
    ) -> Iterator:
        """Swap the tensors saved for backward inside this block (one prefetch group).
        ``framework``: whose autograd saves them, ``"torch"`` or ``"mindspore"`` (MindSpore
        cells in PyNative mode; ``only_marked`` is torch's only)."""
        check_type(policy, SwapPolicy, "policy", "SwapManager.region", hint="e.g. SwapPolicy()")
        check_bool(only_marked, "only_marked", "SwapManager.region")
        if framework not in ("torch", "mindspore"):
            raise OffloadTypeError(
                f"SwapManager.region: framework={framework!r}: give 'torch' or 'mindspore'"
            )
        policy = SwapPolicy() if policy is None else policy
        if framework == "mindspore":
            if only_marked:
                from .errors import OffloadUnsupportedError

                raise OffloadUnsupportedError(
                    "SwapManager.region: only_marked is not supported on MindSpore (tensors "
                    "cannot be marked there yet): leave it False"
                )
            from ._backend import _mindspore

            with _mindspore.region(self, policy):
                yield
            return
        group = _Group(len(self._groups))
        self._groups.append(group)

        def pack(t: torch.Tensor):
            return self._pack(group, t, policy, only_marked)

        def unpack(h):
            return self._unpack(h)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self._close(group)

    def _pack(self, group: _Group, t: torch.Tensor, policy: SwapPolicy, only_marked: bool):
        nbytes = t.numel() * t.element_size()
        marked = t.untyped_storage().data_ptr() in self._marked if self._marked else False
        keep = (
            (only_marked and not marked)
            or (t.requires_grad and t.is_leaf)  # parameters live on the device anyway
            or not _dense(t)
            or nbytes < policy.min_bytes
            or t.is_sparse
        )
        if keep:
            return t
        group.nbytes += nbytes
        if self.budget_bytes is not None:
            if group.nbytes > self.budget_bytes:
                raise OffloadError(
                    f"budget_bytes={self.budget_bytes} is too small for one swap region, which "
                    f"saves at least {group.nbytes} bytes; raise the budget or swap smaller regions"
                )
            if self._held + nbytes > self.budget_bytes:  # full: this one stays on the device
                return t
        if self._pending:
            self._drain_finished()
        h = _Handle(group, t)
        group.handles.append(weakref.ref(h))
        self._track(nbytes)
        if nbytes < policy.fuse_below:
            group.small.append(h)
            return h
        h.buf = self._buffer(nbytes)
        stream = self._stream(t.device, "out")
        host = h.buf[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())
        if stream is None:
            host.copy_(t)
            h.tensor = None  # the saved tensor has left: only the host copy holds it now
            self._track(-nbytes)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            group.pending.append((t, nbytes, ev))
            self._pending += 1
            h.tensor = None
            group.event = ev
            self._inflight += nbytes
            self._throttle()
        self.stats.bytes_out += nbytes
        self.stats.tensors_out += 1
        self.stats.transfers_out += 1
        return h

    def _close(self, group: _Group) -> None:
        """End of a region's forward: one transfer for its small tensors."""
        if group.small:
            total = sum(h.nbytes for h in group.small)
            dev = group.small[0].device
            flat = torch.cat([_raw(h.tensor).view(torch.uint8) for h in group.small])
            group.fused = self._buffer(total)
            off = 0
            for h in group.small:
                h.off = off
                off += h.nbytes
            stream = self._stream(dev, "out")
            if stream is None:
                group.fused[:total].copy_(flat)
                for h in group.small:
                    h.tensor = None
                self._track(-total)
            else:
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    group.fused[:total].copy_(flat, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                group.pending.append((flat, 0, ev))
                self._pending += 1 + len(group.small)
                for h in group.small:
                    group.pending.append((h.tensor, h.nbytes, ev))
                    self._inflight += h.nbytes
                    h.tensor = None
                group.event = ev
            self.stats.bytes_out += total
            self.stats.tensors_out += len(group.small)
            self.stats.transfers_out += 1
            group.small_total = total
            group.small = [weakref.ref(h) for h in group.small]
        if self._pending:
            self._drain_finished()

    def _drain_finished(self, force: bool = False) -> None:
        """Drop device tensors whose copy to the host is done (all of them with ``force``)."""
        for g in self._groups:
            keep = []
            for item in g.pending:
                _t, n, ev = item
                if force:
                    ev.synchronize()
                if force or ev.query():
                    self._track(-n)
                    self._inflight -= n
                else:
                    keep.append(item)
            self._pending -= len(g.pending) - len(keep)
            g.pending[:] = keep

    def _throttle(self) -> None:
        """Wait for the oldest copies while more than ``max_inflight_bytes`` are in flight."""
        cap = self.max_inflight_bytes
        if cap is None or self._inflight <= cap:
            return
        self._drain_finished()
        t0 = time.perf_counter()
        for g in self._groups:
            while g.pending and self._inflight > cap:
                _t, n, ev = g.pending.pop(0)
                self._pending -= 1
                ev.synchronize()
                self._track(-n)
                self._inflight -= n
        self.stats.wait_s += time.perf_counter() - t0

    # -- backward -------------------------------------------------------------------------------
    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if self._pending:
            self._drain_finished()  # device copies whose transfer is done: free them now
        g = h.group
        if not g.restored:
            self._restore(g)
        if g.back is not None and not g.waited:
            t0 = time.perf_counter()
            torch.cuda.current_stream(h.device).wait_event(g.back)
            self.stats.wait_s += time.perf_counter() - t0
            g.waited = True
        if g.index > 0:  # prefetch the region that backward reaches next
            prev = self._groups[g.index - 1]
            if not prev.restored:
                self._restore(prev)
        return h.restored  # the same tensor on every unpack: identity holds with retain_graph

    def _restore(self, g: _Group) -> None:
        """Bring a region's tensors back (on the side stream on CUDA); handles the graph has
        already dropped are skipped."""
        g.restored = True
        live = [h for h in (r() for r in g.handles) if h is not None]
        if not live:
            return
        dev = live[0].device
        stream = self._stream(dev, "in")
        if stream is not None:
            if g.event is not None:
                stream.wait_event(g.event)
            stream.wait_stream(torch.cuda.current_stream(dev))
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            flat = None
            if g.fused is not None:
                total = g.small_total
                flat = torch.empty(total, dtype=torch.uint8, device=dev)
                flat.copy_(g.fused[:total], non_blocking=True)
                self.stats.bytes_in += total
            for h in live:
                if h.off is not None:
                    piece = flat[h.off : h.off + h.nbytes].view(h.dtype)
                    h.restored = piece.as_strided(h.shape, h.stride)
                else:
                    t = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=dev)
                    host = h.buf[: h.nbytes].view(h.dtype).as_strided(h.shape, h.stride)
                    t.copy_(host, non_blocking=True)
                    h.restored = t
                    self.stats.bytes_in += h.nbytes
                self._track(h.nbytes)
                weakref.finalize(h.restored, self._track, -h.nbytes)
        if stream is not None:
            g.back = torch.cuda.Event()
            g.back.record(stream)
            for h in live:
                h.restored.record_stream(torch.cuda.current_stream(dev))

    # -- steps ----------------------------------------------------------------------------------
    def step(self) -> SwapStats:
        """End of a training step (after backward): buffers back to the pool; returns and
        resets the statistics."""
        self._drain_finished(force=True)
        for s in self._streams.values():
            s.synchronize()  # no copy may still read or write a buffer we hand out again
        for buf in self._step_bufs:
            self._release(buf)
        self._step_bufs.clear()
        self._groups.clear()
        self._bindings.clear()
        self._marked.clear()
        stats, self.stats = self.stats, SwapStats()
        stats.device_bytes = 0
        return stats

    def mark(self, tensor: torch.Tensor) -> None:
        """Swap ``tensor`` whenever it is saved inside a region of this manager."""
        if _framework(tensor) == "mindspore":
            from ._backend._mindspore import mark

            mark(self, tensor)
            return
        if not isinstance(tensor, torch.Tensor):
            raise OffloadTypeError(
                f"SwapManager.mark: tensor is a {type(tensor).__name__}: pass a torch.Tensor "
                "(or a MindSpore Tensor)"
            )
        self._marked.add(tensor.untyped_storage().data_ptr())

    @property
    def pooled_bytes(self) -> int:
        """Host bytes in the pool (free) and held (in use)."""
        return self._held + sum(b.numel() for bs in self._pool.values() for b in bs)


def _framework(obj) -> str | None:
    from hp_dtensor import framework_of  # the one framework check

    return framework_of(obj)


def _framework_of_call(fn, args, kwargs) -> str | None:
    found = _framework(fn)
    for a in (*args, *kwargs.values()):
        if found is not None:
            break
        found = _framework(a)
    return found


_DEFAULT: SwapManager | None = None


def default_manager() -> SwapManager:
    """The process-wide manager used when none is given."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = SwapManager()
    return _DEFAULT


def swap(
    fn: Callable,
    *args,
    manager: SwapManager | None = None,
    policy: SwapPolicy | None = None,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)`` as one swap region."""
    check_callable(fn, "fn", "swap")
    check_type(manager, SwapManager, "manager", "swap", hint="e.g. SwapManager()")
    check_type(policy, SwapPolicy, "policy", "swap", hint="e.g. SwapPolicy()")
    mgr = manager or default_manager()
    if _framework_of_call(fn, args, kwargs) == "mindspore":
        from ._backend._mindspore import region

        with region(mgr, SwapPolicy() if policy is None else policy):
            return fn(*args, **kwargs)
    with mgr.region(policy):
        return fn(*args, **kwargs)


class _SwapWrapper(nn.Module):
    def __init__(self, module: nn.Module, manager: SwapManager | None, policy: SwapPolicy | None):
        super().__init__()
        self._swap_wrapped_module = module
        self.manager = manager
        self.policy = policy
        from ._checkpoint import _add_prefix, _strip_prefix

        self._register_state_dict_hook(
            lambda m, sd, p, lm: _strip_prefix(m, sd, p, lm, "_swap_wrapped_module.")
        )
        self._register_load_state_dict_pre_hook(
            lambda sd, p, *a: _add_prefix(sd, p, *a, inner="_swap_wrapped_module.")
        )

    def forward(self, *args, **kwargs):
        mgr = self.manager or default_manager()
        with mgr.region(self.policy):
            return self._swap_wrapped_module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._swap_wrapped_module, name)


def swap_wrapper(
    module: nn.Module, *, manager: SwapManager | None = None, policy: SwapPolicy | None = None
) -> nn.Module:
    """Wrap ``module`` so each forward is one swap region of ``manager``.

    A MindSpore ``nn.Cell`` gets a cell whose forward is one such region (PyNative mode): the
    tensors its autograd graph saves are copied to the manager's host buffers in forward and
    come back in backward; its Parameters keep their names."""
    mindspore = _framework(module) == "mindspore"
    if not mindspore:
        check_module(module, "module", "swap_wrapper")
    check_type(manager, SwapManager, "manager", "swap_wrapper", hint="e.g. SwapManager()")
    check_type(policy, SwapPolicy, "policy", "swap_wrapper", hint="e.g. SwapPolicy()")
    if mindspore:
        from ._backend._mindspore import swap_cell

        pol = SwapPolicy() if policy is None else policy
        return swap_cell(module, lambda: manager or default_manager(), lambda: pol)
    return _SwapWrapper(module, manager, policy)


def swap_tensor_wrapper(tensor: torch.Tensor, *, manager: SwapManager | None = None):
    """Mark ``tensor`` for swapping when saved inside a region of ``manager`` (also one with
    ``only_marked=True``, which swaps nothing else); returns it."""
    if not isinstance(tensor, torch.Tensor) and _framework(tensor) != "mindspore":
        raise OffloadTypeError(
            f"swap_tensor_wrapper: tensor is a {type(tensor).__name__}: pass a torch.Tensor "
            "(or a MindSpore Tensor)"
        )
    check_type(manager, SwapManager, "manager", "swap_tensor_wrapper", hint="e.g. SwapManager()")
    (manager or default_manager()).mark(tensor)
    return tensor
