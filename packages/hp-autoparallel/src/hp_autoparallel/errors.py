"""Typed errors of hp_autoparallel. Each message names the argument (or file field), the value
and the fix; where a nearby valid choice exists it is named too."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "CalibrationError",
    "ClusterFileError",
    "NoPlanError",
    "PlanError",
    "PlanTypeError",
    "UnknownGpuError",
    "UnknownModelError",
]


class PlanError(ValueError):
    """A planning input that cannot work (the base class of this package's errors)."""


class PlanTypeError(PlanError, TypeError):
    """An argument of the wrong type (names it and what to pass instead)."""


class UnknownModelError(PlanError):
    """``--model`` names no model of hp-trainer's registry; the message suggests the nearest."""


class UnknownGpuError(PlanError):
    """``--gpu`` names no shipped calibration file and no such file exists."""


class CalibrationError(PlanError):
    """A GPU calibration file is missing a field, or a field has the wrong type or range."""


class ClusterFileError(PlanError):
    """A cluster file is missing a field, or a field has the wrong type or range."""


class NoPlanError(PlanError):
    """No configuration of the model fits the GPUs asked for; the message names the nearest GPU
    count that has one (when the search found one) and why the families were rejected."""


def nearest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to ``name`` (difflib), or None when nothing is close."""
    hits = difflib.get_close_matches(name, list(options), n=1, cutoff=0.4)
    return hits[0] if hits else None


def check_int(value, arg: str, fn: str, *, low: int = 1) -> int:
    """``value`` as an int >= ``low``; :class:`PlanTypeError` / :class:`PlanError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanTypeError(f"{fn}: {arg}={value!r} is a {type(value).__name__}: give an int")
    if value < low:
        raise PlanError(f"{fn}: {arg}={value} must be at least {low}")
    return value
