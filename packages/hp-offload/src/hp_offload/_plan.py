"""``OffloadPlan``: checkpoint and swap configured together, per module name pattern.

The plan is framework-neutral: it reads a model's submodule names and swaps wrapped ones in,
for a torch ``nn.Module`` (``named_modules``) or a MindSpore ``nn.Cell`` (``cells_and_names``);
the wrappers themselves pick the framework (``checkpoint_wrapper`` / ``swap_wrapper``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ._checkpoint import CheckpointPolicy, OffloadError, OffloadTypeError, checkpoint_wrapper
from ._checks import check_module, check_type
from ._swap import SwapManager, SwapPolicy, swap_wrapper

__all__ = ["OffloadPlan", "apply_offload_plan"]

_RANGE = re.compile(r"^(?P<head>.*?)(?P<lo>\d+)-(?P<hi>\d+)(?P<tail>.*)$")


def _expand(pattern: str) -> list[str]:
    """``"layers.0-3"`` -> ``["layers.0", ..., "layers.3"]``; other patterns as they are
    (wildcards allowed)."""
    m = _RANGE.match(pattern)
    if not m:
        return [pattern]
    lo, hi = int(m["lo"]), int(m["hi"])
    if hi < lo:
        raise OffloadError(f"pattern {pattern!r}: range {lo}-{hi} is empty")
    return [f"{m['head']}{i}{m['tail']}" for i in range(lo, hi + 1)]


def _names(model, fn: str) -> list[str]:
    """Every submodule's dotted name, a shared one under each of its names: a torch
    ``nn.Module``'s, or a MindSpore ``nn.Cell``'s (its binding lists them; the one framework
    check, ``hp_dtensor.framework_of``, picks it); anything else is refused."""
    from hp_dtensor import framework_of

    if framework_of(model) == "mindspore":
        from ._backend._mindspore import cell_names

        return cell_names(model, fn)
    check_module(model, "model", fn)
    return [n for n, _ in model.named_modules(remove_duplicate=False) if n]


def _regex(pattern: str) -> re.Pattern:
    """A name pattern as a regex: ``*`` and ``?`` stay within one dotted component."""
    out = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile(out)


@dataclass(frozen=True)
class OffloadPlan:
    """Module-name patterns -> what to do with the matched modules' activations.

    Values: ``"checkpoint"`` (full), ``"swap"``, a :class:`CheckpointPolicy` or a
    :class:`SwapPolicy`. Patterns are module names, wildcards (``*``/``?`` within one dotted
    part), or ranges (``"layers.0-11"``). No module may be matched by two patterns, nor sit
    inside another matched module.
    """

    rules: Mapping[str, object]

    def __post_init__(self) -> None:
        if not isinstance(self.rules, Mapping):
            raise OffloadTypeError(
                f"OffloadPlan: rules is a {type(self.rules).__name__}: give a non-empty "
                "{pattern: action} mapping, e.g. {'layers.*': 'checkpoint'}"
            )
        if not self.rules:
            raise OffloadError(
                "OffloadPlan: rules is empty: give a non-empty {pattern: action} mapping, "
                "e.g. {'layers.*': 'checkpoint'}"
            )
        for pat, action in self.rules.items():
            if not isinstance(pat, str):
                raise OffloadTypeError(
                    f"OffloadPlan: pattern {pat!r} is a {type(pat).__name__}: give a module "
                    "name pattern string such as 'layers.0-3' or 'layers.*'"
                )
            if not pat:
                raise OffloadError(f"OffloadPlan: pattern {pat!r} must be a non-empty string")
            _expand(pat)  # an empty range ("layers.3-1") is an error now, not at apply time
            if not (
                action in ("checkpoint", "swap")
                or isinstance(action, (CheckpointPolicy, SwapPolicy))
            ):
                raise OffloadError(
                    f"pattern {pat!r}: action must be 'checkpoint', 'swap', a CheckpointPolicy or"
                    f" a SwapPolicy, got {action!r}"
                )

    def resolve(self, model) -> dict[str, object]:
        """Module name -> action, after checking that patterns neither overlap nor nest
        (``model``: a torch ``nn.Module`` or a MindSpore ``nn.Cell``)."""
        return self._match(model, _names(model, "OffloadPlan.resolve"))

    def _match(self, model, names: list[str]) -> dict[str, object]:
        """:meth:`resolve` over ``model``'s submodule ``names``, already listed."""
        chosen: dict[str, tuple[str, object]] = {}
        for pat, action in self.rules.items():
            rx = [_regex(p) for p in _expand(pat)]
            hits = [n for r in rx for n in names if r.fullmatch(n)]
            if not hits:
                raise OffloadError(f"pattern {pat!r} matches no module of {type(model).__name__}")
            for n in dict.fromkeys(hits):
                if n in chosen:
                    raise OffloadError(
                        f"module {n!r} is matched by two patterns: {chosen[n][0]!r} and {pat!r}"
                    )
                chosen[n] = (pat, action)
        for a in chosen:
            for b in chosen:
                if a != b and b.startswith(a + "."):
                    raise OffloadError(
                        f"module {b!r} ({chosen[b][0]!r}) lies inside {a!r} ({chosen[a][0]!r}); "
                        "patterns must not nest"
                    )
        return {n: act for n, (_, act) in chosen.items()}


def apply_offload_plan(model, plan: OffloadPlan, *, manager: SwapManager | None = None):
    """Wrap the modules the plan names, in place; returns ``model`` (a torch ``nn.Module``, or
    a MindSpore ``nn.Cell``, whose cells the MindSpore binding wraps).

    A module reachable under several names (shared) is wrapped once. For a
    :class:`CheckpointPolicy` with ``every=k``, only every k-th matched module (in model order)
    is checkpointed.
    """
    names = _names(model, "apply_offload_plan")  # a torch module or a MindSpore cell
    if not isinstance(plan, OffloadPlan):
        hint = " (wrap the mapping: OffloadPlan({...}))" if isinstance(plan, Mapping) else ""
        raise OffloadTypeError(
            f"apply_offload_plan: plan is a {type(plan).__name__}: pass an OffloadPlan{hint}"
        )
    check_type(manager, SwapManager, "manager", "apply_offload_plan")
    actions = plan._match(model, names)  # the names listed once
    by_policy: dict[int, int] = {}
    done: dict[int, object] = {}
    for name, action in actions.items():
        *path, child = name.split(".")
        parent = model
        for part in path:  # getattr reaches a ModuleList's / CellList's items too ("0")
            parent = getattr(parent, part)
        mod = getattr(parent, child)
        if id(mod) in done:
            _put(parent, child, done[id(mod)])
            continue
        if action == "swap" or isinstance(action, SwapPolicy):
            pol = action if isinstance(action, SwapPolicy) else None
            new = swap_wrapper(mod, manager=manager, policy=pol)
        else:
            pol = action if isinstance(action, CheckpointPolicy) else CheckpointPolicy()
            k = by_policy.get(id(action), 0)
            by_policy[id(action)] = k + 1
            if k % pol.every:
                continue
            new = checkpoint_wrapper(mod, policy=pol)
        done[id(mod)] = new
        _put(parent, child, new)
    return model


def _put(parent, name: str, new) -> None:
    """``parent.name = new``; a MindSpore ``CellList`` / ``SequentialCell`` item by index
    (its ``setattr`` would rename the new cell's parameters after the bare index)."""
    from hp_dtensor import framework_of

    if name.isdigit() and framework_of(parent) == "mindspore":
        parent[int(name)] = new
    else:
        setattr(parent, name, new)
