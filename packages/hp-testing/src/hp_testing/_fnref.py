"""Send a module-level function to child processes by reference and resolve it there.

A function is sent as (module name, qualified name, source file). The child imports the module
by name when that gives the same file, and otherwise loads the file with importlib, so functions
defined in test files work under every pytest import mode (``prepend``, ``append``,
``importlib``), including test files that are not inside a package.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class FnRef:
    """A picklable reference to a module-level function."""

    module: str
    qualname: str
    path: str | None

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> FnRef:
        """Build a reference to ``fn``, or raise ``TypeError`` if it cannot be resolved by name."""
        if not inspect.isfunction(fn):
            raise TypeError(
                f"fn must be a plain function defined at module level, got {fn!r} "
                f"of type {type(fn).__name__}; wrap it in a module-level `def`"
            )
        qualname = fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"fn must be defined at module level so child processes can find it by name, "
                f"got {fn.__module__}.{qualname}; move it to the top level of its module"
            )
        module = fn.__module__
        return cls(module=module, qualname=qualname, path=_module_file(module, fn))

    def describe(self) -> str:
        """``module.qualname``, for messages."""
        return f"{self.module}.{self.qualname}"


def _module_file(module: str, fn: Callable[..., Any]) -> str | None:
    path = getattr(sys.modules.get(module), "__file__", None) or fn.__code__.co_filename
    if not path or not os.path.exists(path):
        return None
    return os.path.realpath(path)


def _lookup(mod: ModuleType, qualname: str) -> Callable[..., Any]:
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{mod.__name__}.{qualname} is not callable")
    return obj


def _same_file(mod: ModuleType, path: str) -> bool:
    mod_file = getattr(mod, "__file__", None)
    if not mod_file:
        return False
    try:
        return os.path.samefile(mod_file, path)
    except OSError:
        return False


def load_file(path: str) -> ModuleType:
    """Import the Python file at ``path`` under a private module name (cached in sys.modules)."""
    path = os.path.realpath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    name = f"_hp_testing_file_{stem}_{digest}"
    cached = sys.modules.get(name)
    if cached is not None:
        return cached
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a module from {path!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def resolve(ref: FnRef) -> Callable[..., Any]:
    """Find the function ``ref`` names: import by module name, else load its source file."""
    problems: list[str] = []
    if ref.module:
        try:
            mod = importlib.import_module(ref.module)
            if ref.path is None or _same_file(mod, ref.path):
                return _lookup(mod, ref.qualname)
            problems.append(
                f"importing {ref.module!r} gave {getattr(mod, '__file__', None)!r}, "
                f"not {ref.path!r}"
            )
        except Exception as exc:  # fall back to loading the file
            problems.append(f"importing {ref.module!r} failed: {type(exc).__name__}: {exc}")
    if ref.path is not None:
        try:
            return _lookup(load_file(ref.path), ref.qualname)
        except Exception as exc:
            problems.append(f"loading {ref.path!r} failed: {type(exc).__name__}: {exc}")
            raise ImportError(
                f"cannot resolve function {ref.describe()} in the child process: "
                + "; ".join(problems)
            ) from exc
    raise ImportError(
        f"cannot resolve function {ref.describe()} in the child process: " + "; ".join(problems)
    )
