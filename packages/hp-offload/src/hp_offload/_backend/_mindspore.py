"""Activation checkpoint and swap on MindSpore cells (PyNative mode).

Imported only when ``hp_dtensor.framework_of`` says a MindSpore cell or tensor was given to
``checkpoint``, ``checkpoint_wrapper``, ``swap``, ``swap_wrapper`` or ``swap_tensor_wrapper``.
It imports none of those front ends: it gets the errors from ``hp_offload.errors`` and the
policy and manager as arguments.

- Checkpoint: MindSpore's own non-reentrant recompute, ``mindspore.recompute(cell, *args,
  use_reentrant=False)``. In forward its saved-tensor hooks keep a placeholder instead of each
  tensor the autograd graph would save (only the region's inputs are held); the first backward
  touch of a placeholder reruns the cell's forward (same random state) and hands the
  recomputed tensors over. It takes any callable, keyword arguments and nested outputs, and
  composes with an outer saved-tensor hook (a swap region around it swaps its inputs), which
  the reentrant form (a custom ``bprop`` cell) does not. ``CheckpointPolicy(mode="full")`` is
  honoured; ``mode="selective"`` is refused (:class:`OffloadUnsupportedError`): MindSpore has no
  op-level dispatch hook through which a recompute can reuse saved op outputs, and the policy's
  op names are torch's.
- Swap: ``mindspore.saved_tensors_hooks``. ``pack`` copies each tensor the graph saves
  (not Parameters) into one of the manager's pooled host buffers (a numpy view of it) and
  returns a handle, so the graph holds no device tensor between forward and backward; tensors
  under ``SwapPolicy.fuse_below`` bytes stay on the device until the region's forward ends and
  then leave as one transfer. In backward the first ``unpack`` of region k brings the region
  back (new device tensors) and brings region k-1 back too (prefetch, in order; copies are
  synchronous here: MindSpore gives Python no copy stream). ``SwapStats`` count as on torch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from ..errors import OffloadError, OffloadTypeError, OffloadUnsupportedError

__all__ = [
    "cell_names",
    "checkpoint_cell",
    "checkpoint_call",
    "mark",
    "region",
    "swap_cell",
]

_FW = "mindspore"  # this binding's key in SwapManager._bindings


# -- plans ----------------------------------------------------------------------------------------


def cell_names(cell, fn: str) -> list[str]:
    """Every sub-cell's dotted name under ``cell``, a shared cell under each of its names (as
    torch's ``named_modules(remove_duplicate=False)``; MindSpore's ``cells_and_names`` lists
    a shared cell once, and a plan must wrap it wherever it sits)."""
    if not isinstance(cell, nn.Cell):
        raise OffloadTypeError(f"{fn}: model is a {type(cell).__name__}: pass an nn.Cell")
    out: list[str] = []

    def walk(c, prefix: str, path: frozenset) -> None:
        for name, child in c._cells.items():  # the children in order, shared ones too
            if child is None or id(child) in path:
                continue
            full = f"{prefix}{name}"
            out.append(full)
            walk(child, full + ".", path | {id(child)})

    walk(cell, "", frozenset({id(cell)}))
    return out


# -- checkpoint ---------------------------------------------------------------------------------


def _check_policy(policy, fn: str) -> None:
    """Refuse what MindSpore's recompute cannot do, naming it (never ignore it)."""
    if policy.mode != "full":
        raise OffloadUnsupportedError(
            f"{fn}: CheckpointPolicy(mode={policy.mode!r}) cannot be honoured on MindSpore: "
            "its recompute reruns a whole cell and has no op-level hook to keep the outputs of "
            f"chosen ops (save={policy.save!r} names torch ops); use "
            "CheckpointPolicy(mode='full'), or swap_wrapper to keep the activations on the host"
        )


def _check_pynative(fn: str) -> None:
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise OffloadUnsupportedError(
            f"{fn}: MindSpore runs in graph mode (mode={ms.get_context('mode')}): hp_offload's "
            "MindSpore checkpoint and swap work in PyNative mode "
            "(mindspore.set_context(mode=mindspore.PYNATIVE_MODE)); in graph mode use "
            "cell.recompute()"
        )


def checkpoint_call(fn, args, kwargs, policy):
    """``fn(*args, **kwargs)`` under MindSpore's non-reentrant recompute."""
    _check_policy(policy, "checkpoint")
    _check_pynative("checkpoint")
    for key in ("use_reentrant", "context_fn", "output_recompute", "early_stop"):
        if key in kwargs:
            raise OffloadTypeError(
                f"checkpoint: {key}= is set by hp_offload (MindSpore: non-reentrant recompute): "
                "drop it, and give the policy as policy=CheckpointPolicy(...)"
            )
    return ms.recompute(fn, *args, use_reentrant=False, **kwargs)


class _Wrapper(nn.Cell):
    """A cell around ``inner``: its Parameters keep their names (MindSpore names them by the
    path of cells; the wrapper passes a rename on to the inner cell), attributes are read
    through."""

    _INNER = ""

    def __init__(self, inner):
        super().__init__(auto_prefix=False)
        setattr(self, self._INNER, inner)

    def update_parameters_name(self, prefix="", recurse=True):
        getattr(self, self._INNER).update_parameters_name(prefix, recurse)

    def __call__(self, *args, **kwargs):
        # graph mode compiles construct, which would fail obscurely: refuse it by name (a
        # wrapper nested inside a graph-mode cell is compiled without passing here)
        _check_pynative(f"{type(self).__name__}")
        return super().__call__(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_cells", {}).get(self._INNER)
            # bprop: the wrapper must not look like a cell with a custom backward
            if inner is None or name == "bprop" or name.startswith("__"):
                raise
            return getattr(inner, name)


class _CheckpointCell(_Wrapper):
    _INNER = "_checkpoint_wrapped_module"

    def __init__(self, cell, policy):
        super().__init__(cell)
        self.policy = policy

    def construct(self, *args, **kwargs):
        return checkpoint_call(self._checkpoint_wrapped_module, args, kwargs, self.policy)


def _check_cell(cell, fn: str) -> None:
    if not isinstance(cell, nn.Cell):
        raise OffloadTypeError(
            f"{fn}: module is a {type(cell).__name__}: pass an nn.Cell (or torch nn.Module) "
            "instance"
        )


def checkpoint_cell(cell, policy):
    """``cell`` wrapped so each forward is recomputed in backward (``policy`` must be full)."""
    _check_cell(cell, "checkpoint_wrapper")
    _check_policy(policy, "checkpoint_wrapper")
    return _CheckpointCell(cell, policy)


# -- swap ---------------------------------------------------------------------------------------


class _Handle:
    __slots__ = ("__weakref__", "dtype", "group", "host", "nbytes", "off", "restored", "shape")

    def __init__(self, group, arr_shape, dtype, nbytes):
        self.group = group
        self.shape, self.dtype, self.nbytes = arr_shape, dtype, nbytes
        self.host = None  # numpy view of the host bytes (None while fused and pending)
        self.off = None  # offset in the group's fused buffer
        self.restored = None  # the device tensor given back in backward (same on every unpack)


@dataclass
class _Group:
    index: int
    handles: list = field(default_factory=list)  # weak: the autograd graph owns the handles
    small: list = field(default_factory=list)  # (handle, device tensor) until the region ends
    fused: object = None  # host bytes of the small tensors
    restored: bool = False


@dataclass
class _State:
    """A manager's MindSpore regions of the current step (reset by ``SwapManager.step``)."""

    groups: list = field(default_factory=list)


def _state(manager) -> _State:
    st = manager._bindings.get(_FW)
    if st is None:
        st = manager._bindings[_FW] = _State()
    return st


def _host_view(buf: np.ndarray, nbytes: int, dtype, shape) -> np.ndarray:
    return buf[:nbytes].view(dtype).reshape(shape)


@contextlib.contextmanager
def region(manager, policy, only_marked: bool = False) -> Iterator:
    """One swap region of ``manager`` (a ``SwapManager``) for MindSpore tensors."""
    _check_pynative("swap")
    st = _state(manager)
    group = _Group(len(st.groups))
    st.groups.append(group)

    def pack(t):
        return _pack(manager, group, t, policy, only_marked)

    def unpack(h):
        return _unpack(manager, st, h)

    with ms.saved_tensors_hooks(pack, unpack):
        yield
    _close(manager, group)


def _pack(manager, group: _Group, t, policy, only_marked: bool):
    nbytes = int(t.nbytes)
    marked = t.data_ptr() in manager._marked if manager._marked else False
    if (
        t.param_info is not None  # a Parameter (saved as a plain Tensor): on the device anyway
        or (only_marked and not marked)
        or nbytes == 0
        or nbytes < policy.min_bytes
    ):
        return t
    budget = manager.budget_bytes
    if budget is not None:
        group_bytes = sum(h.nbytes for h in (r() for r in group.handles) if h is not None)
        if group_bytes + nbytes > budget:
            raise OffloadError(
                f"budget_bytes={budget} is too small for one swap region, which saves at least "
                f"{group_bytes + nbytes} bytes; raise the budget or swap smaller regions"
            )
        if manager._held + nbytes > budget:  # full: this one stays on the device
            return t
    h = _Handle(group, tuple(t.shape), ms.dtype_to_nptype(t.dtype), nbytes)
    group.handles.append(weakref.ref(h))
    stats = manager.stats
    if nbytes < policy.fuse_below:
        manager._track(nbytes)  # on the device until the region's forward ends
        group.small.append((h, t))
        return h
    arr = t.asnumpy()  # on CPU a view of the tensor's memory; on a device, its copy to host
    h.host = _host_view(manager._host_bytes(nbytes), nbytes, arr.dtype, arr.shape)
    np.copyto(h.host, arr)
    del arr  # the graph keeps the handle only: the device tensor can go
    stats.bytes_out += nbytes
    stats.tensors_out += 1
    stats.transfers_out += 1
    return h


def _close(manager, group: _Group) -> None:
    """End of a region's forward: its small tensors leave as one transfer."""
    if not group.small:
        return
    total = sum(h.nbytes for h, _ in group.small)
    with ms._no_grad():
        flat = ops.cat([ops.stop_gradient(t).reshape(-1).view(ms.uint8) for _, t in group.small])
    group.fused = manager._host_bytes(total)[:total]
    np.copyto(group.fused, flat.asnumpy())
    off = 0
    for h, _ in group.small:
        h.off = off
        off += h.nbytes
    del flat
    manager._track(-total)
    stats = manager.stats
    stats.bytes_out += total
    stats.tensors_out += len(group.small)
    stats.transfers_out += 1
    group.small = []  # drop the device tensors


def _unpack(manager, st: _State, h):
    if not isinstance(h, _Handle):
        return h
    g = h.group
    if not g.restored:
        _restore(manager, g)
    if g.index > 0:  # prefetch the region backward reaches next
        prev = st.groups[g.index - 1]
        if not prev.restored:
            _restore(manager, prev)
    return h.restored


def _restore(manager, g: _Group) -> None:
    """Bring a region's tensors back to the device; handles the graph has dropped are skipped."""
    g.restored = True
    for h in (r() for r in g.handles):
        if h is None:
            continue
        if h.off is not None:
            src = _host_view(g.fused, h.off + h.nbytes, np.uint8, (-1,))[h.off :]
            src = src.view(h.dtype).reshape(h.shape)
        else:
            src = h.host
        h.restored = ms.Tensor(np.array(src))  # a copy: the host buffer returns to the pool
        manager.stats.bytes_in += h.nbytes
        manager._track(h.nbytes)
        weakref.finalize(h, manager._track, -h.nbytes)  # the graph drops it after its use


class _SwapCell(_Wrapper):
    _INNER = "_swap_wrapped_module"

    def __init__(self, cell, manager_fn, policy_fn):
        super().__init__(cell)
        self._manager_fn, self._policy_fn = manager_fn, policy_fn

    def construct(self, *args, **kwargs):
        with region(self._manager_fn(), self._policy_fn()):
            return self._swap_wrapped_module(*args, **kwargs)


def swap_cell(cell, manager_fn, policy_fn):
    """``cell`` wrapped so each forward is one swap region; ``manager_fn()`` / ``policy_fn()``
    give the manager and policy at call time (the default manager is made on first use)."""
    _check_cell(cell, "swap_wrapper")
    return _SwapCell(cell, manager_fn, policy_fn)


def mark(manager, tensor) -> None:
    """Marking tensors for ``only_marked`` regions: not supported on MindSpore yet (its
    regions swap every saved tensor the policy admits), so refused rather than ignored."""
    raise OffloadUnsupportedError(
        "swap_tensor_wrapper: marking MindSpore tensors (for only_marked regions) is not "
        "supported yet: swap the cell with swap_wrapper, or a region of SwapManager(...)"
        ".region(framework='mindspore')"
    )
