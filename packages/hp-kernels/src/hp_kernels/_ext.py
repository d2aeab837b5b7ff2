"""Lazy access to the compiled module ``hp_kernels._C``.

Importing :mod:`hp_kernels` never needs the compiled module; the first op that does calls
:func:`load`, which says what was not built and how to build it when the module is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["KernelsNotBuiltError", "is_built", "load"]

_module: ModuleType | None = None
_error: BaseException | None = None

BUILD_HINT = (
    "Build it with `pip install -e packages/hp-kernels` (or `pip install hp-kernels` from a "
    "source tree): it needs CMake >= 3.18, a C++17 compiler and pybind11 (fetched by pip); the "
    "CUDA kernels are added when nvcc is found (set CMAKE_ARGS=-DHP_KERNELS_CUDA=OFF to skip them)."
)


class KernelsNotBuiltError(ImportError):
    """The compiled module ``hp_kernels._C`` (or its CUDA part) is not available."""


def load() -> ModuleType:
    """Return ``hp_kernels._C``, importing it on first use.

    Raises:
        KernelsNotBuiltError: the module was not built (or fails to load), with the reason and
            the command that builds it.
    """
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        try:
            _module = importlib.import_module("hp_kernels._C")
            return _module
        except ImportError as exc:
            _error = exc
    raise KernelsNotBuiltError(
        f"hp_kernels' compiled module hp_kernels._C is not available ({_error}); the symmetric "
        f"memory, one-sided collectives, MC2 ops and MoE sorting need it. {BUILD_HINT}"
    ) from _error


def is_built() -> bool:
    """Whether the compiled module can be imported."""
    try:
        load()
    except KernelsNotBuiltError:
        return False
    return True


def require_cuda() -> ModuleType:
    """The compiled module, which must have been built with its CUDA kernels."""
    mod = load()
    if not mod.HAS_CUDA:
        raise KernelsNotBuiltError(
            "hp_kernels._C was built without its CUDA kernels (no CUDA toolkit was found at build "
            "time, or HP_KERNELS_CUDA=OFF). Rebuild on a machine with nvcc: "
            "`pip install -e packages/hp-kernels --force-reinstall --no-deps`."
        )
    return mod
