"""Where a stage sits in the pipeline: the index checks and the first/last facts every
framework's stage shares (framework-neutral)."""

from __future__ import annotations

from ._errors import PipelineError, PipelineTypeError, check_int


def check_stage_index(stage_index, num_stages, fn: str) -> None:
    """``num_stages`` an int >= 1 and ``stage_index`` one in ``[0, num_stages)``."""
    check_int(num_stages, "num_stages", fn, low=1)
    check_int(stage_index, "stage_index", fn)
    if stage_index >= num_stages:
        raise PipelineError(
            f"{fn}: stage_index must be in [0, {num_stages}) for num_stages={num_stages}, "
            f"got {stage_index!r}"
        )


def check_stage_list(stages, stage_type: type, fn: str, shown: str = "PipelineStage") -> list:
    """A schedule's ``stages`` argument (one stage or a non-empty list of them, each a
    ``stage_type``, named ``shown`` in messages) as a list: distinct stage indices, one
    pipeline group, one ``num_stages``."""
    if isinstance(stages, stage_type):
        stages = [stages]
    elif isinstance(stages, (list, tuple)):
        stages = list(stages)
    else:
        raise PipelineTypeError(
            f"{fn}: stages is a {type(stages).__name__}: give a PipelineStage or a "
            "non-empty list of them"
        )
    if not stages:
        raise PipelineError(
            f"{fn}: stages is empty: give a PipelineStage or a non-empty list of them"
        )
    for i, s in enumerate(stages):
        if not isinstance(s, stage_type):
            raise PipelineTypeError(
                f"{fn}: stages[{i}] is a {type(s).__name__}, not a {shown}: wrap "
                "the module, e.g. PipelineStage(module, stage_index, num_stages), every stage "
                "of one schedule in the same framework"
            )
    idx = [s.stage_index for s in stages]
    if len(set(idx)) != len(idx):
        raise PipelineError(
            f"{fn}: stages have stage_index {idx}: each stage index may appear once"
        )
    if any(s.group != stages[0].group for s in stages):
        raise PipelineError(
            f"{fn}: the stages' groups differ (each stage was built with another group=): build "
            "every stage of this rank with the same pipeline group"
        )
    num = {s.num_stages for s in stages}
    if len(num) != 1:
        raise PipelineError(f"{fn}: stages disagree on num_stages: {sorted(num)}")
    return stages


def stages_per_rank(num_stages: int, pp: int, fn: str) -> int:
    """Stages on each of the ``pp`` pipeline ranks; ``num_stages`` must divide evenly."""
    if num_stages < pp or num_stages % pp:
        raise PipelineError(
            f"{fn}: the stages say num_stages={num_stages}, which does not split evenly over "
            f"the {pp} ranks of the pipeline group: give num_stages a multiple of {pp} "
            f"({pp} for one stage per rank)"
        )
    return num_stages // pp


class StagePosition:
    """``is_first`` / ``is_last`` from ``stage_index`` and ``num_stages``."""

    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the model's inputs."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the model's output (and computes the loss)."""
        return self.stage_index == self.num_stages - 1
