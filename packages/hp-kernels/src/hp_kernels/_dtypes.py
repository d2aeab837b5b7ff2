"""Element-type codes shared with the compiled module (csrc/common.h ``DType``)."""

from __future__ import annotations

import torch

from .errors import KernelsTypeError, KernelsValueError

CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float64: 3,
    torch.int64: 4,
    torch.int32: 5,
}
FLOATING = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
REDUCE_OPS = {"sum": 0, "avg": 1, "max": 2}


def code(dtype: torch.dtype, what: str) -> int:
    """The compiled module's code for ``dtype``; ``what`` names the argument in the error."""
    try:
        return CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in CODES)
        raise KernelsTypeError(f"{what} has dtype {dtype}; hp_kernels supports {names}") from None


def from_code(value: int) -> torch.dtype:
    """The torch dtype of a compiled-module code."""
    for dtype, c in CODES.items():
        if c == value:
            return dtype
    raise KernelsValueError(f"unknown dtype code {value}")
