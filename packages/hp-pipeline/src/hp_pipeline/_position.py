"""Where a stage sits in the pipeline: the index checks and the first/last facts every
framework's stage shares (framework-neutral)."""

from __future__ import annotations

from ._errors import PipelineError, check_int


def check_stage_index(stage_index, num_stages, fn: str) -> None:
    """``num_stages`` an int >= 1 and ``stage_index`` one in ``[0, num_stages)``."""
    check_int(num_stages, "num_stages", fn, low=1)
    check_int(stage_index, "stage_index", fn)
    if stage_index >= num_stages:
        raise PipelineError(
            f"{fn}: stage_index must be in [0, {num_stages}) for num_stages={num_stages}, "
            f"got {stage_index!r}"
        )


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
