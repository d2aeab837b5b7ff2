"""Sharding rules over specs (pure Python) and their registry. See ``_table`` for coverage."""

from ._core import (
    Call,
    Strategy,
    TensorMeta,
    get_sharding_rule,
    register_sharding_rule,
    registered_ops,
)
from ._table import COMPLEX, DUNDERS, POINTWISE, POINTWISE_LINEAR, REDUCTIONS
from ._view import SliceKey

__all__ = [
    "COMPLEX",
    "Call",
    "DUNDERS",
    "POINTWISE",
    "POINTWISE_LINEAR",
    "REDUCTIONS",
    "SliceKey",
    "Strategy",
    "TensorMeta",
    "get_sharding_rule",
    "register_sharding_rule",
    "registered_ops",
]
