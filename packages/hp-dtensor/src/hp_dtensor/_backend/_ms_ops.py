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

import operator
import sys
import warnings

import mindspore as ms
import mindspore.mint.nn.functional as F
import numpy as np
from mindspore import mint, nn, ops

from .._placement import Partial, Replicate, Shard
from .._rules import Call, SliceKey, TensorMeta, get_sharding_rule
from .._shard_math import is_evenly_sharded, local_shape_and_offset
from .._spec import DTensorSpec, contiguous_strides
from ..errors import ShardingError
from . import get_platform
from ._ms_dtensor import MSDTensor, partial_adapters

__all__ = [
    "add",
    "call_op",
    "cat",
    "cross_entropy",
    "embedding",
    "layer_norm",
    "log_softmax",
    "div",
    "exp",
    "linear",
    "matmul",
    "mean",
    "mul",
    "neg",
    "permute",
    "pow",
    "reshape",
    "rms_norm",
    "rsqrt",
    "silu",
    "softmax",
    "sqrt",
    "sub",
    "sum",
    "transpose",
    "view",
]


class _SumAcross(nn.Cell):
    """All-reduce (sum) over ``groups`` forward; identity backward: every rank goes on with
    the same (replicated) sum, so each rank's own term receives the whole gradient."""

    def __init__(self, platform, groups) -> None:
        super().__init__(auto_prefix=False)
        self._platform, self._groups = platform, groups

    def construct(self, x):
        out = self._platform.clone(x)
        for g in self._groups:
            self._platform.all_reduce(out, "sum", g)
        return out

    def bprop(self, x, out, dout):
        return (dout,)


def _embedding(
    input,
    weight,
    padding_idx=None,
    max_norm=None,
    norm_type=2.0,
    scale_grad_by_freq=False,
    sparse=False,
):
    """``F.embedding`` on MindSpore tensors (a row gather; ``mint``'s kernel is missing on
    CPU). ``padding_idx`` rows get no gradient, as in torch."""
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise ValueError(
            "embedding on MindSpore: max_norm, scale_grad_by_freq and sparse are not supported; "
            "leave them at their defaults"
        )
    out = ops.gather(weight, input, 0)
    if padding_idx is not None:
        pad = padding_idx % weight.shape[0]
        frozen = ops.gather(ops.stop_gradient(weight), input, 0)
        out = mint.where((input == pad).expand_dims(-1), frozen, out)
    return out


def _log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """``log_softmax`` from differentiable pieces (``mint``'s kernel is missing on CPU)."""
    x = input.astype(dtype) if dtype is not None else input
    m = ops.stop_gradient(mint.amax(x, dim, True))
    return x - m - mint.log(mint.exp(x - m).sum(dim, keepdim=True))


def _class_loss_local(
    x, target, ignore_index=-100, reduction="mean", *, platform=None, vocab=(), offset=0, den=()
):
    """Per-sample cross-entropy over logits ``x`` [N, C(local), ...] whose class dim may be
    split over the ``vocab`` groups (this rank holds classes ``offset:offset + C``); then the
    reduction, ``"mean"`` dividing by the valid targets counted over the ``den`` groups."""
    xf = x.astype(ms.float32)
    m = ops.stop_gradient(mint.amax(xf, 1, True))
    if vocab:
        m = platform.clone(m)
        for g in vocab:
            platform.all_reduce(m, "max", g)
    s = mint.exp(xf - m).sum(1, keepdim=True)
    if vocab:
        s = _SumAcross(platform, vocab)(s)
    lse = (m + mint.log(s)).squeeze(1)
    valid = target != ignore_index
    t = target * valid.astype(target.dtype)
    local_t = t - offset
    c = xf.shape[1]
    inside = (local_t >= 0) & (local_t < c)
    idx = mint.clamp(local_t, 0, c - 1).expand_dims(1)
    picked = mint.gather(xf, 1, idx).squeeze(1) * inside.astype(xf.dtype)
    if vocab:
        picked = _SumAcross(platform, vocab)(picked)
    per = (lse - picked) * valid.astype(xf.dtype)
    if reduction == "none":
        return per.astype(x.dtype)
    total = per.sum()
    if reduction == "sum":
        return total.astype(x.dtype)
    count = ops.stop_gradient(valid.astype(ms.float32).sum().reshape(1))
    if den:
        count = platform.clone(count)
        for g in den:
            platform.all_reduce(count, "sum", g)
    return (total / count.reshape(())).astype(x.dtype)


def _dims_arg(dims) -> tuple[int, ...]:
    """``permute(x, 1, 0)`` or ``permute(x, (1, 0))``."""
    return tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims


def _norm_dims(x, normalized_shape) -> tuple[int, ...]:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return tuple(range(x.ndim - n, x.ndim))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` from differentiable pieces (no MindSpore CPU kernel); ``eps`` None is
    the dtype's machine epsilon, as in torch."""
    if eps is None:
        eps = float(np.finfo(ms.dtype_to_nptype(input.dtype)).eps)
    dims = _norm_dims(input, normalized_shape)
    out = input * mint.rsqrt(mint.mean(input * input, dims, True) + eps)
    return out * weight if weight is not None else out


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` from differentiable pieces (``mint``'s kernel is missing on CPU)."""
    dims = _norm_dims(input, normalized_shape)
    centred = input - mint.mean(input, dims, True)
    out = centred * mint.rsqrt(mint.mean(centred * centred, dims, True) + eps)
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


_LOSS_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_LOSS_ARGS += ("label_smoothing",)


def _loss_args(args, kwargs) -> dict:
    vals = dict(zip(_LOSS_ARGS, args))
    vals.update(kwargs)
    for key, default in (("weight", None), ("label_smoothing", 0.0)):
        if vals.get(key, default) not in (None, 0.0):
            raise ValueError(
                f"cross_entropy on MindSpore: {key}={vals[key]!r} is not supported yet; "
                "leave it at its default"
            )
    for key in ("size_average", "reduce"):
        if vals.get(key) is not None:
            raise ValueError(f"cross_entropy: {key} is deprecated; use reduction=")
    return vals


def _cross_entropy(*args, **kwargs):
    """``F.cross_entropy`` with class-index targets on MindSpore tensors (composed from
    differentiable pieces; ``mint``'s kernel is missing on CPU)."""
    v = _loss_args(args, kwargs)
    return _class_loss_local(
        v["input"], v["target"], v.get("ignore_index", -100), v.get("reduction", "mean")
    )


def _mesh_groups(mesh, placements, pred):
    return tuple(mesh._groups[m] for m, p in enumerate(placements) if pred(p) and mesh.shape[m] > 1)


def _k_embedding_vocab(fn, largs, lkwargs, specs, out_pl, mesh):
    """Row-split (vocabulary-parallel) table: ids outside this rank's rows give zeros; the
    Partial(sum) output adds up to the whole lookup. ``padding_idx`` (global) freezes that
    row on the rank that holds it."""
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
    vals = dict(zip(names + ("sparse",), largs))
    vals.update(lkwargs)
    ids, w = vals.pop("input"), vals.pop("weight")
    rows = w.shape[0]
    start = specs[1].local_shape_and_offset()[1][0]
    pad = vals.pop("padding_idx", None)
    if pad is not None:
        pad = pad % specs[1].shape[0]
        pad = pad - start if start <= pad < start + rows else None
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start) * (~outside).astype(ids.dtype)
    out = _embedding(local, w, pad, **vals)
    return out * (~outside).astype(w.dtype).expand_dims(-1)


def _k_class_loss(fn, largs, lkwargs, specs, out_pl, mesh):
    """cross_entropy with sharded samples and/or classes (``loss_rule``)."""
    v = _loss_args(largs, lkwargs)
    xspec = specs[0]
    platform = get_platform(mesh.device_type)
    vocab = _mesh_groups(mesh, xspec.placements, lambda p: type(p) is Shard and p.dim == 1)
    den = _mesh_groups(mesh, out_pl, lambda p: type(p) is Partial)
    offset = xspec.local_shape_and_offset()[1][1]
    return _class_loss_local(
        v["input"],
        v["target"],
        v.get("ignore_index", -100),
        v.get("reduction", "mean"),
        platform=platform,
        vocab=vocab,
        offset=offset,
        den=den,
    )


#: the rules' named local kernels that have a MindSpore version here ("reshape" is inline)
_MS_KERNELS = {"embedding_vocab": _k_embedding_vocab, "class_loss": _k_class_loss}
#: the ops whose rules may ask for them
_KERNEL_OPS = {"embedding_vocab": {"embedding"}, "class_loss": {"cross_entropy"}}


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
    "permute": lambda input, *dims: mint.permute(input, _dims_arg(dims)),
    "pow": mint.pow,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "log_softmax": _log_softmax,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "cat": mint.cat,
    "__getitem__": operator.getitem,
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


#: ops whose plain-tensor arguments (targets) are taken as replicated, as on torch
_REPLICATE_PLAIN = frozenset({"cross_entropy"})


def _check_operands(name: str, args, kwargs, dts):
    """Same mesh for every DTensor operand; plain tensors refused, except 0-d ones (a learnt
    scale) and the targets of a loss, which become Replicate DTensors as on torch (so their
    gradients are reduced like any replicated input's). Returns the arguments to use and
    whether any was wrapped."""
    mesh = dts[0].device_mesh
    for d in dts[1:]:
        if d.device_mesh != mesh:
            raise ShardingError(
                f"{name}: operands are on different meshes ({mesh} and {d.device_mesh}); "
                "redistribute them onto one mesh first"
            )
    rep = (Replicate(),) * mesh.ndim
    wrapped = []

    def conv(a, where):
        if isinstance(a, MSDTensor):
            return a
        if isinstance(a, ms.Tensor):
            wrapped.append(where)
            if a.ndim > 0 and name not in _REPLICATE_PLAIN:
                raise ShardingError(
                    f"{name}: {where} is a plain MindSpore tensor of shape {tuple(a.shape)} "
                    "among MSDTensor operands; distribute it first (distribute_tensor / "
                    "DTensor.from_local)"
                )
            shape = tuple(a.shape)
            return MSDTensor(a, DTensorSpec(mesh, rep, shape, contiguous_strides(shape), a.dtype))
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b, f"{where}[{i}]") for i, b in enumerate(a))
        return a

    new_args = tuple(conv(a, f"argument {i}") for i, a in enumerate(args))
    new_kwargs = {k: conv(v, f"argument {k!r}") for k, v in kwargs.items()}
    return new_args, new_kwargs, bool(wrapped)


def _rule_arg(a):
    """Slices as the rules see them (``SliceKey``), also inside index tuples."""
    if isinstance(a, slice):
        return SliceKey(a.start, a.stop, a.step)
    if type(a) is tuple:
        return tuple(_rule_arg(b) for b in a)
    return a


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
    args, kwargs, wrapped = _check_operands(name, args, kwargs, dts)
    if wrapped:  # plain scalars or targets became DTensors: they are operands now
        dts, rebuild = _flatten(args, kwargs)
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
    cargs = tuple(_rule_arg(a) for a in cargs)
    call = Call(name, cargs, ckwargs, mesh.shape, metas, {})
    try:
        strategy = rule(call)
    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
        strategy = None
    if (
        strategy is None
        or (strategy.kernel == "reshape" and name not in _RESHAPES)
        or (
            strategy.kernel not in (None, "reshape")
            and name not in _KERNEL_OPS.get(strategy.kernel, ())
        )
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
        if not ms.ops.is_floating_point(loc):  # ids and targets carry no gradient
            locals_.append(loc)
            continue
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
    if strategy.kernel is not None:
        specs = [d._spec for d in moved]
        out = _MS_KERNELS[strategy.kernel](fn, largs, lkwargs, specs, out_pl, mesh)
    else:
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
embedding = _make("embedding")
cross_entropy = _make("cross_entropy")
log_softmax = _make("log_softmax")
rms_norm = _make("rms_norm")
layer_norm = _make("layer_norm")
cat = _make("cat")
mean = _make("mean")
pow = _make("pow")  # noqa: A001 - mint's name
reshape = _make("reshape")
transpose = _make("transpose")
permute = _make("permute")
view = _make("view")

MSDTensor._ops = sys.modules[__name__]  # the DTensor's operators and methods call these
