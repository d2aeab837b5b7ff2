"""Per-layer activation offload policy: for a memory budget, keep, recompute or swap each
layer's saved activations so the step is as fast as the budget allows.

The three choices cost different things. Keeping a layer costs its saved bytes for the whole
backward and no time. Recomputing keeps only its input and costs its forward again. Swapping
keeps nothing on the device once its copy to the host is done, and costs nothing while that
copy (and the copy back in backward) hides under compute; where it does not, the step waits.
Whether a copy hides depends on the layers around it: the device-to-host link runs one copy
at a time, and a copy can only start when its layer's forward is done.

:func:`simulate` replays one step on two timelines, the device's compute stream and the
link's copy streams, with the rules hp-offload's ``SwapManager`` follows: a swapped layer's
copy starts when its forward ends and copies run one after another; forward waits once more
than ``max_inflight_bytes`` are still to copy; a swapped layer's tensors start coming back
when backward reaches the swapped layer after it (the next one backward meets), so the copy
back of layer *k* overlaps backward from the later swapped layer down to *k*; a device copy
is freed when the manager next looks after its transfer ends (a swapped layer's forward or
backward), not by the kept and recomputed layers between. It returns the activation peak
(saved tensors, the recomputed set, restored and not-yet-freed bytes, parameter gradients
made so far and a layer's backward temporaries) and the time beyond keeping everything.

:func:`offload_policy` searches the actions: from every layer recomputed, swapped or kept,
it first lowers the peak one layer's change at a time until it fits, then applies the
change of one layer (or, where none helps, of two) that saves
the most time (or, at equal time, the most memory) while the simulated peak stays within
the budget, until none helps. The costs
are measured (hp-offload's benchmark measures one layer on the device) or taken from the
planner's models; nothing here needs torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlanError, PlanTypeError

__all__ = ["ACTIONS", "LayerCost", "OffloadPolicy", "offload_policy", "simulate"]

ACTIONS = ("keep", "recompute", "swap")
# hp-trainer's ``activation_checkpoint.plan`` actions for ours
_TRAINER_ACTION = {"keep": "none", "recompute": "full", "swap": "swap"}


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs under each action.

    ``saved_bytes``: device bytes its forward saves for backward (what keeping holds, and
    what swapping moves); ``input_bytes``: what recomputing keeps instead (its input);
    ``forward_s`` / ``backward_s``: its forward and backward times (a recompute reruns the
    forward); ``grad_bytes``: its parameters' gradients, made in its backward and kept;
    ``backward_extra_bytes``: temporaries its backward allocates beyond its saved tensors.
    """

    saved_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    grad_bytes: int = 0
    backward_extra_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("saved_bytes", "input_bytes", "grad_bytes", "backward_extra_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise PlanTypeError(f"LayerCost: {name}={v!r} is a {type(v).__name__}: give an int")
            if v < 0:
                raise PlanError(f"LayerCost: {name}={v} must be >= 0")
        for name in ("forward_s", "backward_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise PlanTypeError(
                    f"LayerCost: {name}={v!r} is a {type(v).__name__}: give seconds as a float"
                )
            if v < 0:
                raise PlanError(f"LayerCost: {name}={v} must be >= 0")


@dataclass(frozen=True)
class OffloadPolicy:
    """Per-layer actions (``"keep"``, ``"recompute"``, ``"swap"``), the simulated activation
    peak in bytes and the simulated time over keeping every layer (seconds)."""

    actions: tuple[str, ...]
    peak_bytes: int
    extra_s: float

    def counts(self) -> dict[str, int]:
        """How many layers take each action."""
        return {a: self.actions.count(a) for a in ACTIONS}

    def trainer_plan(self, prefix: str = "layers") -> str:
        """hp-trainer's ``activation_checkpoint.plan`` for these actions, runs of equal actions
        merged: ``"layers.0-3=swap,layers.4-19=full,layers.20-23=none"``."""
        parts, start = [], 0
        for i in range(1, len(self.actions) + 1):
            if i == len(self.actions) or self.actions[i] != self.actions[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                parts.append(f"{prefix}.{span}={_TRAINER_ACTION[self.actions[start]]}")
                start = i
        return ",".join(parts)


def _check_link(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PlanTypeError(f"{name}={v!r} is a {type(v).__name__}: give bytes per second")
    if v <= 0:
        raise PlanError(f"{name}={v} must be > 0 (bytes per second of the host link)")
    return float(v)


def simulate(
    layers: Sequence[LayerCost],
    actions: Sequence[str],
    *,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float | None = None,
    other_bytes: int = 0,
    head_bytes: int = 0,
    head_s: float = 0.0,
    max_inflight_bytes: int | None = 1 << 30,
    swap_overhead_s: float = 0.0,
) -> tuple[int, float]:
    """``(activation peak bytes, seconds over keeping everything)`` of one forward + backward
    with ``actions[i]`` for ``layers[i]`` (the module docstring gives the rules).

    ``other_bytes``: held through the whole step beside the layers (the other parameters'
    gradients); ``head_bytes``: what the head and the loss add, at their peak, between the
    last layer's forward and its backward (logits, their fp32 copies and gradients);
    ``head_s``: the time between those two, during which copies go on; ``swap_overhead_s``:
    host time each swapped layer adds."""
    if len(actions) != len(layers):
        raise PlanError(
            f"simulate: {len(actions)} actions for {len(layers)} layers: give one per layer"
        )
    for a in actions:
        if a not in ACTIONS:
            raise PlanError(f"simulate: action {a!r}: give one of {list(ACTIONS)}")
    d2h = _check_link("d2h_bytes_per_s", d2h_bytes_per_s)
    h2d = d2h if h2d_bytes_per_s is None else _check_link("h2d_bytes_per_s", h2d_bytes_per_s)
    cap = float("inf") if max_inflight_bytes is None else max_inflight_bytes
    n = len(layers)
    t = 0.0
    copy_free = 0.0
    out_done = [0.0] * n  # when a swapped layer's copy to the host ends
    # (end of copy, bytes): device copies not yet freed. As in SwapManager, a device copy is
    # freed when the manager next looks (a swapped layer's forward or backward, or the
    # forward waiting on the cap), not when its transfer ends: kept and recomputed layers
    # run no hook, so a copy done during them stays until the next swapped layer
    pending: list[tuple[float, int]] = []
    held = [0] * n  # device bytes each layer holds between its forward and its backward
    peak = other_bytes

    def live() -> int:
        return sum(b for _, b in pending)

    def drain(now: float) -> None:
        pending[:] = [(end, b) for end, b in pending if end > now]

    for i, (c, a) in enumerate(zip(layers, actions)):
        t += c.forward_s
        if a == "keep":
            held[i] = c.saved_bytes
        elif a == "recompute":
            held[i] = c.input_bytes
        else:
            start = max(t, copy_free)
            copy_free = out_done[i] = start + c.saved_bytes / d2h
            pending.append((out_done[i], c.saved_bytes))
            # the forward produced these bytes before its copy could take them
            peak = max(peak, other_bytes + sum(held) + live())
            drain(t)  # the region's end frees the copies that are done
            while live() > cap:  # forward waits for the oldest copies
                end, _ = pending.pop(0)
                t = max(t, end)
        peak = max(peak, other_bytes + sum(held) + live())
    # the head and the loss run beside every held layer; copies go on meanwhile, so what is
    # still to copy at their end is the least they overlap with
    t += head_s
    peak = max(peak, other_bytes + head_bytes + sum(held) + live())

    swapped = [i for i in range(n) if actions[i] == "swap"]
    back_done: dict[int, float] = {}  # when a swapped layer's tensors are back on the device
    in_free = 0.0
    restored: dict[int, int] = {}  # swapped layers whose tensors are (coming) back: bytes

    def restore(i: int, now: float) -> None:
        nonlocal in_free
        if i in back_done:
            return
        start = max(now, in_free, out_done[i])
        in_free = back_done[i] = start + layers[i].saved_bytes / h2d
        restored[i] = layers[i].saved_bytes

    grads = 0
    for i in range(n - 1, -1, -1):
        c, a = layers[i], actions[i]
        if a == "swap":
            drain(t)  # the first unpack frees the device copies that are done
            restore(i, t)
            k = swapped.index(i)
            if k > 0:  # prefetch the swapped layer backward meets next
                restore(swapped[k - 1], t)
            t = max(t, back_done[i]) + swap_overhead_s
        grads += c.grad_bytes
        working = c.backward_extra_bytes + (c.saved_bytes if a == "recompute" else 0)
        below = sum(held[:i])
        peak = max(
            peak,
            other_bytes + below + held[i] + sum(restored.values()) + live() + grads + working,
        )
        t += c.backward_s + (c.forward_s if a == "recompute" else 0.0)
        held[i] = 0
        restored.pop(i, None)
    base = sum(c.forward_s + c.backward_s for c in layers) + head_s
    extra = t - base
    return int(peak), extra if extra > 1e-12 * max(1.0, base) else 0.0


def _single(acts: list[str], allow: tuple[str, ...]):
    """Every action list that differs from ``acts`` at one layer."""
    for i in range(len(acts)):
        for a in allow:
            if a != acts[i]:
                yield acts[:i] + [a] + acts[i + 1 :]


def _pairs(acts: list[str], allow: tuple[str, ...]):
    """Every action list that differs from ``acts`` at two layers."""
    n = len(acts)
    for i in range(n):
        for j in range(i + 1, n):
            for a in allow:
                if a == acts[i]:
                    continue
                for b in allow:
                    if b != acts[j]:
                        trial = list(acts)
                        trial[i], trial[j] = a, b
                        yield trial


def _better(e: float, p: int, e0: float, p0: int, tol: float = 1e-9) -> bool:
    """Whether (time ``e``, peak ``p``) beats (``e0``, ``p0``): less time, or as much (within
    ``tol`` seconds) and less memory."""
    return e < e0 - tol or (e <= e0 + tol and p < p0)


def offload_policy(
    layers: Sequence[LayerCost],
    budget_bytes: int,
    *,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float | None = None,
    other_bytes: int = 0,
    head_bytes: int = 0,
    head_s: float = 0.0,
    max_inflight_bytes: int | None = 1 << 30,
    swap_overhead_s: float = 0.0,
    allow: Sequence[str] = ACTIONS,
) -> OffloadPolicy:
    """The per-layer actions that make the step fastest with the simulated activation peak
    within ``budget_bytes`` (the other arguments as :func:`simulate`'s; ``allow``: the actions
    to choose from). Raises :class:`~hp_autoparallel.errors.PlanError` naming the least peak
    the search reached when it fits none (a local search: the true least may be lower)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise PlanTypeError(
            f"offload_policy: budget_bytes={budget_bytes!r} is a {type(budget_bytes).__name__}: "
            "give an int (bytes)"
        )
    if not layers:
        raise PlanError("offload_policy: layers is empty: give one LayerCost per layer")
    for c in layers:
        if not isinstance(c, LayerCost):
            raise PlanTypeError(
                f"offload_policy: layers holds a {type(c).__name__}: give LayerCost objects"
            )
    allow = tuple(allow)
    bad = [a for a in allow if a not in ACTIONS]
    if bad or not allow:
        raise PlanError(f"offload_policy: allow={list(allow)}: give a subset of {list(ACTIONS)}")
    kw = dict(
        d2h_bytes_per_s=d2h_bytes_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        other_bytes=other_bytes,
        head_bytes=head_bytes,
        head_s=head_s,
        max_inflight_bytes=max_inflight_bytes,
        swap_overhead_s=swap_overhead_s,
    )
    n = len(layers)
    starts = [a for a in ("recompute", "swap", "keep") if a in allow]
    best: OffloadPolicy | None = None
    smallest: int | None = None
    for first in starts:
        acts = [first] * n
        peak, extra = simulate(layers, acts, **kw)
        while peak > budget_bytes:  # first fit: the change that lowers the peak the most
            move = None
            for i in range(n):
                for a in allow:
                    if a != acts[i]:
                        p, e = simulate(layers, acts[:i] + [a] + acts[i + 1 :], **kw)
                        if p < peak and (move is None or (p, e) < (move[3], move[2])):
                            move = (i, a, e, p)
            if move is None:
                break
            acts[move[0]] = move[1]
            extra, peak = move[2], move[3]
        smallest = peak if smallest is None else min(smallest, peak)
        if peak > budget_bytes:
            continue
        # the change that saves the most time and still fits; the cap guards the tolerance
        # in _better, which is not transitive at the scale of tol
        for _ in range(4 * n * len(allow)):
            move = None
            # one layer's change first; where none helps, two layers' at once (trading one
            # layer's memory for another's time)
            for trials in (_single(acts, allow), _pairs(acts, allow)):
                for trial in trials:
                    p, e = simulate(layers, trial, **kw)
                    # better: less time, or the same time and less memory (which a later
                    # change can spend); a strict order over (time, peak), so no cycle
                    if p > budget_bytes or not _better(e, p, extra, peak):
                        continue
                    if move is None or _better(e, p, move[1], move[2]):
                        move = (trial, e, p)
                if move is not None:
                    break
            if move is None:
                break
            acts, extra, peak = move
        if best is None or _better(extra, peak, best.extra_s, best.peak_bytes):
            best = OffloadPolicy(tuple(acts), peak, extra)
    if best is None:
        raise PlanError(
            f"offload_policy: budget_bytes={budget_bytes} ({budget_bytes / 2**30:.2f} GiB) is "
            f"below what this search could fit: the least it found is {smallest} bytes "
            f"({smallest / 2**30:.2f} GiB); raise the budget to at least that"
        )
    return best
