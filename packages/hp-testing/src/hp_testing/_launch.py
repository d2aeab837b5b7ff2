"""``run_ranks``: run one function on N fresh processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._fnref import FnRef
from ._group import ProcessGroupProcesses, dump_call

T = TypeVar("T")


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes sharing a process group.

    Each rank is a new interpreter (multiprocessing "spawn"). Before ``fn`` runs, a rank sets
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (as torchrun does),
    ``HP_TESTING_TMPDIR`` (a scratch folder shared by the ranks) and ``OMP_NUM_THREADS=1``, then
    the entries of ``env``; calls ``torch.set_num_threads(1)`` and
    ``torch.distributed.init_process_group(backend, init_method="file://<tmpdir>/rdzv", ...)``
    (a file rendezvous in a fresh temporary folder, no ports). After ``fn`` returns, the rank
    sends the return value back and destroys the process group.

    Args:
        fn: a function defined at module level (not a lambda, closure or method of an
            instance). It is sent by name and found again in each child: by importing its
            module, or else by loading its source file.
        world_size: number of ranks.
        args, kwargs: arguments for ``fn``; must be picklable.
        timeout: seconds for the whole call (start-up included); also the process group's
            collective timeout.
        backend: ``torch.distributed`` backend; ``"gloo"`` for CPU.
        env: extra environment variables for the ranks (str to str).

    Returns:
        The return values of ``fn``, indexed by rank. They must be picklable, and unpicklable
        in the parent (prefer builtins, tensors and numpy arrays).

    Raises:
        RankFailure: a rank raised or died. The message has each failing rank's traceback and
            names the ranks that did not finish; those are killed about 3 s after the first
            failure, so a rank blocked in a collective does not hang the call.
        RankTimeout: ``timeout`` passed; the message names the ranks still running and holds
            the Python stack of each, taken just before they were killed.
        TypeError, ValueError: bad ``fn``, arguments or options (raised before any process
            starts).
    """
    ref = FnRef.of(fn)
    payload = dump_call(args, kwargs)
    group = ProcessGroupProcesses(world_size, timeout=timeout, backend=backend, env=env)
    deadline = time.monotonic() + float(timeout)
    try:
        group.start(deadline)
        results = group.run(ref, payload, deadline)
        group.stop()
    finally:
        group.kill()
    return results
