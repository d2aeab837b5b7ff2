"""Process groups: initialisation from torchrun's environment and a cache of sub-groups.

Asking twice for the same ranks returns the same group (the ``mark_created_groups`` semantics of
HyperParallel): a group is created once per process and reused by every mesh that needs it.
Groups are created with local synchronisation, so only their members take part in creating them.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ._backend import get_platform
from .errors import HPDTensorTypeError, MeshError

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "get_process_group_ranks",
    "get_backend",
    "split_group",
    "get_group_local_rank",
    "new_group",
    "created_groups",
    "mark_created_groups",
]

DEFAULT_TIMEOUT_S = 600.0
_GROUPS: dict[tuple[int, ...], Any] = {}
_STATE = {"timeout_s": DEFAULT_TIMEOUT_S}
_CLEANUPS: list = []


def register_cleanup(fn) -> None:
    """Call ``fn()`` when the process groups are destroyed (caches that hold meshes)."""
    _CLEANUPS.append(fn)


def _seconds(timeout) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise HPDTensorTypeError(
            f"init_process_group: timeout={timeout!r} must be a datetime.timedelta or a number "
            "of seconds"
        )
    if not seconds > 0:
        raise MeshError(f"init_process_group: timeout={timeout!r} must be positive")
    return seconds


def init_process_group(
    backend: str | None = None,
    *,
    timeout: timedelta | float | None = None,
    device_type: str | None = None,
) -> None:
    """Join the default process group from torchrun's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (as set by ``torchrun``).
    ``backend`` defaults to the collective library of ``device_type`` (gloo on CPU, NCCL on CUDA,
    HCCL on NPU). ``timeout`` (a ``timedelta`` or seconds) bounds every collective, so a rank
    waiting for a peer that died fails instead of hanging. Does nothing when already initialised.
    """
    seconds = _seconds(timeout)  # checked even when already initialised
    platform = get_platform(device_type)
    if platform.is_initialized():
        return
    # the launcher's rendezvous variables (torchrun's; MindSpore checks msrun's itself)
    required = getattr(platform, "launch_env", ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    missing = [k for k in required if k not in os.environ]
    if missing:
        raise MeshError(
            f"init_process_group needs the environment variables {missing}: launch with "
            f"torchrun (e.g. torchrun --nproc_per_node=4 script.py) or set them yourself"
        )
    device_type = device_type or platform.default_device_type()
    _STATE["timeout_s"] = seconds
    platform.init_process_group(backend, _STATE["timeout_s"], device_type)
    # Gloo's worker threads must not outlive the interpreter: a process that forgets to call
    # destroy_process_group() would otherwise abort at exit ("terminate called without an
    # active exception").
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    try:
        if get_platform().is_initialized():
            destroy_process_group(barrier=False)
    except Exception:  # the interpreter is going away; nothing useful to report
        pass


def destroy_process_group(*, barrier: bool = True) -> None:
    """Leave the default group and forget every cached sub-group and every cache that holds one.

    With ``barrier`` the ranks first wait for each other, so that no rank tears down its
    connections while a peer still uses them.
    """
    platform = get_platform()
    if platform.is_initialized() and barrier:
        platform.barrier()
    for fn in _CLEANUPS:
        fn()
    _GROUPS.clear()
    if platform.is_initialized():
        platform.destroy_process_group()
    forget = getattr(platform, "forget_groups", None)
    if forget is not None:  # group names restart with the next process group
        forget()


def new_group(ranks: Sequence[int]) -> Any:
    """The group of ``ranks`` (sorted), created on first request and cached afterwards.

    Only members need to call it. Ranks are global ranks of the default group.
    """
    key = tuple(sorted(_ranks(ranks, "ranks", "new_group")))
    group = _GROUPS.get(key)
    if group is None:
        platform = get_platform()
        world = platform.get_world_size()
        if not key or key[0] < 0 or key[-1] >= world or len(set(key)) != len(key):
            raise MeshError(
                f"ranks={list(ranks)} must be distinct ranks in [0, {world}) of the default group"
            )
        group = platform.new_group(list(key), _STATE["timeout_s"])
        _GROUPS[key] = group
    return group


def _ranks(ranks, arg: str, fn: str) -> list[int]:
    """``ranks`` as a list of ints; a typed error naming ``arg`` otherwise."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise HPDTensorTypeError(
            f"{fn}: {arg}={ranks!r} must be a list of int global ranks, e.g. [0, 1]"
        )
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise HPDTensorTypeError(
                f"{fn}: {arg}={list(ranks)!r} holds {r!r}, a {type(r).__name__}: give int "
                "global ranks"
            )
        out.append(r)
    return out


def mark_created_groups(groups: Any) -> None:
    """Adopt process groups made elsewhere (another framework, a serving engine, plain
    ``torch.distributed.new_group``): ``groups`` is one group or a list of them. Afterwards
    ``new_group`` — and with it every mesh — returns the adopted group for its ranks instead of
    creating a second one over the same ranks.

    Raises :class:`MeshError` if an entry is not a group of the active backend, or if another
    group over the same ranks is already in use (meshes hold it; adopting a second would split
    their traffic): adopt before building meshes. Adopting the same group twice does nothing.
    """
    items = list(groups) if isinstance(groups, (list, tuple)) else [groups]
    platform = get_platform()
    if not platform.is_initialized():
        raise MeshError(
            "mark_created_groups: the default process group is not initialised: call "
            "init_process_group first"
        )
    adopted: dict[tuple[int, ...], Any] = {}
    for i, group in enumerate(items):
        try:
            ranks = platform.group_ranks(group)
        except Exception as e:  # not a group of this backend
            raise MeshError(
                f"mark_created_groups: groups[{i}] ({type(group).__name__}) is not a process "
                f"group of the active backend ({e}): pass groups made by it"
            ) from None
        key = tuple(sorted(int(r) for r in ranks))
        held = _GROUPS.get(key, adopted.get(key))
        if held is not None and held is not group:
            raise MeshError(
                f"mark_created_groups: groups[{i}] spans ranks {list(key)}, which already have a "
                "group in use: adopt groups before building meshes, one group per set of ranks"
            )
        adopted[key] = group
    _GROUPS.update(adopted)


def created_groups() -> dict[tuple[int, ...], Any]:
    """The groups created so far, keyed by their sorted ranks."""
    return dict(_GROUPS)


def split_group(parent: Any, split_ranks: Sequence[Sequence[int]]) -> Any:
    """Split ``parent`` into disjoint groups; return the one holding this rank (None if none).

    ``split_ranks`` lists global ranks, e.g. ``[[0, 1], [2, 3]]``; every list must lie inside
    ``parent``. Groups are cached like ``new_group``.
    """
    platform = get_platform()
    parent_ranks = set(platform.group_ranks(parent)) if parent is not None else None
    me = platform.get_rank()
    seen: set[int] = set()
    mine = None
    if isinstance(split_ranks, (str, bytes)) or not hasattr(split_ranks, "__iter__"):
        raise HPDTensorTypeError(
            f"split_group: split_ranks={split_ranks!r} must be a list of lists of global ranks, "
            "e.g. [[0, 1], [2, 3]]"
        )
    for ranks in split_ranks:
        ranks = _ranks(ranks, "split_ranks entry", "split_group")
        if parent_ranks is not None and not set(ranks) <= parent_ranks:
            raise MeshError(
                f"split_ranks entry {ranks} has ranks outside the parent group "
                f"{sorted(parent_ranks)}: give sub-lists of the parent's ranks"
            )
        if seen & set(ranks):
            raise MeshError(f"split_ranks={split_ranks} repeats a rank: the lists must be disjoint")
        seen.update(ranks)
        if me in ranks:
            mine = new_group(ranks)
    return mine


def get_process_group_ranks(group: Any = None) -> list[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    return get_platform().group_ranks(group)


def get_backend(group: Any = None) -> str:
    """Name of the collective library behind ``group`` (``gloo``, ``nccl``, ``hccl``...)."""
    return get_platform().group_backend(group)


def get_group_local_rank(group: Any = None) -> int:
    """This process's rank inside ``group``."""
    return get_platform().get_rank(group)


def default_timeout_s() -> float:
    """The timeout given to ``init_process_group`` (seconds)."""
    return _STATE["timeout_s"]
