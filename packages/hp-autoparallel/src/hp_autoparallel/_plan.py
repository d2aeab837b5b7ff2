"""A candidate configuration (:class:`Plan`), the work of one step (:class:`Workload`), and
where each rank's pipeline stages and layers are (:class:`StageLayout`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError, check_int

__all__ = ["RECOMPUTE", "SCHEDULES", "Plan", "StageLayout", "Workload"]

#: pipeline schedule -> stages per rank (hp-trainer's ``parallelism.pipeline_schedule``)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
#: activation memory per block (hp-trainer's ``activation_checkpoint.mode``)
RECOMPUTE = ("none", "selective", "full", "swap")


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens over all
    data-parallel ranks (hp-train's ``training.global_batch_size`` and ``training.seq_len``)."""

    global_batch: int
    seq_len: int

    def __post_init__(self) -> None:
        check_int(self.global_batch, "global_batch", "Workload")
        check_int(self.seq_len, "seq_len", "Workload")

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Plan:
    """Degrees and choices of one configuration, in hp-train's terms.

    ``dp_replicate x dp_shard x cp x tp x pp`` is the world size; ``ep`` borrows ``dp_shard``
    ranks and ``etp`` is 1 or ``tp`` (as ``hp_trainer.ParallelDims``). ``schedule`` is
    ``"none"`` without pipelining, else a key of :data:`SCHEDULES` (which fixes the stages
    per rank, ``vpp``). ``microbatches``: with a pipeline, the microbatches per step and
    data-parallel rank (``parallelism.pipeline_microbatches``); without one, the
    gradient-accumulation micro-steps (global batch / dp / ``training.local_batch_size``).
    ``recompute`` is a value of :data:`RECOMPUTE` for every block.

    ``str(plan)`` is a short label: ``dp 2x64 tp 8 pp 1 mb 2 ac full``.
    """

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    schedule: str = "none"
    microbatches: int = 1
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp", "microbatches"):
            check_int(getattr(self, name), name, "Plan")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"Plan: recompute={self.recompute!r}: use one of {list(RECOMPUTE)}")
        if self.pp == 1 and self.schedule != "none":
            raise PlanError(f"Plan: schedule={self.schedule!r} needs pp > 1: use 'none'")
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise PlanError(
                f"Plan: schedule={self.schedule!r} with pp={self.pp}: use one of {list(SCHEDULES)}"
            )

    @property
    def world(self) -> int:
        """Ranks the plan uses."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def vpp(self) -> int:
        """Pipeline stages per rank."""
        return SCHEDULES.get(self.schedule, 1)

    @property
    def fsdp(self) -> bool:
        """Whether FSDP applies (hp-trainer shards when dp x cp > 1)."""
        return self.dp * self.cp > 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards a dense parameter over (dp_shard x cp; 1 without FSDP)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    def sequences_per_microbatch(self, work: Workload) -> int:
        """Sequences each rank runs per microbatch (``training.local_batch_size``)."""
        return work.global_batch // self.dp // self.microbatches

    def family(self) -> tuple:
        """The degrees without schedule, microbatches and recompute: what ``--why`` groups."""
        return (self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp, self.ep, self.etp)

    def __str__(self) -> str:
        parts = [f"dp {self.dp_replicate}x{self.dp_shard}", f"tp {self.tp}"]
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.ep > 1 or self.etp > 1:
            parts.append(f"ep {self.ep}" + (f" etp {self.etp}" if self.etp > 1 else ""))
        if self.pp > 1:
            parts.append(f"pp {self.pp} {self.schedule}")
        parts += [f"mb {self.microbatches}", f"ac {self.recompute}"]
        return " ".join(parts)


@dataclass(frozen=True)
class StageLayout:
    """Which blocks each pipeline stage holds and which rank holds each stage.

    ``ranges[s]`` is stage ``s``'s half-open block range; ``placement[s]`` its rank (hp-pipeline's
    looped placement, or the V of ZBV). Stage 0 also holds the embedding, the last stage the
    final norm and the output projection (and DeepSeek's MTP modules, which need pp = 1).
    """

    ranges: tuple[tuple[int, int], ...]
    placement: tuple[int, ...]

    @property
    def n_stages(self) -> int:
        """Stages in all."""
        return len(self.ranges)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    @classmethod
    def single(cls, n_layers: int) -> StageLayout:
        """No pipeline: one stage with every block."""
        return cls(((0, n_layers),), (0,))

    @classmethod
    def for_schedule(cls, ranges, schedule: str, pp: int) -> StageLayout:
        """Stages ``ranges`` placed as ``schedule`` places them on ``pp`` ranks."""
        n = len(ranges)
        if schedule == "zbv":
            placement = tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
        else:
            placement = tuple(s % pp for s in range(n))
        return cls(tuple(tuple(r) for r in ranges), placement)
