"""hp_fsdp's exceptions, in a module of their own so that the framework bindings
(``hp_fsdp._backend``) raise them without importing the front end that calls them."""

from __future__ import annotations

__all__ = ["FSDPError", "FSDPTypeError"]


class FSDPError(ValueError):
    """A ``fully_shard`` call that cannot work; the message names the argument and the fix."""


class FSDPTypeError(FSDPError, TypeError):
    """An argument of the wrong type (a str where a ``DeviceMesh`` is expected, a dtype where a
    ``MixedPrecisionPolicy`` is...); also a ``TypeError``. The message names the argument and
    the type to pass."""
