"""The schedule IR: what each pipeline rank does, step by step, as plain data.

A schedule is a ``dict[rank, list[MetaStep]]``. Compute steps name a stage and a microbatch;
communication steps name the stage that sends or receives; ``UNSHARD``/``RESHARD`` name only a
stage. Steps print as short strings (``"1F0"``: stage 1, forward, microbatch 0;
``"2SEND_F1"``; ``"0UNSHARD"``; ``"1B0+0F2"``: the backward of stage 1 microbatch 0 fused with
the forward of stage 0 microbatch 2) and parse back. Pure Python: no framework here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "MetaStep",
    "MetaStepType",
    "Placement",
    "Schedule",
    "ScheduleError",
    "ScheduleTypeError",
    "format_grid",
    "looped_placement",
    "parse_schedule",
    "v_placement",
]


class ScheduleError(ValueError):
    """A schedule or its arguments are invalid (bad sizes, a deadlock, an unmatched RECV)."""


class ScheduleTypeError(ScheduleError, TypeError):
    """A schedule argument of the wrong type (a non-str name, a bool or float for a count, a
    str for a flag); also a ``TypeError``."""


class MetaStepType(str, Enum):
    """What a step does. ``B`` is the input gradient only, ``W`` the weight gradient only,
    ``FULL_B`` both; ``OVERLAP_B_F`` runs a ``B``/``FULL_B`` and an ``F`` of another microbatch
    together."""

    F = "F"
    B = "B"
    W = "W"
    FULL_B = "FULL_B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP_B_F = "OVERLAP_B_F"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset(
    {MetaStepType.F, MetaStepType.B, MetaStepType.W, MetaStepType.FULL_B, MetaStepType.OVERLAP_B_F}
)
COMM = frozenset(
    {MetaStepType.SEND_F, MetaStepType.RECV_F, MetaStepType.SEND_B, MetaStepType.RECV_B}
)
_BACKWARDS = frozenset({MetaStepType.B, MetaStepType.FULL_B})


@dataclass(frozen=True)
class MetaStep:
    """One step of one rank.

    ``stage`` is the global stage index; ``microbatch`` is None only for ``UNSHARD``/``RESHARD``.
    For ``OVERLAP_B_F`` the step itself is the backward part (``stage``, ``microbatch``,
    ``backward`` saying ``B`` or ``FULL_B``) and ``fused`` the forward part.
    """

    type: MetaStepType
    stage: int
    microbatch: int | None = None
    fused: MetaStep | None = None
    backward: MetaStepType | None = None  # OVERLAP_B_F only: B or FULL_B

    def __post_init__(self) -> None:
        t = MetaStepType(self.type)
        object.__setattr__(self, "type", t)
        if self.stage < 0:
            raise ScheduleError(f"stage must be >= 0, got {self.stage}")
        needs_mb = t not in (MetaStepType.UNSHARD, MetaStepType.RESHARD)
        if needs_mb != (self.microbatch is not None):
            raise ScheduleError(f"{t} {'needs' if needs_mb else 'takes no'} microbatch")
        if self.microbatch is not None and self.microbatch < 0:
            raise ScheduleError(f"microbatch must be >= 0, got {self.microbatch}")
        if t is MetaStepType.OVERLAP_B_F:
            if self.fused is None or self.fused.type is not MetaStepType.F:
                raise ScheduleError("OVERLAP_B_F needs fused=<an F step>")
            if self.backward is None:
                object.__setattr__(self, "backward", MetaStepType.FULL_B)
            if self.backward not in _BACKWARDS:
                raise ScheduleError(
                    f"OVERLAP_B_F backward must be B or FULL_B, got {self.backward}"
                )
        elif self.fused is not None or self.backward is not None:
            raise ScheduleError(f"only OVERLAP_B_F takes fused/backward, not {t}")

    # -- views ------------------------------------------------------------------------------
    @property
    def is_compute(self) -> bool:
        """F, B, W, FULL_B or OVERLAP_B_F."""
        return self.type in COMPUTE

    @property
    def is_comm(self) -> bool:
        """SEND_F, RECV_F, SEND_B or RECV_B."""
        return self.type in COMM

    def parts(self) -> tuple[MetaStep, ...]:
        """The plain compute steps this step runs: itself, or for ``OVERLAP_B_F`` its backward
        and forward parts."""
        if self.type is MetaStepType.OVERLAP_B_F:
            return (MetaStep(self.backward, self.stage, self.microbatch), self.fused)
        return (self,)

    # -- text -------------------------------------------------------------------------------
    def __str__(self) -> str:
        if self.type is MetaStepType.OVERLAP_B_F:
            back = "B" if self.backward is MetaStepType.B else "FULL_B"
            return f"{self.stage}{back}{self.microbatch}+{self.fused}"
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.type.value}{mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> MetaStep:
        """Inverse of ``str``: ``"1F0"``, ``"2SEND_F1"``, ``"0UNSHARD"``, ``"1B0+0F2"``."""
        text = text.strip()
        if "+" in text:
            back, fwd = (cls.parse(part) for part in text.split("+", 1))
            if back.type not in _BACKWARDS or fwd.type is not MetaStepType.F:
                raise ScheduleError(f"cannot parse {text!r}: expected '<stage>B<mb>+<stage>F<mb>'")
            return cls(
                MetaStepType.OVERLAP_B_F, back.stage, back.microbatch, fused=fwd, backward=back.type
            )
        m = _STEP_RE.fullmatch(text)
        if not m:
            raise ScheduleError(f"cannot parse step {text!r}: expected e.g. '1F0' or '2SEND_F1'")
        stage, kind, mb = m.groups()
        try:
            t = MetaStepType(kind)
        except ValueError:
            raise ScheduleError(f"unknown step type {kind!r} in {text!r}") from None
        return cls(t, int(stage), None if mb is None else int(mb))


_STEP_RE = re.compile(r"(\d+)([A-Z_]+?)(\d+)?")

Schedule = dict[int, list[MetaStep]]
"""Per-rank step lists, keyed by pipeline rank (0 .. pp-1)."""

Placement = dict[int, int]
"""Stage index -> pipeline rank."""


def looped_placement(num_stages: int, pp: int) -> Placement:
    """Stage ``s`` on rank ``s % pp`` (GPipe, 1F1B, interleaved)."""
    if pp < 1 or num_stages % pp:
        raise ScheduleError(f"num_stages ({num_stages}) must be a multiple of pp ({pp})")
    return {s: s % pp for s in range(num_stages)}


def v_placement(pp: int) -> Placement:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2*pp - 1 - r`` (ZBV)."""
    if pp < 1:
        raise ScheduleError(f"pp must be >= 1, got {pp}")
    return {s: (s if s < pp else 2 * pp - 1 - s) for s in range(2 * pp)}


def format_grid(schedule: Mapping[int, Sequence[MetaStep]], *, compute_only: bool = False) -> str:
    """The schedule as a grid: one row per time step (list position), one column per rank."""
    ranks = sorted(schedule)
    cols = {r: [str(s) for s in schedule[r] if not compute_only or s.is_compute] for r in ranks}
    rows = max((len(c) for c in cols.values()), default=0)
    width = max([len(x) for c in cols.values() for x in c] + [len(f"rank {r}") for r in ranks])
    width = max(width, 4)
    lines = ["step  " + " ".join(f"{'rank ' + str(r):<{width}}" for r in ranks)]
    for i in range(rows):
        cells = [(cols[r][i] if i < len(cols[r]) else "") for r in ranks]
        lines.append(f"{i:<5} " + " ".join(f"{c:<{width}}" for c in cells))
    return "\n".join(line.rstrip() for line in lines)


def parse_schedule(rows: Iterable[str] | str) -> Schedule:
    """Parse ``{rank: steps}`` from lines ``"<rank>: 0F0 0F1 0FULL_B0 ..."`` (or one string)."""
    if isinstance(rows, str):
        rows = rows.strip().splitlines()
    out: Schedule = {}
    for line in rows:
        if not line.strip():
            continue
        head, _, body = line.partition(":")
        if not _:
            raise ScheduleError(f"expected '<rank>: steps...', got {line!r}")
        out[int(head)] = [MetaStep.parse(tok) for tok in body.split()]
    return out
