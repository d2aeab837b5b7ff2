"""The parent side: start N rank processes, send them work, collect results, report failures."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ._errors import RankFailure, RankTimeout
from ._fnref import FnRef
from ._worker import STACK_SIGNAL, WorkerSpec, worker_main

#: Seconds the other ranks get to finish once one rank has failed before they are killed.
FAILURE_GRACE_S = 3.0
#: Seconds given to ranks to exit after a ``stop`` before they are killed.
STOP_GRACE_S = 5.0


def check_options(world_size: int, timeout: float, backend: str, env: Mapping[str, str] | None):
    """Validate the options shared by ``run_ranks`` and ``RankPool`` (before any process starts)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name such as 'gloo', got {backend!r}")
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"env must map str to str, got {key!r}: {value!r}; convert values with str()"
            )


def dump_call(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> bytes:
    """Pickle a call's arguments once in the parent, with a clear error if they cannot be."""
    try:
        return pickle.dumps((tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"the arguments for the ranks must be picklable: {type(exc).__name__}: {exc}"
        ) from exc


def _kill_all(procs: list[Any], conns: list[Connection], tmpdir: str | None) -> None:
    """Terminate, then kill, every process; close pipes; remove the temporary folder."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + 1.0
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # rank -> traceback / death report
    summaries: dict[int, str] = field(default_factory=dict)  # rank -> one line
    unfinished: list[int] = field(default_factory=list)
    timed_out: bool = False


class ProcessGroupProcesses:
    """``world_size`` live rank processes sharing one process group."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float,
        backend: str,
        env: Mapping[str, str] | None,
    ) -> None:
        check_options(world_size, timeout, backend, env)
        self.world_size = world_size
        self.timeout = float(timeout)
        self.backend = backend
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._tmpdir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self.pids: list[int] = []

    # -- life cycle -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def start(self, deadline: float) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        ctx = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="hp_testing-")
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._conns, self._tmpdir)
        try:
            for rank in range(self.world_size):
                spec = WorkerSpec(
                    rank=rank,
                    world_size=self.world_size,
                    backend=self.backend,
                    init_method="file://" + os.path.join(self._tmpdir, "rdzv"),
                    timeout=self.timeout,
                    tmpdir=self._tmpdir,
                    stack_path=self._stack_path(rank),
                    crash_path=self._crash_path(rank),
                    parent_pid=os.getpid(),
                    env=self.env,
                )
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main, args=(spec, child_conn), name=f"hp_testing-rank{rank}"
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
            self.pids = [proc.pid for proc in self._procs]
            outcome = self._collect(deadline, expect="ready")
        except BaseException:
            self.kill()
            raise
        self._raise_if_failed(outcome, what="starting the process group")

    def run(self, ref: FnRef, payload: bytes, deadline: float) -> list[Any]:
        """Run ``ref`` with the pickled ``payload`` on every rank; results indexed by rank."""
        if not self.alive:
            raise RuntimeError("the rank processes are not running")
        try:
            for conn in self._conns:
                try:
                    conn.send(("run", ref, payload))
                except OSError:  # that rank is gone; _collect reports how it died
                    pass
            outcome = self._collect(deadline, expect="ok")
        except BaseException:
            self.kill()
            raise
        self._raise_if_failed(outcome, what=f"running {ref.describe()}")
        return [outcome.results[rank] for rank in range(self.world_size)]

    def stop(self) -> None:
        """Ask every rank to leave the process group and exit; kill those that do not."""
        if not self.alive:
            return
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        end = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank now and remove the temporary folder (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _kill_all once
        self._procs = []
        self._conns = []

    # -- collecting -------------------------------------------------------------------------

    def _collect(self, deadline: float, expect: str) -> _Outcome:
        """Wait for one message from every rank, or for a failure plus grace, or the deadline."""
        out = _Outcome()
        pending = set(range(self.world_size))
        first_failure: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline
            if first_failure is not None:
                limit = min(deadline, first_failure + FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self._procs[rank].sentinel] = rank
            for obj in wait(list(waitables), timeout=limit - now):
                rank = waitables[obj]
                if rank not in pending:
                    continue
                failed = self._receive(rank, expect, out)
                pending.discard(rank)
                if failed and first_failure is None:
                    first_failure = time.monotonic()
        if pending:
            out.unfinished = sorted(pending)
            out.timed_out = first_failure is None
        return out

    def _receive(self, rank: int, expect: str, out: _Outcome) -> bool:
        """Read rank's message (or notice its death) into ``out``; return True on failure."""
        conn, proc = self._conns[rank], self._procs[rank]
        msg = None
        try:
            if conn.poll():
                msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None:
            proc.join(1.0)
            code = proc.exitcode
            how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
            report = f"process {proc.pid} ended ({how}) without reporting a result"
            crash = _read(self._crash_path(rank)).strip()
            if crash:
                report += "\nfatal error log (faulthandler):\n" + crash
            if expect == "ready":
                report += (
                    "\nit died while starting (its stderr shows why); a script that starts ranks "
                    "must guard its entry point with `if __name__ == '__main__':`, because each "
                    "rank imports the main module again"
                )
            out.failures[rank] = report
            out.summaries[rank] = f"died ({how})"
            return True
        if msg[0] == "err":
            out.summaries[rank], out.failures[rank] = msg[1], msg[2]
            return True
        if msg[0] != expect:
            out.summaries[rank] = f"sent an unexpected message {msg[0]!r}"
            out.failures[rank] = out.summaries[rank]
            return True
        if expect == "ok":
            try:
                out.results[rank] = pickle.loads(msg[1])
            except Exception as exc:
                out.summaries[rank] = f"return value could not be unpickled in the parent: {exc}"
                out.failures[rank] = (
                    f"{out.summaries[rank]}\nReturn builtins, numbers, tensors or numpy arrays; "
                    "objects of classes defined in test files may not unpickle in the parent."
                )
                return True
        else:
            out.results[rank] = msg[1]
        return False

    # -- reporting --------------------------------------------------------------------------

    def _stack_path(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir, f"stack-rank{rank}.txt")

    def _crash_path(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir, f"fatal-rank{rank}.txt")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank for its Python stack (faulthandler on SIGUSR1) and read what it wrote."""
        offsets = {rank: _size(self._stack_path(rank)) for rank in ranks}
        signalled = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, STACK_SIGNAL)
                    signalled.append(rank)
                except OSError:
                    pass
        end = time.monotonic() + 2.0
        previous: dict[int, int] = {}
        while signalled and time.monotonic() < end:
            time.sleep(0.05)
            sizes = {rank: _size(self._stack_path(rank)) for rank in signalled}
            if all(sizes[r] > offsets[r] for r in signalled) and sizes == previous:
                break
            previous = sizes
        stacks = {}
        for rank in ranks:
            text = _trim_stack(_read(self._stack_path(rank), offsets[rank]).strip())
            stacks[rank] = text or "(no Python stack: the process had not finished starting)"
        return stacks

    def _raise_if_failed(self, out: _Outcome, what: str) -> None:
        if not out.failures and not out.unfinished:
            return
        stacks = self._dump_stacks(out.unfinished) if out.unfinished else {}
        self.kill()
        n = self.world_size
        lines = []
        if out.timed_out:
            lines.append(
                f"timed out after {self.timeout:g} s {what}: rank(s) {_ranks(out.unfinished)} "
                f"of {n} still running, killed"
            )
        else:
            lines.append(f"{len(out.failures)} of {n} rank(s) failed {what}:")
        for rank in sorted(out.failures):
            lines.append(f"  rank {rank}: {out.summaries[rank]}")
        if out.unfinished and not out.timed_out:
            lines.append(
                f"  rank(s) {_ranks(out.unfinished)} did not finish: killed "
                f"{FAILURE_GRACE_S:g} s after the first failure"
            )
        for rank in sorted(out.failures):
            lines.append(f"\n===== rank {rank}: traceback =====\n{out.failures[rank].rstrip()}")
        for rank in out.unfinished:
            when = "at the timeout" if out.timed_out else "when killed"
            lines.append(f"\n===== rank {rank}: Python stack {when} =====\n{stacks[rank]}")
        cls = RankTimeout if out.timed_out else RankFailure
        raise cls("\n".join(lines), failures=out.failures, unfinished=out.unfinished, stacks=stacks)


def _trim_stack(text: str) -> str:
    """Drop the harness's own frames (hp_testing worker, multiprocessing) from a stack dump."""
    worker = os.path.join("hp_testing", "_worker.py")
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if not line.startswith("  "):  # a thread header ("Current thread 0x...") or a blank
            skipping = False
            out.append(line)
        elif not skipping and worker in line:
            skipping = True
            out.append("  ... (hp_testing harness frames omitted)")
        elif not skipping:
            out.append(line)
    return "\n".join(out)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, offset: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""
