"""Typed errors of hp_trainer."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration that cannot work (names the key and the fix); raised before any process
    group is created."""
