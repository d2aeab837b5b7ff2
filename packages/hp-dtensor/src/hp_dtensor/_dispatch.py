"""The op dispatcher behind ``DTensor.__torch_function__`` (see NOTE [Dispatch at the
torch-function level] in ``_dtensor``): per-op objects (``_Op``) that key a call by its input
specs, plan it once from the op's sharding rule (redistribute inputs, run on local tensors, wrap
outputs) and cache the plan; a replicate-everything fallback for ops without a rule; and the
local-only path of ``SkipDTensorDispatch``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import _groups as _groups_mod
from . import _kernels
from ._dtensor import (
    _MODE,
    _MODE_SENSITIVE,
    _REPLICATE,
    DTensor,
    _grad_enabled,
    _make,
    _partial_adapters,
    _redistribute_local,
    _redundant_local,
    _split_use_local,
)
from ._placement import Partial, Replicate
from ._plan import plan_redistribute
from ._redistribute import (
    AllReduceGrad,
    gathered_dims,
    redistribute_local,
)
from ._rules import SliceKey, TensorMeta, get_sharding_rule
from ._rules._core import Call
from ._spec import DTensorSpec, contiguous_strides
from .errors import ShardingError

# ---------------------------------------------------------------------------------------------
# op dispatch
_ATOMIC = frozenset(
    {
        int,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.memory_format,
        torch.layout,
        torch.Generator,
    }
)
_DUNDER_NAME = {
    "__radd__": "add",
    "__iadd__": "add_",
    "__rmul__": "mul",
    "__imul__": "mul_",
}


class _Uncacheable(Exception):
    pass


def _key_of(a):
    t = type(a)
    if t is DTensor:
        return a._spec
    if t is float:
        return float
    if t is bool:  # True == 1 and hash(True) == hash(1), but x[True] is not x[1]
        return (bool, a)
    if t in _ATOMIC:
        return a
    if t is tuple or t is list or t is torch.Size:
        return (t, tuple(_key_of(x) for x in a))
    if t is slice:
        return SliceKey(a.start, a.stop, a.step)
    if a is Ellipsis:
        return a
    if isinstance(a, DTensor):
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0 and not a.requires_grad:
            return ("0d", a.dtype, a.device.type)
        raise _Mixed
    try:
        hash(a)
    except TypeError:
        raise _Uncacheable from None
    return (t, a)


class _Mixed(Exception):
    pass


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return "get_" + getattr(owner, "__name__", "?")
    return name


class _Op:
    """Dispatch state of one torch callable: its rule and a cache of plans by input specs."""

    __slots__ = ("name", "rule", "cache", "inplace", "warned", "moded", "fvals", "view")

    def warned_once(self) -> bool:
        """True after the first call: the fallback warning is given once per op."""
        seen = self.warned
        self.warned = True
        return seen

    def __init__(self, func):
        self.name = _op_name(func)
        base = self.name
        self.rule = get_sharding_rule(base)
        if self.rule is None and base.startswith("__") and base.endswith("__"):
            alt = _DUNDER_NAME.get(base, base[2:-2])
            self.rule = get_sharding_rule(alt)
        self.inplace = (
            (base.endswith("_") and not base.endswith("__"))
            or (
                base.startswith("__i")
                and base.endswith("__")
                and base not in ("__index__", "__int__", "__invert__", "__iter__")
            )
            or base == "__setitem__"
        )
        self.cache: dict = {}
        self.warned = False
        self.fvals = base in _FLOAT_VALUE_OPS
        self.moded = base in _MODE_SENSITIVE or self.fvals
        self.view = base in _VIEW_OPS

    def __call__(self, func, args, kwargs):
        if kwargs and kwargs.get("out") is not None:
            raise ShardingError(
                f"{self.name}: out= is not supported with DTensor arguments; assign the result "
                "instead (y = op(...)) or copy_ it into the destination"
            )
        try:
            key = tuple([a._spec if type(a) is DTensor else _key_of(a) for a in args])
            if kwargs:
                key = (key, tuple((k, _key_of(v)) for k, v in kwargs.items()))
            if self.moded:  # never equal to a hot-path key, so the mode is always consulted
                key = ("mode", _MODE["loss_parallel"], key)
                if self.fvals:  # a rule that reads float values (sdpa's dropout_p)
                    key = (
                        key,
                        tuple(a for a in args if type(a) is float),
                        tuple(v for v in (kwargs or {}).values() if type(v) is float),
                    )
        except _Uncacheable:
            return self._build(func, args, kwargs).run(func, args, kwargs)
        except _Mixed:
            if self.name in _REPLICATE_PLAIN or _only_scalar_tensors(args, kwargs):
                return self(func, *_replicate_plain(args, kwargs))
            raise ShardingError(
                f"{self.name}: got a mix of DTensor and torch.Tensor arguments; distribute the "
                "tensor first (distribute_tensor / DTensor.from_local)"
            ) from None
        plan = self.cache.get(key)
        if plan is None:
            plan = self._build(func, args, kwargs)
            if len(self.cache) > 4096:
                self.cache.clear()
            self.cache[key] = plan
        return plan.run(func, args, kwargs)

    # -- planning (cache miss) ------------------------------------------------------------------
    def _build(self, func, args, kwargs):
        kwargs = kwargs or {}
        paths: list = []
        dts: list[DTensor] = []
        _collect(args, (), paths, dts)
        _collect(kwargs, ("kw",), paths, dts)
        if not dts:
            return _Direct()
        mesh = dts[0]._spec.mesh
        for d in dts[1:]:
            if d._spec.mesh != mesh:
                raise ShardingError(
                    f"{self.name}: operands are on different meshes ({mesh} and "
                    f"{d._spec.mesh}); redistribute them onto one mesh first"
                )
        if self.rule is None or kwargs.get("inplace") is True:
            return _Fallback(self, paths, dts, self.inplace or kwargs.get("inplace") is True)
        metas = [TensorMeta(d._spec.shape, d._spec.placements) for d in dts]
        call_args = _substitute(args, iter(metas))
        it = iter(metas[_count(args) :])
        call_kwargs = {k: _substitute_one(v, it) for k, v in kwargs.items()}
        call = Call(self.name, call_args, call_kwargs, mesh.shape, metas, dict(_MODE))
        try:
            strategy = self.rule(call)
        except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
            strategy = None
        if strategy is None:
            return _Fallback(self, paths, dts, self.inplace)
        return _plan_from_strategy(self, func, args, kwargs, paths, dts, strategy, mesh)


#: ops whose plain-tensor arguments (targets, class weights) are taken as replicated
_REPLICATE_PLAIN = frozenset({"cross_entropy", "nll_loss"})
#: ops whose rule reads a float argument's value
_FLOAT_VALUE_OPS = frozenset({"scaled_dot_product_attention"})
#: ops whose result is a view of their first input (in-place ops must write through them)
_VIEW_OPS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "expand",
        "expand_as",
        "flatten",
        "unflatten",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "permute",
        "movedim",
        "moveaxis",
        "unsqueeze",
        "squeeze",
        "get_T",
        "get_mT",
        "__getitem__",
        "select",
        "narrow",
        "split",
        "chunk",
        "unbind",
        "tensor_split",
        "split_with_sizes",
        "diagonal",
        "as_strided",
        "detach",
        "alias",
    }
)
_COPY_VIEW = "copy_view"


def _only_scalar_tensors(args, kwargs) -> bool:
    """True when every plain tensor among the arguments is 0-d (a scalar that requires grad)."""
    plain = []

    def walk(x):
        if isinstance(x, DTensor):
            return
        if isinstance(x, torch.Tensor):
            plain.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    walk(args)
    walk(list((kwargs or {}).values()))
    return bool(plain) and all(t.ndim == 0 for t in plain)


def _check_writable(d: DTensor, name: str):
    """For an in-place op on ``d``: None when ``d`` owns its data; (base, index) when ``d`` is
    a redistributed copy of ``base[index]`` (the caller writes the result back); raises for a
    copy made by another view op, which cannot be written back."""
    info = d._gr.get(_COPY_VIEW) if d._gr is not None else None
    if info is None or isinstance(info, tuple):
        return info
    raise ShardingError(
        f"{name}: in-place op on a DTensor view that had to be redistributed (a copy, not a "
        "view of the original): write to the original, e.g. with index_copy_/masked_fill_, "
        "or assign the result"
    )


def _write_back(info, d: DTensor) -> None:
    if info is not None:
        base, index = info
        with torch.no_grad():
            base[index] = d


def _replicate_plain(args, kwargs):
    paths, dts = [], []
    _collect(args, (), paths, dts)
    mesh = dts[0]._spec.mesh
    pl = (_REPLICATE,) * mesh.ndim

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            spec = DTensorSpec(mesh, pl, x.shape, contiguous_strides(x.shape), x.dtype)
            return _make(x, spec)
        return x

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in (kwargs or {}).items()}


def _count(x) -> int:
    if type(x) is DTensor or isinstance(x, DTensor):
        return 1
    if isinstance(x, (list, tuple)):
        return sum(_count(y) for y in x)
    return 0


def _collect(x, path, paths, dts):
    if isinstance(x, DTensor):
        paths.append(path)
        dts.append(x)
    elif isinstance(x, (list, tuple)):
        for i, y in enumerate(x):
            _collect(y, path + (i,), paths, dts)
    elif isinstance(x, dict):
        for k, y in x.items():
            _collect(y, path + (k,), paths, dts)


def _substitute(args, it):
    return tuple(_substitute_one(a, it) for a in args)


def _substitute_one(a, it):
    if isinstance(a, DTensor):
        return next(it)
    if type(a) is slice:
        return SliceKey(a.start, a.stop, a.step)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return (
            type(a)(_substitute_one(x, it) for x in a)
            if type(a) in (list, tuple)
            else tuple(_substitute_one(x, it) for x in a)
        )
    return a


def _get(container, path):
    for p in path:
        container = container[p]
    return container


def _replace(args, kwargs, paths, values):
    """Copy of args/kwargs with the tensors at ``paths`` replaced by ``values``."""
    args = list(args)
    kwargs = dict(kwargs)
    for path, v in zip(paths, values):
        if path[0] == "kw":
            root = kwargs
            path = path[1:]
        else:
            root = args
        _set_path(root, path, v)
    return args, kwargs


def _set_path(root, path, v):
    if len(path) == 1:
        root[path[0]] = v
        return
    child = root[path[0]]
    child = list(child)
    _set_path(child, path[1:], v)
    root[path[0]] = child if not isinstance(root[path[0]], tuple) else tuple(child)


_DEVICE_TYPES = frozenset({"cpu", "cuda", "npu", "meta", "mps", "xpu"})


def _meta_device(a):
    if isinstance(a, torch.device):
        return torch.device("meta")
    if isinstance(a, str) and a.split(":")[0] in _DEVICE_TYPES:
        return "meta"
    return a


def _meta_like(d: DTensor):
    return torch.empty(d._spec.shape, dtype=d._spec.dtype, device="meta")


class _Direct:
    """No DTensor among the arguments (e.g. a DTensor nested in an unusual container)."""

    fast = False

    def run(self, func, args, kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _plan_from_strategy(op: _Op, func, args, kwargs, paths, dts, strategy, mesh):
    targets = []
    for d, tgt in zip(dts, strategy.inputs):
        s = d._spec
        if (
            tgt is None
            or tgt == s.placements
            or plan_redistribute(mesh.shape, s.placements, tgt, s.shape).is_noop
        ):  # only size-1 mesh dims differ: the local tensor is already right
            targets.append(None)
        else:
            targets.append(s.with_placements(tgt))
    if op.inplace and targets and targets[0] is not None:
        return _Fallback(op, paths, dts, True)
    # output shapes from a run on shapes only
    metas = [_meta_like(d) for d in dts]
    margs, mkwargs = _replace(args, kwargs, paths, metas)
    # device moves (x.to("cpu"), x.to(device=...), x.cuda()) stay on the meta device
    margs = [_meta_device(a) for a in margs]
    mkwargs = {k: _meta_device(v) for k, v in mkwargs.items()}
    try:
        with torch.no_grad():
            if op.name in ("cpu", "cuda", "npu"):
                mout = torch.empty_like(metas[0])
            else:
                mout = func(*margs, **mkwargs)
    except Exception:  # an op without a meta kernel: compute it the slow, safe way
        return _Fallback(op, paths, dts, op.inplace)
    out_pl = strategy.output
    multi = isinstance(mout, (tuple, list))
    if multi:
        if not isinstance(out_pl, list):
            out_pl = [out_pl] * len(mout)
        if len(out_pl) != len(mout):
            return _Fallback(op, paths, dts, op.inplace)
        out_specs = [
            DTensorSpec(mesh, tuple(pl), m.shape, m.stride(), m.dtype)
            for pl, m in zip(out_pl, mout)
        ]
        all_out = out_pl
    else:
        if not isinstance(mout, torch.Tensor) or isinstance(out_pl, list):
            return _Fallback(op, paths, dts, op.inplace)
        out_specs = DTensorSpec(mesh, tuple(out_pl), mout.shape, mout.stride(), mout.dtype)
        all_out = [out_pl]
    # replicated inputs feeding a split computation: all-reduce their gradient there
    grad_fix = []
    if strategy.kernel != "like" and op.name not in _VALUE_FREE:
        for i, d in enumerate(dts):
            pl = targets[i].placements if targets[i] is not None else d._spec.placements
            dims = []
            for m in range(mesh.ndim):
                if type(pl[m]) is Replicate:
                    outs = [o[m] for o in all_out]
                    if any(type(o) is not Replicate for o in outs):
                        red = "sum"
                        for o in outs:
                            if type(o) is Partial and o.reduce_op == "avg":
                                red = "avg"
                        dims.append((m, red))
            if dims and mesh.shape[dims[0][0]] > 0:
                dims = tuple(x for x in dims if mesh.shape[x[0]] > 1)
                if dims:
                    grad_fix.append((i, dims))
    # outputs that become Partial(avg/max/min) here need a backward adapter on those mesh dims
    made = []
    for o in all_out:
        made.append(
            frozenset(
                m
                for m, p in enumerate(o)
                if type(p) is Partial
                and p.reduce_op != "sum"
                and all(
                    type((t.placements if t is not None else d._spec.placements)[m]) is not Partial
                    for t, d in zip(targets, dts)
                )
            )
        )
    adapt = tuple(made) if any(made) else ()
    kernel = _kernels.get(strategy.kernel) if strategy.kernel else None
    gathered_in = any(d._spec.gathered for d in dts)
    gfd = dict(grad_fix)
    fuse_rs = []
    for i, (d, t) in enumerate(zip(dts, targets)):
        if t is None or i not in gfd:
            fuse_rs.append(frozenset())
            continue
        s = d._spec
        g = set(gathered_dims(mesh, s.placements, t.placements, s.shape))
        fuse_rs.append(frozenset(m for m, red in gfd[i] if red == "sum" and m in g))
    return _Planned(
        op, paths, targets, grad_fix, out_specs, multi, adapt, kernel, mesh, gathered_in, fuse_rs
    )


_VALUE_FREE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like"})


class _Planned:
    __slots__ = (
        "op",
        "paths",
        "targets",
        "grad_fix",
        "out",
        "multi",
        "adapt",
        "kernel",
        "mesh",
        "fast",
        "inplace",
        "reshape",
        "gf_pos",
        "gathered_in",
        "fuse_rs",
    )

    def __init__(
        self,
        op,
        paths,
        targets,
        grad_fix,
        out,
        multi,
        adapt,
        kernel,
        mesh,
        gathered_in=False,
        fuse_rs=(),
    ):
        self.op, self.paths, self.targets, self.grad_fix = op, paths, targets, grad_fix
        self.out, self.multi, self.adapt, self.kernel, self.mesh = out, multi, adapt, kernel, mesh
        self.gathered_in = gathered_in
        self.fuse_rs = tuple(fuse_rs) or (frozenset(),) * len(targets)
        self.inplace = op.inplace
        # Replicated inputs feeding a split output need a gradient all-reduce only when they
        # require grad: the hot path checks those positions and otherwise stays fast.
        flat = all(len(p) == 1 and p[0] != "kw" for p in paths)
        self.gf_pos = tuple(paths[i][0] for i, _ in grad_fix) if grad_fix and flat else None
        self.fast = (
            not any(t is not None for t in targets)
            and (not grad_fix or flat)
            and not adapt
            and kernel is None
            and all(len(p) == 1 and p[0] != "kw" for p in paths)
            and not multi
            and not op.inplace
            and not gathered_in
        )
        # views with global sizes in their arguments: call the local view with local sizes
        self.reshape = None
        if (
            not gathered_in
            and kernel is _kernels.get("reshape")
            and not any(t is not None for t in targets)
            and not grad_fix
            and not multi
        ):
            name = op.name
            meth = (
                "expand"
                if name.startswith("expand")
                else ("view" if name.startswith("view") else "reshape")
            )
            self.reshape = (meth, out.local_shape_and_offset()[0])

    def run(self, func, args, kwargs):
        if self.fast and not self._needs_grad_fix(args):
            out = func(*[a._local if type(a) is DTensor else a for a in args], **(kwargs or {}))
            return _make(out, self.out)
        if self.reshape is not None:
            meth, shape = self.reshape
            return _make(getattr(args[0]._local, meth)(shape), self.out)
        return self._run_general(func, args, kwargs or {})

    def _needs_grad_fix(self, args) -> bool:
        gf = self.gf_pos
        if gf is None or not _grad_enabled():
            return False
        return any(args[i]._local.requires_grad for i in gf)

    def _run_general(self, func, args, kwargs):
        dts = [_get(args, p) if p[0] != "kw" else _get(kwargs, p[1:]) for p in self.paths]
        back = _check_writable(dts[0], self.op.name) if self.inplace else None
        grad = torch.is_grad_enabled()
        gf = dict(self.grad_fix) if (grad and self.grad_fix) else {}
        locals_ = []
        for i, (d, tgt) in enumerate(zip(dts, self.targets)):
            dims = gf.get(i)
            if tgt is not None:
                # a gather feeding a split consumer: reduce-scatter in backward, no all-reduce
                rs = self.fuse_rs[i] if grad else frozenset()
                loc = _redistribute_local(d, tgt, rs)
                if dims and rs:
                    dims = tuple(x for x in dims if x[0] not in rs)
            elif grad and self.gathered_in and not (self.inplace and i == 0):
                loc, dims = _split_use_local(d, dims) if dims else (_redundant_local(d), None)
            else:
                loc = d._local
            if dims and loc.requires_grad:
                loc = _grad_reduced(d, loc, tgt, self.mesh, dims)
            locals_.append(loc)
        largs, lkwargs = _replace(args, kwargs, self.paths, locals_)
        if self.kernel is not None:
            specs = [t if t is not None else d._spec for t, d in zip(self.targets, dts)]
            out = self.kernel(func, largs, lkwargs, specs, self.out)
        else:
            out = func(*largs, **lkwargs)
        if self.inplace:
            _write_back(back, dts[0])
            return dts[0]
        if self.multi:
            res = []
            copy_view = self.op.view and any(t is not None for t in self.targets)
            for k, (o, s) in enumerate(zip(out, self.out)):
                if self.adapt and self.adapt[k]:
                    o = _partial_adapters(o, s, from_local=False, dims=self.adapt[k])
                r = _make(o, s)
                if copy_view:
                    r._gr = {_COPY_VIEW: True}
                res.append(r)
            return type(out)(res) if isinstance(out, tuple) and not hasattr(out, "_fields") else res
        if self.adapt:
            out = _partial_adapters(out, self.out, from_local=False, dims=self.adapt[0])
        res = _make(out, self.out)
        if self.op.view and any(t is not None for t in self.targets):
            basic = self.op.name == "__getitem__" and len(args) == 2 and not kwargs
            res._gr = {_COPY_VIEW: (args[0], args[1]) if basic else True}
        return res


def _grad_reduced(d: DTensor, local, target, mesh, dims):
    """``local`` behind one AllReduceGrad node per (activation, mesh dims): several split uses
    of one replicated activation (wq, wk, wv reading the same input) then sum their partial
    gradients first and all-reduce once."""
    if target is not None or local.is_leaf or local is not d._local:
        return AllReduceGrad.apply(local, mesh, dims)
    cache = d._gr
    if cache is None:
        cache = d._gr = {}
    hit = cache.get(dims)
    if hit is None or hit[0] is not local or hit[1] != local._version:  # in-place ops bump it
        hit = cache[dims] = (local, local._version, AllReduceGrad.apply(local, mesh, dims))
    return hit[2]


class _Fallback:
    """Gather every DTensor input, run the op on whole tensors, return replicated results."""

    __slots__ = ("op", "paths", "inplace", "quiet")
    fast = False

    def __init__(self, op, paths, dts, inplace):
        self.op, self.paths, self.inplace = op, paths, inplace
        self.quiet = op.name in _QUIET
        if not self.quiet and not op.warned_once():
            warnings.warn(
                f"hp_dtensor: no sharding rule for {op.name!r}; it runs on gathered (replicated) "
                "tensors. Register a rule with register_sharding_rule to avoid the gather.",
                stacklevel=5,
            )

    def run(self, func, args, kwargs):
        kwargs = kwargs or {}
        dts = [_get(args, p) if p[0] != "kw" else _get(kwargs, p[1:]) for p in self.paths]
        back = _check_writable(dts[0], self.op.name) if self.inplace and dts else None
        fulls = [_full(d) for d in dts]
        if self.inplace and dts:
            self_dt = dts[0]
            if all(type(p) is Replicate for p in self_dt._spec.placements):
                fulls[0] = self_dt._local
            else:
                fulls[0] = fulls[0].clone(memory_format=torch.contiguous_format)
        largs, lkwargs = _replace(args, kwargs, self.paths, fulls)
        out = func(*largs, **lkwargs)
        if self.inplace and dts:
            self_dt = dts[0]
            if fulls[0] is not self_dt._local:
                spec = self_dt._spec
                rspec = spec.with_placements((_REPLICATE,) * spec.mesh.ndim)
                new_local = redistribute_local(
                    fulls[0], spec.mesh, rspec.placements, spec.placements, spec.shape
                )
                self_dt._local.copy_(new_local)
            _write_back(back, self_dt)
            return self_dt
        mesh = dts[0]._spec.mesh if dts else None
        res = _wrap_replicated(out, mesh)
        if (
            self.op.view
            and self.op.name != "__getitem__"
            and any(any(type(p) is not Replicate for p in d._spec.placements) for d in dts)
        ):
            for r in res if isinstance(res, (list, tuple)) else (res,):
                if isinstance(r, DTensor):
                    r._gr = {_COPY_VIEW: True}
        return res


_QUIET = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__array__",
        "__complex__",
        "equal",
        "allclose",
        "__setitem__",
        "__contains__",
    }
)


def _full(d: DTensor) -> torch.Tensor:
    spec = d._spec
    if all(type(p) is Replicate for p in spec.placements):
        return _redundant_local(d)
    target = spec.with_placements((_REPLICATE,) * spec.mesh.ndim)
    return _redistribute_local(d, target)


def _wrap_replicated(out, mesh):
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
        placements = (_REPLICATE,) * mesh.ndim
        spec = DTensorSpec(mesh, placements, out.shape, contiguous_strides(out.shape), out.dtype)
        return _make(out, spec)
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_wrap_replicated(o, mesh) for o in out)
    return out


# ---------------------------------------------------------------------------------------------
# SkipDTensorDispatch
def _unwrap_all(x):
    if isinstance(x, DTensor):
        return x._local
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_unwrap_all(y) for y in x)
    if isinstance(x, dict):
        return {k: _unwrap_all(v) for k, v in x.items()}
    return x


def _skip_dispatch(func, args, kwargs):
    """Inside ``SkipDTensorDispatch``: run on local tensors; in-place ops return the DTensor."""
    out = func(*_unwrap_all(args), **_unwrap_all(kwargs))
    name = _op_name(func)
    inplace = (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__")
    )
    if inplace and args and isinstance(args[0], DTensor):
        return args[0]
    return out


_OPS: dict[Any, _Op] = {}


def _clear_caches() -> None:
    _OPS.clear()
    from ._redistribute import compile_plan

    compile_plan.cache_clear()


_groups_mod.register_cleanup(_clear_caches)
