"""Unit tests for hp_pipeline._timeline: bubble fraction, Chrome trace, PNG Gantt chart."""

from __future__ import annotations

import json
import sys

import pytest

from hp_pipeline._timeline import (
    TimelineError,
    TimelineEvent,
    bubble_fraction,
    plot_timeline,
    to_chrome_trace,
)


def _gpipe(ranks: int = 2, mbs: int = 2, f: float = 1.0, b: float = 2.0) -> list[TimelineEvent]:
    """GPipe: all forwards, then all backwards; stage r on rank r; unit step times."""
    evs = []
    for r in range(ranks):
        for m in range(mbs):
            start = (r + m) * f
            evs.append(TimelineEvent(r, f"{r}F{m}", start, start + f))
    t_fwd = (ranks + mbs - 1) * f
    for r in range(ranks):
        for m in range(mbs):
            start = t_fwd + (ranks - 1 - r + m) * b
            evs.append(TimelineEvent(r, f"{r}FULL_B{m}", start, start + b))
    return evs


def test_bubble_fraction_gpipe_matches_formula():
    # GPipe bubble = (p - 1) / (m + p - 1) when every stage has the same step times.
    for p, m in [(2, 2), (2, 4), (4, 8), (3, 1)]:
        assert bubble_fraction(_gpipe(p, m)) == pytest.approx((p - 1) / (m + p - 1))


def test_bubble_fraction_hand_built():
    evs = [
        TimelineEvent(0, "0F0", 0.0, 1.0),
        TimelineEvent(0, "0F1", 1.0, 2.0),
        TimelineEvent(1, "1F0", 1.0, 2.0),
        TimelineEvent(1, "1F1", 2.0, 4.0),
    ]
    # span 4, 2 ranks: busy 2 + 3 = 5 of 8
    assert bubble_fraction(evs) == pytest.approx(3 / 8)
    # comm and wait events widen the span and add ranks but are not busy time
    more = [*evs, TimelineEvent(2, "2RECV_F0", 0.0, 4.0, kind="wait")]
    assert bubble_fraction(more) == pytest.approx(1 - 5 / 12)
    comm = [*evs, TimelineEvent(0, "0SEND_F1", 4.0, 5.0, kind="comm")]
    assert bubble_fraction(comm) == pytest.approx(1 - 5 / 10)


def test_bubble_fraction_merges_overlaps_per_rank():
    evs = [
        TimelineEvent(0, "0F0", 0.0, 2.0),
        TimelineEvent(0, "0F1", 1.0, 3.0),  # overlaps 0F0: union [0, 3]
        TimelineEvent(0, "0W0", 1.5, 2.5),  # inside the union
        TimelineEvent(1, "1F0", 0.0, 1.0),
        TimelineEvent(1, "1F1", 3.0, 4.0),  # disjoint
    ]
    # span 4, busy 3 + 2 = 5 of 8
    assert bubble_fraction(evs) == pytest.approx(3 / 8)
    # identical events on one rank count once; other ranks' overlaps don't merge across ranks
    assert bubble_fraction([TimelineEvent(0, "0F0", 0, 1), TimelineEvent(0, "0F0", 0, 1)]) == 0


def test_chrome_trace_round_trip(tmp_path):
    evs = [
        TimelineEvent(1, "1F0", 10.5, 10.75),
        TimelineEvent(0, "0F0", 10.25, 10.5),
        TimelineEvent(0, "0SEND_F0", 10.5, 10.5005, kind="comm"),
    ]
    path = tmp_path / "deep" / "dir" / "trace.json"
    trace = to_chrome_trace(evs, path, name="demo")
    loaded = json.loads(path.read_text())
    assert loaded == trace
    assert loaded["displayTimeUnit"] == "ms"
    xs = {e["name"]: e for e in loaded["traceEvents"] if e["ph"] == "X"}
    assert set(xs) == {"1F0", "0F0", "0SEND_F0"}
    assert xs["0F0"]["ts"] == 0 and xs["0F0"]["dur"] == pytest.approx(250_000)
    assert xs["1F0"]["ts"] == pytest.approx(250_000) and xs["1F0"]["tid"] == 1
    assert xs["0SEND_F0"]["cat"] == "comm" and xs["0SEND_F0"]["dur"] == pytest.approx(500)
    assert all(e["pid"] == 0 for e in xs.values())
    threads = {
        e["tid"]: e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "thread_name"
    }
    assert threads == {0: "rank 0", 1: "rank 1"}
    procs = [e for e in loaded["traceEvents"] if e["name"] == "process_name"]
    assert procs[0]["args"]["name"] == "demo"
    assert to_chrome_trace(evs, name="demo")["traceEvents"] == trace["traceEvents"]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_writes_png(tmp_path):
    evs = _gpipe(3, 4)
    evs += [
        TimelineEvent(0, "0B0+1F2", 20.0, 21.0),
        TimelineEvent(1, "1W1", 20.0, 20.5),
        TimelineEvent(1, "1SEND_F0", 21.0, 21.1, kind="comm"),
        TimelineEvent(2, "wait", 20.0, 21.0, kind="wait"),
        TimelineEvent(2, "2UNSHARD", 21.0, 21.2),
    ]
    out = plot_timeline(evs, tmp_path / "sub" / "timeline.png", title="gpipe")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    out2 = plot_timeline(_gpipe(2, 2, f=1e-3, b=2e-3), tmp_path / "ms.png", bubble=False)
    assert out2.read_bytes().startswith(PNG_MAGIC)


def test_plot_timeline_without_matplotlib(tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install hp-pipeline\[plot\]"):
        plot_timeline(_gpipe(), tmp_path / "x.png")


def test_errors():
    for fn in (bubble_fraction, to_chrome_trace):
        with pytest.raises(TimelineError, match="events"):
            fn([])
    with pytest.raises(TimelineError, match="events"):
        plot_timeline([], "unused.png")
    assert issubclass(TimelineError, ValueError)
    with pytest.raises(TimelineError, match="start"):
        TimelineEvent(0, "0F0", 2.0, 1.0)
    with pytest.raises(TimelineError, match="kind"):
        TimelineEvent(0, "0F0", 0.0, 1.0, kind="idle")
    with pytest.raises(TimelineError, match="rank"):
        TimelineEvent(-1, "0F0", 0.0, 1.0)
    with pytest.raises(TimelineError, match="events"):
        bubble_fraction(["0F0"])
    with pytest.raises(TimelineError, match="span"):
        bubble_fraction([TimelineEvent(0, "0F0", 1.0, 1.0)])
    assert TimelineEvent(0, "0F0", 1.0, 3.5).duration == 2.5
