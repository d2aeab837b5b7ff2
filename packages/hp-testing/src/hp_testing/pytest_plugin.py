"""pytest support: share one :class:`~hp_testing.RankPool` per test module (or session).

In a test module::

    from hp_testing.pytest_plugin import rank_pool_fixture

    pool = rank_pool_fixture(4)          # a module-scoped fixture named ``pool``

    def test_sum(pool):
        assert pool.run(_body) == [True] * 4

This module imports pytest; import it only from tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from ._pool import RankPool


def rank_pool_fixture(
    world_size: int,
    *,
    scope: str = "module",
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> Any:
    """Make a pytest fixture that yields a started :class:`RankPool` shared across ``scope``.

    Assign the result to a module-level name; that name is the fixture's name. The pool is
    closed when the scope ends; after a failing test it restarts on its next ``run``.
    """

    @pytest.fixture(scope=scope)  # type: ignore[misc]
    def _rank_pool() -> Iterator[RankPool]:
        with RankPool(world_size, timeout=timeout, backend=backend, env=env) as pool:
            yield pool

    return _rank_pool
