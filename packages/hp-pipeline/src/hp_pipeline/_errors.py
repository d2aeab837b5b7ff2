"""The package's error for bad pipeline arguments (its own module: the stage and its CUDA
graphs both raise it)."""

__all__ = ["PipelineError"]


class PipelineError(ValueError):
    """Bad pipeline arguments (stage indices, microbatches, inputs)."""
