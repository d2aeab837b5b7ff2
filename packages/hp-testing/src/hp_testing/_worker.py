"""The child side: one rank's process.

Runs in a fresh interpreter (multiprocessing "spawn"). It sets the torchrun-like environment
before torch is imported, joins the process group, then serves ``run`` requests from the parent
until told to stop. Messages to the parent:

- ``("ready", pid)`` once the process group is initialised;
- ``("ok", pickled_return_value)`` after a successful call;
- ``("err", one_line_summary, formatted_traceback)`` when something raised.

torch is imported only inside functions so that the environment (``OMP_NUM_THREADS``, the
caller's ``env``) is in place before it loads.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ._fnref import FnRef, resolve

#: The signal the parent sends to get a rank's Python stack (written by faulthandler).
STACK_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start; pickled to the child."""

    rank: int
    world_size: int
    backend: str
    init_method: str
    timeout: float
    tmpdir: str
    stack_path: str
    crash_path: str
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process if the parent dies (Linux), so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except Exception:  # best effort
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _send_error(conn: Connection, exc: BaseException, context: str = "", skip: int = 0) -> None:
    tb = exc.__traceback__
    for _ in range(skip):  # drop our own frames from the top of the traceback
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    first = str(exc).strip().splitlines()
    summary = type(exc).__qualname__ + (f": {first[0]}" if first else "")
    if context:
        summary = f"{summary} ({context})"
        text = f"{context}:\n{text}"
    try:
        conn.send(("err", summary, text))
    except Exception:  # parent gone, or a broken pipe: nothing more to do
        pass


def _init(spec: WorkerSpec) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if spec.backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout),
    )


def _destroy() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # wait for the peers first: a rank that tears down its gloo connections while
            # another still uses them can abort the process at exit
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass


def _serve(conn: Connection) -> None:
    cache: dict[FnRef, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, ref, payload = msg
        try:
            fn = cache.get(ref)
            if fn is None:
                fn = cache[ref] = resolve(ref)
            args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
        except BaseException as exc:
            _send_error(conn, exc, skip=1)
            continue
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            _send_error(
                conn, exc, context=f"pickling the return value of type {type(value).__name__}"
            )
            continue
        conn.send(("ok", data))


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a rank's process."""
    _die_with_parent(spec.parent_pid)
    os.environ.update(
        {
            "RANK": str(spec.rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_RANK": str(spec.rank),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
            "GROUP_RANK": "0",
            "HP_TESTING_TMPDIR": spec.tmpdir,
        }
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(spec.env)
    # Fatal errors (segfault, abort) go to one file; SIGUSR1 dumps every thread's stack to
    # another, which the parent reads when a rank hangs.
    crash_file = open(spec.crash_path, "w")  # stays open for faulthandler
    faulthandler.enable(crash_file, all_threads=True)
    stack_file = open(spec.stack_path, "w")
    faulthandler.register(STACK_SIGNAL, stack_file, all_threads=True, chain=False)
    try:
        _init(spec)
    except BaseException as exc:
        _send_error(conn, exc, context="initialising the process group")
        conn.close()
        return
    try:
        conn.send(("ready", os.getpid()))
        _serve(conn)
    finally:
        _destroy()
        conn.close()
