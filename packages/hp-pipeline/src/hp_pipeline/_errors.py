"""The package's error for bad pipeline arguments (its own module: the stage and its CUDA
graphs both raise it)."""

__all__ = ["PipelineError", "PipelineTypeError"]


class PipelineError(ValueError):
    """Bad pipeline arguments (stage indices, microbatches, inputs)."""


class PipelineTypeError(PipelineError, TypeError):
    """A pipeline argument of the wrong type (a non-module stage, a bool for a stage index, a
    str for a process group, a tensor where a tuple of inputs goes); also a ``TypeError``."""


def _where(fn: str) -> str:
    return f"{fn}: " if fn else ""


def check_int(value, arg: str, fn: str = "", *, low: int = 0, err=PipelineError, terr=None):
    """``value`` must be an int (not a bool) ``>= low``; ``err``/``terr`` are the classes raised
    for a bad value / a bad type (default PipelineError / PipelineTypeError)."""
    terr = terr or PipelineTypeError
    if isinstance(value, bool) or not isinstance(value, int):
        raise terr(f"{_where(fn)}{arg}={value!r} is a {type(value).__name__}: give an int >= {low}")
    if value < low:
        raise err(f"{_where(fn)}{arg}={value!r} is out of range: give an int >= {low}")


def check_bool(value, arg: str, fn: str = "", *, terr=None) -> None:
    """``value`` must be a bool (a str such as ``"no"`` would silently count as True)."""
    if not isinstance(value, bool):
        raise (terr or PipelineTypeError)(f"{_where(fn)}{arg}={value!r} must be True or False")
