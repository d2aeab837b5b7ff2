"""The backend seam: one small ``Platform`` protocol, one implementation per framework.

Everything framework-specific that hp_dtensor needs (collectives, groups, devices, streams,
tensor factories) goes through a ``Platform``. The torch implementation covers CPU (gloo), CUDA
(NCCL) and Ascend NPU (HCCL through torch_npu, imported only when an NPU is asked for). A
MindSpore implementation plugs in under the name ``"mindspore"``.

Selection is explicit and lazy: ``get_platform(device_type)`` picks by the mesh's device type
unless the ``HP_BACKEND`` environment variable names a backend; nothing is imported or patched
until a platform is first asked for, and frameworks are never tried in turn.

Which framework an argument belongs to is decided here too, once: ``framework_of`` is the
check every front end (parallel styles, ``shard_module``, ``DTensor``, hp-fsdp's
``fully_shard``) asks before handing an object to the binding of its framework.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Protocol, runtime_checkable

from ..errors import BackendError, HPDTensorTypeError

__all__ = [
    "COMMUNICATING_METHODS",
    "Platform",
    "available_platforms",
    "framework_of",
    "get_platform",
    "platform_class",
    "register_platform",
]


#: the Platform methods that communicate (a check must raise before any of them runs; the
#: bad-input tests count them)
COMMUNICATING_METHODS = (
    "all_gather_into",
    "reduce_scatter_into",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "barrier",
    "new_group",
    "batch_p2p",
)


@runtime_checkable
class Platform(Protocol):
    """What hp_dtensor needs from a framework. Collectives take a framework process group."""

    name: str
    #: whose tensors the platform's collectives take ("torch", "mindspore"); plugins that
    #: extend a built-in backend keep its framework
    framework: str

    # devices ----------------------------------------------------------------------------
    def default_device_type(self) -> str:
        """The device type to use when none is given (``"cuda"`` when available, else ``"cpu"``)."""

    def device_for_rank(self, device_type: str) -> Any:
        """The device this process should use for ``device_type`` (sets it current)."""

    def default_comm_backend(self, device_type: str) -> str:
        """The collective library for a device type (``gloo``, ``nccl``, ``hccl``)."""

    # process groups -----------------------------------------------------------------------
    def is_initialized(self) -> bool: ...
    def init_process_group(
        self, backend: str | None, timeout_s: float, device_type: str
    ) -> None: ...
    def destroy_process_group(self, group: Any = None) -> None: ...
    def get_rank(self, group: Any = None) -> int: ...
    def get_world_size(self, group: Any = None) -> int: ...
    def new_group(
        self, ranks: list[int], timeout_s: float | None = None, *, distinct: bool = False
    ) -> Any:
        """The group of ``ranks`` (only members need call it; the world's own group when they
        are all the ranks, unless ``distinct``: then a communicator of its own, as NCCL
        pipeline channels want)."""

    def group_ranks(self, group: Any) -> list[int]: ...
    def group_backend(self, group: Any) -> str: ...

    # collectives ----------------------------------------------------------------------------
    def all_gather_into(self, out: Any, inp: Any, group: Any, async_op: bool = False) -> Any: ...
    def reduce_scatter_into(
        self, out: Any, inp: Any, op: str, group: Any, async_op: bool = False
    ) -> Any: ...
    def all_reduce(self, t: Any, op: str, group: Any, async_op: bool = False) -> Any: ...
    def all_to_all(
        self,
        out: Any,
        inp: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool = False,
    ) -> Any: ...
    def broadcast(self, t: Any, src: int, group: Any, async_op: bool = False) -> Any: ...
    def barrier(self, group: Any = None) -> None: ...
    def batch_p2p(
        self,
        sends: list[tuple[Any, int]],
        recvs: list[tuple[Any, int]],
        group: Any,
        tag: int = 0,
    ) -> list[Any]:
        """Post point-to-point sends ``(tensor, peer)`` and receives ``(tensor, peer)`` (peers
        are global ranks of ``group``) as one batch; a list of handles to ``wait()`` on. The
        receives land in their tensors. Messages between the same two ranks in the same
        direction and with the same ``tag`` match in list order, so every rank lists its
        exchanges in one agreed order (a plan's or a schedule's). Frameworks without
        point-to-point kernels may build them from two-rank collectives run in that order."""

    # tensor factories ------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """An uninitialised tensor."""

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """A tensor of zeros."""

    # the few tensor operations redistribution needs beyond the Tensor methods both
    # frameworks share (shape, reshape, view, narrow, movedim, split, new_zeros, new_empty)
    def cat(self, tensors: list[Any], dim: int) -> Any:
        """Concatenate ``tensors`` along ``dim``."""

    def clone(self, t: Any) -> Any:
        """A copy of ``t`` with its own storage."""

    #: whether ``t[index]`` is a view of ``t`` (torch) rather than a copy (MindSpore): a
    #: receive may then land in a slice of its destination without a buffer
    slices_are_views: bool

    def tensor_device_type(self, obj: Any) -> str | None:
        """The device type of ``obj`` if it is a tensor of this framework, else None."""

    def from_numpy(self, array: Any, device: Any) -> Any:
        """A tensor with ``array``'s values and dtype on ``device`` (small metadata only)."""

    def to_numpy(self, t: Any) -> Any:
        """``t``'s values as a numpy array (on the host; small metadata only)."""

    def dtype_problem(self, dtype: Any, device_type: str) -> str:
        """Why tensors of ``dtype`` cannot be moved point to point on ``device_type`` here
        ('' if they can): checked on every rank before a transfer starts."""

    def dtype_from_name(self, name: str) -> Any:
        """The dtype called ``name`` (``"float32"``, ``"bfloat16"``), or None if it names none:
        dtypes read from metadata are looked up, never evaluated."""

    # streams and events ------------------------------------------------------------------
    def new_stream(self, device: Any) -> Any: ...
    def current_stream(self, device: Any) -> Any: ...
    def new_event(self, device: Any) -> Any: ...
    def synchronize(self, device: Any) -> None: ...


def framework_of(obj: Any) -> str | None:
    """The framework whose tensor, module or cell ``obj`` is: ``"torch"``, ``"mindspore"``
    (the names of ``Platform.framework``), or None for anything else.

    This is the one place that tells frameworks apart; it imports none of them. A torch object
    exists only once torch is imported, so torch's classes are checked only then; a MindSpore
    object is one whose class, or a base class, comes from a ``mindspore`` module.

    Example::

        framework_of(torch.nn.Linear(2, 2))  # "torch"
        framework_of(mindspore.nn.Dense(2, 2))  # "mindspore"
        framework_of([1, 2])  # None
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return "torch"
    for cls in type(obj).__mro__:
        if (getattr(cls, "__module__", None) or "").partition(".")[0] == "mindspore":
            return "mindspore"
    return None


# name -> "module:attribute"; plugins add entries with register_platform.
_REGISTRY: dict[str, str] = {
    "torch": "hp_dtensor._backend._torch:TorchPlatform",
    "mindspore": "hp_dtensor._backend._mindspore:MindSporePlatform",
}
_DEVICE_TYPE_BACKEND = {"cpu": "torch", "cuda": "torch", "npu": "torch", "meta": "torch"}
# how to install a backend's framework, for the error when it is missing
_INSTALL = {"mindspore": 'pip install mindspore "numpy<2" (MindSpore 2.x is built on NumPy 1)'}
_INSTANCES: dict[str, Platform] = {}


def register_platform(name: str, target: str, *, device_types: tuple[str, ...] = ()) -> None:
    """Register a backend as ``"module:Class"``; optionally make it the default for device types."""
    if not isinstance(name, str) or not name:
        raise HPDTensorTypeError(f"register_platform: name={name!r} must be a non-empty str")
    if not isinstance(target, str) or ":" not in target:
        raise BackendError(
            f"register_platform: target={target!r} must be a str 'module:Class' (the class, or "
            "a factory, that implements the Platform protocol)"
        )
    if isinstance(device_types, str) or not all(isinstance(d, str) for d in device_types):
        raise HPDTensorTypeError(
            f"register_platform: device_types={device_types!r} must be a tuple of strs, e.g. "
            "('npu',)"
        )
    _REGISTRY[name] = target
    for dt in device_types:
        _DEVICE_TYPE_BACKEND[dt] = name
    _INSTANCES.pop(name, None)


def available_platforms() -> tuple[str, ...]:
    """Names that ``HP_BACKEND`` may take."""
    return tuple(_REGISTRY)


def platform_class(name: str) -> Any:
    """The class (or factory) registered as ``name``, imported now: for a plugin that extends a
    built-in backend (e.g. ``platform_class("torch")``) rather than replacing it."""
    target = _REGISTRY.get(name)
    if target is None:
        raise BackendError(
            f"{name!r} is not a registered backend: use one of {available_platforms()}"
        )
    mod_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod_name), attr)


def get_platform(device_type: str | None = None) -> Platform:
    """The active platform: ``HP_BACKEND`` when set, else the one serving ``device_type``.

    The platform object is created on first use and cached.
    """
    name = os.environ.get("HP_BACKEND")
    if not name:
        name = _DEVICE_TYPE_BACKEND.get(device_type or "cpu")
        if name is None:
            raise BackendError(
                f"device_type={device_type!r} has no backend: use one of "
                f"{sorted(_DEVICE_TYPE_BACKEND)} or set HP_BACKEND to one of "
                f"{available_platforms()}"
            )
    inst = _INSTANCES.get(name)
    if inst is not None:
        return inst
    target = _REGISTRY.get(name)
    if target is None:
        raise BackendError(
            f"HP_BACKEND={name!r} is not a known backend: use one of {available_platforms()}"
        )
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        how = _INSTALL.get(name, "install its framework")
        raise BackendError(
            f"backend {name!r} could not be loaded from {mod_name}: {e}. To use it: {how}; or "
            f"choose another backend with HP_BACKEND (one of {available_platforms()})"
        ) from e
    inst = getattr(mod, attr)()
    _INSTANCES[name] = inst
    return inst
