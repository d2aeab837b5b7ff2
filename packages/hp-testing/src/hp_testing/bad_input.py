"""Tables of bad calls for the "bad input raises a typed error on every rank" tests (issue 26).

A test file lists :class:`Case` rows (a call that must raise, the error class, a regex for the
message). On each rank :func:`run_case` runs a row's call, optionally counting the collectives
it makes (:func:`count_calls`), then runs a collective of its own to prove that no rank was left
waiting inside one, and returns a picklable summary. In the parent :func:`check` asserts that
every rank raised the same error, of the row's class and of the package's base class, with a
matching message, and (unless the row allows it) before any collective::

    CASES = by_id([Case("f/x_str", lambda c: f(c.mesh, x="a"), PkgTypeError, r"x='a'"), ...])

    def _run_case(case_id):  # on each rank
        return run_case(CASES[case_id].call, _ctx(), count=(dist, ("all_reduce", "broadcast")))

    @pytest.mark.parametrize("case_id", list(CASES))
    def test_bad_input(pool, case_id):
        check(CASES[case_id], pool.run(_run_case, case_id), PkgError)

Development only; depends on torch alone.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Case", "by_id", "check", "count_calls", "group_alive", "run_case", "type_name"]


@dataclass(frozen=True)
class Case:
    """One row of a bad-input table.

    ``call`` must raise ``error`` with a message that ``match`` (a regex, searched) finds; the
    regex should name the offending argument. ``collectives=True`` marks a row whose check
    itself needs a collective (e.g. a ``run_check``), so collectives before the error are
    allowed for it.
    """

    id: str
    call: Callable[..., Any]
    error: type[BaseException]
    match: str
    collectives: bool = False


def by_id(cases: Iterable[Case]) -> dict[str, Case]:
    """Index ``cases`` by id, in order; a ``ValueError`` names any id given twice."""
    out: dict[str, Case] = {}
    for case in cases:
        if case.id in out:
            raise ValueError(f"case id {case.id!r} is given twice")
        out[case.id] = case
    return out


def type_name(cls: type) -> str:
    """``module.QualifiedName`` of ``cls``: how :func:`run_case` names error classes."""
    return f"{cls.__module__}.{cls.__qualname__}"


@contextmanager
def count_calls(obj: object, names: Iterable[str]) -> Iterator[list[str]]:
    """Within the block, wrap the attributes ``names`` of ``obj`` so that each call appends its
    name to the list yielded; the originals are put back afterwards.

    ``obj`` may be a module (``torch.distributed``) or an instance whose methods live on its
    class (the wrapper is then set on the instance and removed at the end). A missing name
    raises ``AttributeError`` before anything is wrapped.
    """
    names = tuple(names)
    originals = {name: getattr(obj, name) for name in names}
    own = getattr(obj, "__dict__", {})
    had_own = {name: name in own for name in names}
    seen: list[str] = []

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return fn(*args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(obj, name, counting(name, fn))
        yield seen
    finally:
        for name, fn in originals.items():
            if had_own[name]:
                setattr(obj, name, fn)
            elif name in getattr(obj, "__dict__", {}):
                delattr(obj, name)


def group_alive() -> float:
    """All-reduce a tensor holding 1 over the default process group and return the sum (the
    world size): every rank reaching it shows that none was left inside a collective."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def run_case(
    call: Callable[..., Any],
    *args: Any,
    count: tuple[object, Iterable[str]] | None = None,
    alive: Callable[[], Any] | None = group_alive,
) -> dict[str, Any]:
    """Run ``call(*args)`` on this rank, which should raise; return a picklable summary.

    ``count=(obj, names)`` counts the calls to those attributes of ``obj`` made by ``call``
    (see :func:`count_calls`). After the call (and its counting) ``alive()`` runs, usually a
    collective (:func:`group_alive` by default; ``None`` skips it).

    Keys: ``raised`` (:func:`type_name` of the exception, ``None`` if nothing was raised),
    ``types`` (the type names of its classes, most derived first), ``message``,
    ``collectives`` (the counted names in call order, ``None`` without ``count``) and
    ``alive`` (what ``alive()`` returned, or ``None``).
    """
    seen: list[str] | None = None
    out: dict[str, Any] = {"raised": None, "types": [], "message": None}
    try:
        if count is None:
            call(*args)
        else:
            with count_calls(*count) as seen:
                call(*args)
    except Exception as e:
        out = {
            "raised": type_name(type(e)),
            "types": [type_name(c) for c in type(e).__mro__],
            "message": str(e),
        }
    out["collectives"] = None if seen is None else list(seen)
    out["alive"] = None if alive is None else alive()
    return out


_WORLD_SIZE: Any = object()


def check(
    case: Case,
    results: Sequence[dict[str, Any]],
    base_error: type[BaseException],
    *,
    alive: Any = _WORLD_SIZE,
) -> None:
    """Assert that ``results`` (one :func:`run_case` summary per rank) show ``case`` failing
    properly: the same summary on every rank; an exception raised that is both a
    ``case.error`` and a ``base_error``; its message matched by ``case.match``; no counted
    collective before it unless ``case.collectives``; and ``alive`` returned on every rank
    (by default the world size, ``len(results)``, as :func:`group_alive` returns it)."""
    want_alive = float(len(results)) if alive is _WORLD_SIZE else alive
    assert results, f"{case.id}: no results"
    assert all(r == results[0] for r in results), f"ranks differ: {list(results)}"
    r = results[0]
    assert r["raised"] is not None, f"{case.id}: no error raised"
    assert type_name(case.error) in r["types"] and type_name(base_error) in r["types"], (
        f"{case.id}: raised {r['raised']}, want {case.error.__name__} "
        f"(a {base_error.__name__}): {r}"
    )
    assert re.search(case.match, r["message"]), f"{case.id}: {r['message']!r} !~ {case.match!r}"
    if not case.collectives and r["collectives"] is not None:
        assert r["collectives"] == [], f"{case.id}: raised after collectives {r['collectives']}"
    assert r["alive"] == want_alive, f"{case.id}: alive={r['alive']!r}, want {want_alive!r}"
