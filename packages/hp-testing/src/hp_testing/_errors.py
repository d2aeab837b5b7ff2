"""Exceptions raised in the parent process when ranks fail or hang."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class RankFailure(RuntimeError):
    """One or more ranks failed: raised an exception, died, or could not start.

    The message lists every failing rank with the traceback formatted in that rank, and names
    the ranks that did not finish (they were killed shortly after the first failure), with the
    Python stack each of them had when it was killed.

    Attributes:
        failures: rank -> formatted traceback (or death report) of each failing rank.
        unfinished: ranks that were still running when the call was given up.
        stacks: rank -> Python stack (faulthandler dump) of each unfinished rank.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        unfinished: Iterable[int] = (),
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.unfinished: list[int] = sorted(unfinished)
        self.stacks: dict[int, str] = dict(stacks or {})


class RankTimeout(RankFailure):
    """The call did not finish within its timeout; the ranks still running were killed.

    ``unfinished`` names those ranks and ``stacks`` holds the Python stack of each, taken just
    before it was killed.
    """
