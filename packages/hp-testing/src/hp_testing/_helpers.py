"""Small helpers for test bodies: comparing tensors and seeding every RNG."""

from __future__ import annotations

import random
from typing import Any


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """``torch.testing.assert_close`` with an optional message put before torch's own.

    Unlike torch, giving only one of ``rtol``/``atol`` is allowed: the other is then 0.
    Tolerances default to torch's per-dtype defaults.
    """
    import torch

    if (rtol is None) != (atol is None):
        rtol = 0.0 if rtol is None else rtol
        atol = 0.0 if atol is None else atol
    extra: dict[str, Any] = {}
    if msg:
        extra["msg"] = lambda default: f"{msg}\n{default}"
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, **extra)


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and every accelerator)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
