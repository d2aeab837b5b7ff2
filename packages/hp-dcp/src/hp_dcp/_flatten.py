"""Nested state dicts to flat ``"a.b.c"`` keys, with a way to write values back in place.

Dicts are always walked; lists and tuples only when they hold a tensor somewhere (so an
optimizer's ``"params"`` list or Python's RNG tuple stay single values). An object with
``state_dict()`` and ``load_state_dict()`` (a *Stateful*, as in PyTorch DCP) is replaced by its
state dict, walked the same way, and handed back through ``load_state_dict`` after a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import StateDictError

__all__ = ["Leaf", "flatten", "is_stateful"]


def is_stateful(v: Any) -> bool:
    """True for objects with callable ``state_dict`` and ``load_state_dict`` (not tensors)."""
    return (
        not isinstance(v, torch.Tensor)
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


@dataclass
class Leaf:
    """A value at ``key``; ``container[index]`` is where it lives (for writing back)."""

    key: str
    value: Any
    container: Any
    index: Any

    def set(self, value: Any) -> None:
        if isinstance(self.container, tuple):
            if value != self.value:
                raise StateDictError(
                    f"state_dict key {self.key!r} sits in a tuple and cannot be replaced by the "
                    "loaded value: use a list or a dict there"
                )
            return
        self.container[self.index] = value
        self.value = value


def _has_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, Mapping):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def flatten(state_dict: Mapping) -> tuple[dict[str, Leaf], list[tuple[Any, dict]]]:
    """Leaves by flat key, and the Statefuls met as ``(object, its state dict)`` in the order
    their ``load_state_dict`` must run (inner ones first)."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(
            f"state_dict must be a dict (got {type(state_dict).__name__}): wrap a module as "
            "{'model': model} or pass model.state_dict()"
        )
    leaves: dict[str, Leaf] = {}
    statefuls: list[tuple[Any, dict]] = []

    def walk(container, index, value, key):
        if is_stateful(value):
            sd = value.state_dict()
            if not isinstance(sd, Mapping):
                raise StateDictError(
                    f"state_dict key {key!r}: {type(value).__name__}.state_dict() returned "
                    f"{type(sd).__name__}, not a dict"
                )
            for k, v in sd.items():
                walk(sd, k, v, _join(key, k))
            statefuls.append((value, sd))
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(value, k, v, _join(key, k))
            return
        if isinstance(value, (list, tuple)) and _has_tensor(value):
            for i, v in enumerate(value):
                walk(value, i, v, _join(key, i))
            return
        if key in leaves:
            raise StateDictError(
                f"two entries of the state dict flatten to the same key {key!r}: rename one "
                "(keys are joined with '.')"
            )
        leaves[key] = Leaf(key, value, container, index)

    for k, v in state_dict.items():
        walk(state_dict, k, v, _join("", k))
    return leaves, statefuls


def _join(prefix: str, k: Any) -> str:
    if not isinstance(k, (str, int)):
        raise StateDictError(
            f"state dict key {k!r} under {prefix or 'the top level'!r} is a "
            f"{type(k).__name__}: keys must be str or int"
        )
    return f"{prefix}.{k}" if prefix else str(k)
