"""Ops on ``MSDTensor`` arguments, decided by the same sharding rules as the torch side.

MindSpore has no tensor-subclass dispatch, so DTensors do not flow through ``mint`` functions
by themselves. This module is the entry point instead: ``hp_dtensor.ms_ops.linear(x, w)``
(and the other names in ``__all__``, spelled as in ``mindspore.mint``), plus the arithmetic
operators and the ``reshape``/``view``/``transpose``/``sum``/``mean`` methods of
``MSDTensor``. With plain MindSpore tensors a function is the ``mint`` op itself.

With DTensor arguments each call goes through the shared, framework-neutral path:

1. the rule registered under the op's name (``hp_dtensor._rules``, the same table torch uses)
   sees the global shapes and placements and returns a ``Strategy``;
2. inputs are redistributed to the placements it asks for (differentiable: the plans' adjoint
   step lists run in ``bprop``, NOTE [Gradient representation] in ``_redistribute``);
3. a replicated input feeding an output that is split or partial along a mesh dimension gets
   its gradient all-reduced there (Megatron's "f"), as the torch dispatcher does;
4. the MindSpore op runs on the local tensors (views get their local shape);
5. the result is wrapped with the rule's output placements; an output made Partial(avg / max
   / min) here gets the same backward adapter as ``from_local``.

Ops without a rule, rules that ask for a torch-only local kernel, and inputs sharded unevenly
take the fallback: every input gathered to Replicate, the op run on whole tensors, a
replicated result. It is correct (and differentiable) but moves whole tensors; the ops of a
Llama-style block never need it on evenly divisible shapes.

Output global shapes come from the local result: a dimension split over mesh dimensions of
sizes n1, n2... is n1 * n2... times its local size. That holds because every input reaching
a rule here is evenly sharded (uneven inputs take the fallback), and the rules keep sharded
dimensions whole or, for views, name the global shape themselves.
"""

from __future__ import annotations

import warnings

import mindspore as ms
import mindspore.mint.nn.functional as F
from mindspore import mint, nn

from .._placement import Partial, Replicate, Shard
from .._rules import Call, TensorMeta, get_sharding_rule
from .._shard_math import is_evenly_sharded, local_shape_and_offset
from .._spec import DTensorSpec, contiguous_strides
from ..errors import ShardingError
from . import get_platform
from ._ms_dtensor import MSDTensor, partial_adapters

__all__ = [
    "add",
    "call_op",
    "div",
    "exp",
    "linear",
    "matmul",
    "mean",
    "mul",
    "neg",
    "permute",
    "reshape",
    "rsqrt",
    "silu",
    "softmax",
    "sqrt",
    "sub",
    "sum",
    "transpose",
    "view",
]

#: op name (the torch name its rule is registered under) -> the MindSpore op on local tensors
_MS_OPS = {
    "add": mint.add,
    "sub": mint.sub,
    "mul": mint.mul,
    "div": mint.div,
    "neg": mint.neg,
    "exp": mint.exp,
    "rsqrt": mint.rsqrt,
    "sqrt": mint.sqrt,
    "silu": F.silu,
    "matmul": mint.matmul,
    "linear": F.linear,
    "softmax": F.softmax,
    "sum": mint.sum,
    "mean": mint.mean,
    "reshape": mint.reshape,
    "view": mint.reshape,
    "transpose": mint.transpose,
    "permute": mint.permute,
}
#: ops whose result is a view with global sizes in the arguments
_RESHAPES = frozenset({"reshape", "view"})


class _AllReduceGradDims(nn.Cell):
    """Identity; the gradient is all-reduced ("sum" or "avg") over the given mesh dims."""

    def __init__(self, mesh, dims) -> None:
        super().__init__(auto_prefix=False)
        self._mesh, self._dims = mesh, dims

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        platform = get_platform(self._mesh.device_type)
        g = platform.clone(dout)
        for m, red in self._dims:
            platform.all_reduce(g, red, self._mesh._groups[m])
        return (g,)


def _is_dt(a) -> bool:
    return type(a) is MSDTensor


def _flatten(args, kwargs):
    """Every DTensor argument (top level, or inside a list/tuple argument), in order, with a
    function that puts replacements back."""
    found: list[MSDTensor] = []

    def walk(a):
        if _is_dt(a):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                walk(b)

    for a in args:
        walk(a)
    for v in kwargs.values():
        walk(v)

    def rebuild(values):
        it = iter(values)

        def sub(a):
            if _is_dt(a):
                return next(it)
            if isinstance(a, (list, tuple)):
                return type(a)(sub(b) for b in a)
            return a

        new_args = tuple(sub(a) for a in args)
        new_kwargs = {k: sub(v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    return found, rebuild


def _check_operands(name: str, args, kwargs, dts) -> None:
    mesh = dts[0].device_mesh
    for d in dts[1:]:
        if d.device_mesh != mesh:
            raise ShardingError(
                f"{name}: operands are on different meshes ({mesh} and {d.device_mesh}); "
                "redistribute them onto one mesh first"
            )

    def plain(a):
        if isinstance(a, ms.Tensor) and a.ndim > 0:
            raise ShardingError(
                f"{name}: got a mix of MSDTensor and plain MindSpore tensor arguments; "
                "distribute the tensor first (distribute_tensor / DTensor.from_local)"
            )
        if isinstance(a, (list, tuple)):
            for b in a:
                plain(b)

    for a in list(args) + list(kwargs.values()):
        plain(a)


def _global_shape(local_shape, mesh, placements) -> tuple[int, ...]:
    shape = list(local_shape)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            shape[p.dim] *= mesh.shape[m]
    return tuple(shape)


def _view_shape(args, kwargs, numel: int) -> tuple[int, ...]:
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = tuple(rest[0])
    if not rest:
        rest = tuple(kwargs.get("shape", kwargs.get("size", ())))
    known = 1
    for s in rest:
        if s != -1:
            known *= s
    return tuple(numel // known if s == -1 else int(s) for s in rest)


_WARNED: set[str] = set()


def _fallback(name, fn, args, kwargs, dts, rebuild, why):
    """Gather every DTensor to Replicate, run on whole tensors, return a replicated result."""
    if name not in _WARNED:  # once per op, as on the torch side
        _WARNED.add(name)
        warnings.warn(
            f"hp_dtensor.ms_ops: {name!r} runs on gathered (replicated) tensors: {why}",
            stacklevel=4,
        )
    mesh = dts[0].device_mesh
    rep = (Replicate(),) * mesh.ndim
    largs, lkwargs = rebuild([d.redistribute(mesh, rep).to_local() for d in dts])
    out = fn(*largs, **lkwargs)
    return _wrap(out, mesh, lambda o: rep)


def _wrap(out, mesh, placements_of):
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o, mesh, placements_of) for o in out)
    if not isinstance(out, ms.Tensor):
        return out
    pl = tuple(placements_of(out))
    shape = _global_shape(out.shape, mesh, pl)
    return MSDTensor(out, DTensorSpec(mesh, pl, shape, contiguous_strides(shape), out.dtype))


def call_op(name: str, fn, *args, **kwargs):
    """Run op ``name`` (``fn`` on MindSpore tensors) on arguments that may be ``MSDTensor``s,
    as the sharding rule registered under ``name`` decides (module docstring)."""
    dts, rebuild = _flatten(args, kwargs)
    if not dts:
        return fn(*args, **kwargs)
    _check_operands(name, args, kwargs, dts)
    mesh = dts[0].device_mesh
    rule = get_sharding_rule(name)
    even = all(is_evenly_sharded(d.shape, mesh.shape, d.placements) for d in dts)
    if rule is None:
        why = "no sharding rule; register one with register_sharding_rule"
        return _fallback(name, fn, args, kwargs, dts, rebuild, why)
    if not even:
        why = "an input is split unevenly (global size not divisible by the mesh size)"
        return _fallback(name, fn, args, kwargs, dts, rebuild, why)
    metas = [TensorMeta(d.shape, d.placements) for d in dts]
    cargs, ckwargs = rebuild(metas)
    call = Call(name, cargs, ckwargs, mesh.shape, metas, {})
    try:
        strategy = rule(call)
    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
        strategy = None
    if (
        strategy is None
        or strategy.kernel not in (None, "reshape")
        or (strategy.kernel == "reshape" and name not in _RESHAPES)
        or isinstance(strategy.output, list)
    ):
        why = "its rule declined these placements or needs a torch-only local kernel"
        return _fallback(name, fn, args, kwargs, dts, rebuild, why)
    out_pl = tuple(strategy.output)
    # 2. inputs to the placements the rule asks for
    moved = []
    for d, tgt in zip(dts, strategy.inputs):
        moved.append(d if tgt is None or tuple(tgt) == d.placements else d.redistribute(mesh, tgt))
    if not all(is_evenly_sharded(d.shape, mesh.shape, d.placements) for d in moved):
        why = "the placements its rule asks for split an input unevenly"
        return _fallback(name, fn, args, kwargs, dts, rebuild, why)
    # 3. replicated inputs feeding a split or partial output: gradient all-reduced there
    locals_ = []
    for d in moved:
        loc = d.to_local()
        dims = []
        for m, p in enumerate(d.placements):
            o = out_pl[m]
            if type(p) is Replicate and type(o) is not Replicate and mesh.shape[m] > 1:
                dims.append((m, "avg" if type(o) is Partial and o.reduce_op == "avg" else "sum"))
        if dims:
            loc = _AllReduceGradDims(mesh, tuple(dims))(loc)
        locals_.append(loc)
    # 4. the local op
    if strategy.kernel == "reshape":
        numel = 1
        for s in dts[0].shape:
            numel *= s
        gshape = _view_shape(cargs, ckwargs, numel)
        lshape, _ = local_shape_and_offset(gshape, mesh.shape, mesh.get_coordinate(), out_pl)
        out = mint.reshape(locals_[0], lshape)
        spec = DTensorSpec(mesh, out_pl, gshape, contiguous_strides(gshape), out.dtype)
        return MSDTensor(out, spec)
    largs, lkwargs = rebuild(locals_)
    out = fn(*largs, **lkwargs)
    if not isinstance(out, ms.Tensor):
        why = "it returned several values"
        return _fallback(name, fn, args, kwargs, dts, rebuild, why)
    # 5. outputs made Partial(avg/max/min) here need the backward adapter
    made = [
        m
        for m, o in enumerate(out_pl)
        if type(o) is Partial
        and o.reduce_op != "sum"
        and not any(type(d.placements[m]) is Partial for d in moved)
    ]
    if made:
        out = partial_adapters(out, mesh, out_pl, only=made)
    return _wrap(out, mesh, lambda o: out_pl)


def _make(name):
    fn = _MS_OPS[name]

    def op(*args, **kwargs):
        return call_op(name, fn, *args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``mint``'s ``{name}`` on MindSpore tensors; on ``MSDTensor`` arguments, placed by the "
        f"sharding rule for ``{name}`` (see ``hp_dtensor.ms_ops``)."
    )
    return op


add = _make("add")
sub = _make("sub")
mul = _make("mul")
div = _make("div")
neg = _make("neg")
exp = _make("exp")
rsqrt = _make("rsqrt")
sqrt = _make("sqrt")
silu = _make("silu")
matmul = _make("matmul")
linear = _make("linear")
softmax = _make("softmax")
sum = _make("sum")  # noqa: A001 - mint's name
mean = _make("mean")
reshape = _make("reshape")
transpose = _make("transpose")
permute = _make("permute")
view = _make("view")
