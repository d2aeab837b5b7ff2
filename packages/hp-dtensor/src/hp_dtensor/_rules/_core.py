"""Types and registry of sharding rules. Pure Python: rules see shapes and placements only.

A rule takes a ``Call`` (the op name, its arguments with every tensor replaced by a
``TensorMeta``, and the mesh shape) and returns a ``Strategy``: the placements each tensor input
must have before the op runs on local tensors, and the placements of the output(s). The
dispatcher redistributes inputs, runs the op on local tensors (or a named local kernel) and wraps
the results; output shapes come from running the op on shapes only.

A rule may also return ``None`` to ask for the generic fallback (gather every input, compute,
return a replicated result).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._placement import Partial, Placement, Replicate
from ..errors import HPDTensorTypeError

__all__ = [
    "Call",
    "Strategy",
    "TensorMeta",
    "register_sharding_rule",
    "get_sharding_rule",
    "registered_ops",
    "REPLICATE",
]

REPLICATE = Replicate()
PSUM = Partial("sum")


class TensorMeta(NamedTuple):
    """Shape and placements of one tensor argument."""

    shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Call:
    """One op call as a rule sees it."""

    name: str
    args: tuple
    kwargs: dict
    mesh_shape: tuple[int, ...]
    tensors: list[TensorMeta] = field(default_factory=list)
    #: dispatcher modes that change some rules, e.g. ``{"loss_parallel": True}``
    options: dict = field(default_factory=dict)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument by position or keyword."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def mesh_ndim(self) -> int:
        return len(self.mesh_shape)


@dataclass
class Strategy:
    """What a rule decided.

    Attributes:
        inputs: per tensor (in ``Call.tensors`` order) the placements it needs, None to keep.
        output: placements of the single output, or a list of placements for tuple outputs.
        kernel: name of a local kernel to run instead of the op itself (None: the op).
    """

    inputs: list[tuple[Placement, ...] | None]
    output: Any
    kernel: str | None = None


Rule = Callable[[Call], "Strategy | None"]
_RULES: dict[str, Rule] = {}


def register_sharding_rule(names: str | Sequence[str], rule: Rule | None = None):
    """Register ``rule`` for op ``names``; usable as a decorator.

    The name is the op's ``__name__`` (``"add"``, ``"linear"``, ``"__getitem__"``); dunder forms
    such as ``"__add__"`` are looked up under their own name first, then under ``"add"``.
    A later registration replaces an earlier one, so users can override built-in rules.

    Example::

        @register_sharding_rule("my_op")
        def my_rule(call):
            return Strategy(inputs=[None] * len(call.tensors), output=call.tensors[0].placements)
    """
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise HPDTensorTypeError(
            f"register_sharding_rule: names={names!r} must be an op name (a str such as 'add') "
            "or a list of them"
        )

    def deco(fn: Rule) -> Rule:
        if not callable(fn):
            raise HPDTensorTypeError(
                f"register_sharding_rule: rule={fn!r} is a {type(fn).__name__}, not callable: "
                "give a function Call -> Strategy | None"
            )
        for n in names:
            _RULES[n] = fn
        return fn

    return deco(rule) if rule is not None else deco


def get_sharding_rule(name: str) -> Rule | None:
    """The rule registered for ``name`` (None when there is none)."""
    return _RULES.get(name)


def registered_ops() -> tuple[str, ...]:
    """Every op name with a rule, sorted."""
    return tuple(sorted(_RULES))


# -- helpers shared by rules -------------------------------------------------------------------
def per_mesh_dim(call: Call, choose) -> Strategy:
    """Build a strategy one mesh dimension at a time.

    ``choose(d, [placement of each tensor on d])`` returns ``(input placements on d, output
    placement on d)`` or ``(inputs, [output placements])`` for tuple outputs.
    """
    n = len(call.tensors)
    ins: list[list[Placement]] = [[] for _ in range(n)]
    outs: list = []
    for d in range(call.mesh_ndim):
        cur = [t.placements[d] for t in call.tensors]
        new_in, out = choose(d, cur)
        for i in range(n):
            ins[i].append(new_in[i])
        outs.append(out)
    inputs = [
        tuple(p) if tuple(p) != call.tensors[i].placements else None for i, p in enumerate(ins)
    ]
    if outs and isinstance(outs[0], list):
        output = [tuple(o[k] for o in outs) for k in range(len(outs[0]))]
    else:
        output = tuple(outs)
    return Strategy(inputs, output)


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` made non-negative for a tensor of ``ndim`` dims (0-d tensors accept 0 and -1)."""
    if ndim == 0:
        return 0
    return dim % ndim if -ndim <= dim < ndim else dim


def dims_arg(dim, ndim: int) -> tuple[int, ...]:
    """A ``dim`` argument (None, int, or sequence) as a sorted tuple of non-negative dims."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        return (normalize_dim(dim, ndim),)
    dims = tuple(dim)
    if not dims:
        return tuple(range(ndim))
    return tuple(sorted(normalize_dim(d, ndim) for d in dims))
