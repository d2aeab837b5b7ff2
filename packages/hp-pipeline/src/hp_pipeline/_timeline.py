"""Timelines of pipeline runs, simulated or measured: bubble fraction, Chrome trace, Gantt PNG.

A timeline is a list of ``TimelineEvent`` values: which rank ran which step (a schedule step
string such as ``"1F0"``, ``"0FULL_B3"`` or ``"1B0+0F2"``) from when to when, in seconds.
``bubble_fraction`` measures idle compute time, ``to_chrome_trace`` writes a trace that
chrome://tracing and Perfetto open, and ``plot_timeline`` draws a PNG Gantt chart (needs
matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EVENT_KINDS",
    "TimelineError",
    "TimelineEvent",
    "bubble_fraction",
    "plot_timeline",
    "to_chrome_trace",
]

#: The allowed ``TimelineEvent.kind`` values.
EVENT_KINDS = ("compute", "comm", "wait")


class TimelineError(ValueError):
    """A timeline or its arguments are invalid (no events, an event ending before it starts)."""


@dataclass(frozen=True)
class TimelineEvent:
    """One step on one rank: ``start``/``end`` in seconds, ``kind`` one of ``EVENT_KINDS``."""

    rank: int
    step: str
    start: float
    end: float
    kind: str = "compute"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise TimelineError(f"rank must be an int >= 0, got {self.rank!r}")
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise TimelineError(f"start and end must be finite, got {self.start}, {self.end}")
        if self.end < self.start:
            raise TimelineError(
                f"end ({self.end}) is before start ({self.start}) for step {self.step!r} "
                f"on rank {self.rank}; swap them"
            )
        if self.kind not in EVENT_KINDS:
            raise TimelineError(f"kind must be one of {EVENT_KINDS}, got {self.kind!r}")

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


def _events(events: Iterable[TimelineEvent]) -> list[TimelineEvent]:
    evs = list(events)
    if not evs:
        raise TimelineError("events is empty; pass at least one TimelineEvent")
    for k, e in enumerate(evs):
        if not isinstance(e, TimelineEvent):
            raise TimelineError(f"events[{k}] must be a TimelineEvent, got {type(e).__name__}")
    return evs


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total = 0.0
    cur_start = cur_end = None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        elif e > cur_end:
            cur_end = e
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def bubble_fraction(events: Iterable[TimelineEvent]) -> float:
    """Idle share of the compute capacity: ``1 - busy / (ranks * span)``.

    ``busy`` sums, per rank, the length of the union of its ``"compute"`` intervals (overlapping
    steps count once); ``ranks`` is the number of distinct ranks among all events and ``span``
    runs from the earliest start to the latest end of any event.
    """
    evs = _events(events)
    t0 = min(e.start for e in evs)
    t1 = max(e.end for e in evs)
    span = t1 - t0
    if span <= 0:
        raise TimelineError("events span zero time; give events with end > start")
    ranks = {e.rank for e in evs}
    per_rank: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
    for e in evs:
        if e.kind == "compute":
            per_rank[e.rank].append((e.start, e.end))
    busy = sum(_busy(iv) for iv in per_rank.values())
    return 1.0 - busy / (len(ranks) * span)


def to_chrome_trace(
    events: Iterable[TimelineEvent],
    path: str | os.PathLike[str] | None = None,
    *,
    name: str = "hp_pipeline",
) -> dict[str, Any]:
    """The events as a Chrome trace (``{"traceEvents": [...], "displayTimeUnit": "ms"}``).

    Each event becomes a complete (``"X"``) event with ``ts``/``dur`` in microseconds from the
    earliest start, ``pid`` 0, ``tid`` the rank, ``name`` the step and ``cat`` the kind;
    metadata events name the process ``name`` and each thread ``"rank N"``. With ``path`` the
    trace is also written there as JSON (parent folders are created).
    """
    evs = _events(events)
    t0 = min(e.start for e in evs)
    ranks = sorted({e.rank for e in evs})
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}
    ]
    for r in ranks:
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        )
        trace.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}}
        )
    for e in sorted(evs, key=lambda e: (e.rank, e.start, e.end)):
        trace.append(
            {
                "name": e.step,
                "cat": e.kind,
                "ph": "X",
                "ts": round((e.start - t0) * 1e6, 3),
                "dur": round(e.duration * 1e6, 3),
                "pid": 0,
                "tid": e.rank,
            }
        )
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out), encoding="utf-8")
    return out


# -- plotting ------------------------------------------------------------------------------------

_STEP = re.compile(r"(\d+)([A-Za-z_]+)(\d*)")

#: Bar colour per step category.
_COLOURS = {
    "F": "#4c78a8",
    "B": "#f58518",
    "W": "#54a24b",
    "FULL_B": "#e45756",
    "OVERLAP": "#b279a2",
    "comm": "#9d9d9d",
    "wait": "#dddddd",
    "other": "#9d755d",
}
_LABELS = {
    "F": "forward",
    "B": "backward (input)",
    "W": "backward (weight)",
    "FULL_B": "backward (full)",
    "OVERLAP": "overlapped B+F",
    "comm": "communication",
    "wait": "wait",
    "other": "other",
}


def _classify(event: TimelineEvent) -> tuple[str, str]:
    """``(category, microbatch label)`` of an event, from its kind and step string."""
    if event.kind != "compute":
        m = _STEP.fullmatch(event.step.strip())
        return event.kind, (m.group(3) if m else "")
    parts = [_STEP.fullmatch(p.strip()) for p in event.step.split("+")]
    if not all(parts):
        return "other", ""
    mbs = "+".join(m.group(3) for m in parts if m.group(3))
    if len(parts) > 1:
        return "OVERLAP", mbs
    kind = parts[0].group(2).upper()
    if kind in ("F", "B", "W", "FULL_B"):
        return kind, mbs
    if kind.startswith(("SEND", "RECV")):
        return "comm", mbs
    return "other", mbs


def plot_timeline(
    events: Sequence[TimelineEvent] | Iterable[TimelineEvent],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    bubble: bool = True,
) -> Path:
    """Draw the events as a Gantt chart and write it to ``path`` as PNG; returns the path.

    One row per rank (rank 0 on top), bars coloured by step type (F, B, W, FULL_B, overlapped
    B+F, communication, wait), each labelled with its microbatch when the bar is wide enough.
    With ``bubble`` the title ends with the measured ``bubble_fraction``. Needs matplotlib
    (``pip install hp-pipeline[plot]``); it draws on a private figure, no pyplot state.
    """
    evs = _events(events)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("plot_timeline needs matplotlib: pip install hp-pipeline[plot]") from exc

    t0 = min(e.start for e in evs)
    span = max(e.end for e in evs) - t0
    if span <= 0:
        raise TimelineError("events span zero time; give events with end > start")
    scale, unit = (1e3, "ms") if span < 1 else (1.0, "s")
    ranks = sorted({e.rank for e in evs})
    row = {r: k for k, r in enumerate(ranks)}

    width_in, dpi = 12.0, 100
    fig = Figure(figsize=(width_in, 1.2 + 0.45 * len(ranks)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    groups: dict[str, list[tuple[TimelineEvent, str]]] = {}
    for e in evs:
        cat, label = _classify(e)
        groups.setdefault(cat, []).append((e, label))
    # Approximate pixels per unit of time, to decide which labels fit in their bar.
    px_per_s = width_in * dpi * 0.8 / span
    for cat in _COLOURS:
        if cat not in groups:
            continue
        items = groups[cat]
        ax.barh(
            [row[e.rank] for e, _ in items],
            [e.duration * scale for e, _ in items],
            left=[(e.start - t0) * scale for e, _ in items],
            height=0.8,
            color=_COLOURS[cat],
            edgecolor="black",
            linewidth=0.3,
            hatch="//" if cat == "wait" else None,
        )
        for e, label in items:
            if label and e.duration * px_per_s >= 7 * len(label) + 4:
                ax.text(
                    (e.start - t0 + e.duration / 2) * scale,
                    row[e.rank],
                    label,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if cat not in ("wait", "comm") else "black",
                )
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(f"time ({unit})")
    heading = title or "pipeline timeline"
    if bubble:
        heading = f"{heading} (bubble {bubble_fraction(evs):.1%})"
    ax.set_title(heading)
    ax.legend(
        handles=[
            Patch(facecolor=_COLOURS[c], edgecolor="black", label=_LABELS[c])
            for c in _COLOURS
            if c in groups
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
