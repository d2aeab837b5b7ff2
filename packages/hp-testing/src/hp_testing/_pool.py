"""``RankPool``: keep N rank processes and their process group alive across many calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from ._errors import RankFailure
from ._fnref import FnRef
from ._group import ProcessGroupProcesses, check_options, dump_call

T = TypeVar("T")


class RankPool:
    """``world_size`` long-lived rank processes sharing one process group.

    Starting ranks costs seconds (a fresh interpreter importing torch, then the rendezvous);
    a pool pays that once and runs many functions on the same ranks::

        with RankPool(4) as pool:
            assert pool.run(check_sum, 3) == [True] * 4
            assert pool.run(check_gather) == [True] * 4

    Each rank is set up as in :func:`run_ranks` (environment, ``torch.set_num_threads(1)``,
    gloo process group over a file rendezvous). Functions run one call at a time on every rank;
    state left by one call (globals, RNG, groups made with ``new_group``) is seen by the next.

    After a failure or a timeout the processes are killed (other ranks may be stuck in a
    collective) and the next :meth:`run` starts fresh ones; :attr:`restarts` counts those
    restarts. The processes start on ``__enter__`` (or the first ``run``) and stop on
    ``__exit__`` / :meth:`close`.

    Args:
        world_size: number of ranks.
        timeout: seconds allowed for start-up, and for each :meth:`run` call; also the process
            group's collective timeout.
        backend: ``torch.distributed`` backend; ``"gloo"`` for CPU.
        env: extra environment variables for the ranks (str to str).
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
    ) -> None:
        check_options(world_size, timeout, backend, env)
        self.world_size = world_size
        self.timeout = float(timeout)
        self.backend = backend
        self.env = dict(env or {})
        self._group: ProcessGroupProcesses | None = None
        self._starts = 0
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, indexed by rank (empty when not running)."""
        return list(self._group.pids) if self._group is not None else []

    @property
    def restarts(self) -> int:
        """How many times the ranks were started again after a failure or timeout."""
        return max(0, self._starts - 1)

    def start(self) -> None:
        """Start the ranks if they are not running (``run`` does this on demand)."""
        if self._closed:
            raise RuntimeError("this RankPool is closed; create a new one")
        if self._group is not None:
            return
        group = ProcessGroupProcesses(
            self.world_size, timeout=self.timeout, backend=self.backend, env=self.env
        )
        self._starts += 1
        group.start(time.monotonic() + self.timeout)  # kills its processes if it fails
        self._group = group

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank.

        ``fn`` must be a module-level function; arguments and return values must be picklable.
        Raises :class:`RankFailure` / :class:`RankTimeout` as :func:`run_ranks` does, after
        which the pool restarts its processes on the next call.
        """
        ref = FnRef.of(fn)
        payload = dump_call(args, kwargs)
        self.start()
        group = self._group
        assert group is not None
        try:
            return group.run(ref, payload, time.monotonic() + self.timeout)
        except RankFailure:
            self._group = None  # already killed; restart on the next call
            raise
        except BaseException:
            group.kill()
            self._group = None
            raise

    def close(self) -> None:
        """Stop the ranks (leave the process group, exit) and remove the temporary folder."""
        self._closed = True
        group, self._group = self._group, None
        if group is not None:
            try:
                group.stop()
            finally:
                group.kill()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._group else "idle")
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"
