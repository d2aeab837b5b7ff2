"""Functions that DTensor handles outside the sharding-rule table: tensor metadata, ``new_*``
factories, random ops (the ``manual_seed`` guarantee), dropout, ``torch.autograd.grad`` /
``backward`` and the ``_foreach_*`` family. Each handler is registered in ``_dtensor._SPECIAL``
when this module is imported (at the end of ``_dtensor``)."""

from __future__ import annotations

import torch

from ._dispatch import (
    _check_writable,
    _full,
    _op_name,
    _wrap_replicated,
    _write_back,
)
from ._dtensor import (
    _REPLICATE,
    _SPECIAL,
    DTensor,
    _dual_placements,
    _grad_spec,
    _make,
    _redundant_local,
    _seed,
)
from ._placement import Replicate
from ._redistribute import redistribute_local
from ._spec import DTensorSpec, contiguous_strides
from .errors import ShardingError


def _metadata(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _new_factory(func, args, kwargs):
    """new_zeros/new_ones/new_empty/new_full/new_tensor: a replicated DTensor."""
    self = args[0]
    out = func(self._local, *args[1:], **kwargs)
    return _wrap_replicated(out, self._spec.mesh)


def _take_local(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    shape, offset = spec.local_shape_and_offset()
    out = full
    for k, (s, o) in enumerate(zip(shape, offset)):
        if s != full.shape[k]:
            out = out.narrow(k, o, s)
    return out


def _random_inplace(func, args, kwargs):
    """uniform_/normal_/bernoulli_/nn.init.*: run on the whole tensor, keep this rank's slice.

    The first argument (or ``tensor=``) is the DTensor filled in place; it is returned.
    """
    in_kw = not args
    self = kwargs["tensor"] if in_kw else args[0]
    back = _check_writable(self, _op_name(func))
    spec = self._spec
    if spec.has_partial():
        raise ShardingError(
            f"{_op_name(func)} on a Partial DTensor: redistribute it to Shard/Replicate first"
        )
    full = torch.empty(spec.shape, dtype=spec.dtype, device=self._local.device)
    if not in_kw and spec.placements and all(type(p) is Replicate for p in spec.placements):
        full = self._local  # already whole: fill it directly
    rest = [_full(a) if isinstance(a, DTensor) else a for a in args[1:]]
    kw = {k: (_full(v) if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
    if in_kw:
        kw["tensor"] = full
        func(**kw)
    else:
        func(full, *rest, **kw)
    if full is not self._local:
        with torch.no_grad():
            self._local.copy_(_take_local(full, spec))
    _write_back(back, self)
    return self


def _random_like(func, args, kwargs):
    """rand_like/randn_like/randint_like: the slice of the whole random tensor."""
    self = args[0]
    spec = self._spec
    rest = [_full(a) if isinstance(a, DTensor) else a for a in args[1:]]
    proto = torch.empty(spec.shape, dtype=spec.dtype, device=self._local.device)
    full = func(proto, *rest, **kwargs)
    placements = _dual_placements(spec.placements)
    out_spec = DTensorSpec(
        spec.mesh, placements, full.shape, contiguous_strides(full.shape), full.dtype
    )
    return _make(_take_local(full, out_spec).clone(), out_spec)


def _dropout(func, args, kwargs):
    """dropout: the mask is the slice of the whole tensor's mask (same stream on every rank)."""
    self = args[0]
    names = ("p", "train") if func is torch.dropout else ("p", "training", "inplace")
    vals = dict(zip(names, args[1:]))
    vals.update(kwargs)
    p = vals.get("p", 0.5)
    training = vals.get("training", vals.get("train", True))
    if not training or p == 0:
        return self
    spec = self._spec
    ones = torch.ones(spec.shape, dtype=spec.dtype, device=self._local.device)
    mask = torch.nn.functional.dropout(ones, p, True)
    local_mask = _take_local(mask, spec)
    if vals.get("inplace", False):
        self._local.mul_(local_mask)
        return self
    return _make(_redundant_local(self) * local_mask, spec.with_placements(spec.placements))


def _autograd_grad(func, args, kwargs):
    """torch.autograd.grad with DTensor outputs/inputs."""
    names = ("outputs", "inputs", "grad_outputs")
    vals = dict(zip(names, args))
    vals.update(kwargs)
    outputs = vals.pop("outputs")
    inputs = vals.pop("inputs")
    grad_outputs = vals.pop("grad_outputs", None)
    single_out = isinstance(outputs, torch.Tensor)
    outs = [outputs] if single_out else list(outputs)
    single_in = isinstance(inputs, torch.Tensor)
    ins = [inputs] if single_in else list(inputs)
    gos = (
        [None] * len(outs)
        if grad_outputs is None
        else ([grad_outputs] if isinstance(grad_outputs, torch.Tensor) else list(grad_outputs))
    )
    l_outs, l_gos = [], []
    for o, g in zip(outs, gos):
        if isinstance(o, DTensor):
            l_outs.append(o._local)
            l_gos.append(_seed(o, g))
        else:
            l_outs.append(o)
            l_gos.append(g)
    l_ins = [i._local if isinstance(i, DTensor) else i for i in ins]
    grads = torch.autograd.grad(l_outs, l_ins, l_gos, **vals)
    res = tuple(
        _make(g, _grad_spec(i)) if (g is not None and isinstance(i, DTensor)) else g
        for g, i in zip(grads, ins)
    )
    return res


def _autograd_backward(func, args, kwargs):
    names = ("tensors", "grad_tensors")
    vals = dict(zip(names, args))
    vals.update(kwargs)
    tensors = vals.pop("tensors")
    grads = vals.pop("grad_tensors", None)
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    gs = (
        [None] * len(ts)
        if grads is None
        else ([grads] if isinstance(grads, torch.Tensor) else list(grads))
    )
    l_ts, l_gs = [], []
    for t, g in zip(ts, gs):
        if isinstance(t, DTensor):
            l_ts.append(t._local)
            l_gs.append(_seed(t, g))
        else:
            l_ts.append(t)
            l_gs.append(g)
    if "inputs" in vals and vals["inputs"] is not None:
        vals["inputs"] = [i._local if isinstance(i, DTensor) else i for i in vals["inputs"]]
    return torch.autograd.backward(l_ts, l_gs, **vals)


_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def _foreach(func, args, kwargs):
    """``torch._foreach_*`` pointwise ops (optimizers): one call on the local lists when the
    tensors at each position share placements and shape, else gather, compute, scatter back."""
    name = _op_name(func)
    inplace = name.endswith("_")
    lists = [a for a in args if isinstance(a, (list, tuple))]
    first = lists[0]
    local_ok = name not in _FOREACH_REDUCTIONS
    for i in range(len(first) if local_ok else 0):
        # each position holds DTensors of one spec, or plain tensors only (mixed lists are
        # common: an optimizer groups DTensor and plain parameters of one dtype together)
        spec = None
        plain = False
        for lst in lists:
            x = lst[i] if i < len(lst) else None
            if isinstance(x, DTensor):
                s = x._spec
                if spec is None:
                    spec = s
                    if s.has_partial():
                        local_ok = False
                elif s.placements != spec.placements or s.shape != spec.shape:
                    local_ok = False
            elif isinstance(x, torch.Tensor) and x.ndim != 0:
                plain = True
        if plain and spec is not None:
            local_ok = False
        if not local_ok:
            break
    if local_ok:
        largs = [
            [x._local if isinstance(x, DTensor) else x for x in a]
            if isinstance(a, (list, tuple))
            else (a._local if isinstance(a, DTensor) else a)
            for a in args
        ]
        out = func(*largs, **kwargs)
        if inplace or out is None:
            return out
        res = []
        for o, x in zip(out, first):
            if isinstance(x, DTensor):
                s = x._spec
                o = _make(o, DTensorSpec(s.mesh, s.placements, s.shape, s.stride, o.dtype))
            res.append(o)
        return res
    # gather, compute on whole tensors, write back
    fargs = []
    for j, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            fl = [_full(x) if isinstance(x, DTensor) else x for x in a]
            if inplace and j == 0:
                fl = [f.clone(memory_format=torch.contiguous_format) for f in fl]
            fargs.append(fl)
        else:
            fargs.append(_full(a) if isinstance(a, DTensor) else a)
    out = func(*fargs, **kwargs)
    if inplace:
        for x, f in zip(first, fargs[0]):
            if isinstance(x, DTensor):
                s = x._spec
                rs = (_REPLICATE,) * s.mesh.ndim
                with torch.no_grad():
                    x._local.copy_(redistribute_local(f, s.mesh, rs, s.placements, s.shape))
        return out
    mesh = next(x for x in first if isinstance(x, DTensor))._spec.mesh
    return _wrap_replicated(out, mesh)


def _register_specials() -> None:
    T = torch.Tensor
    for name in (
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "get_device",
        "is_pinned",
        "is_shared",
        "is_inference",
        "is_conj",
        "is_neg",
    ):
        if hasattr(T, name):
            _SPECIAL[getattr(T, name)] = _metadata
    for attr in (
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "layout",
        "names",
        "itemsize",
        "nbytes",
        "is_xpu",
        "is_mps",
    ):
        d = T.__dict__.get(attr) or getattr(torch._C.TensorBase, attr, None)
        if d is not None and hasattr(d, "__get__"):
            _SPECIAL[d.__get__] = _metadata
    for fn in (torch.is_floating_point, torch.is_complex, torch.numel, torch.is_nonzero):
        if fn is not torch.is_nonzero:
            _SPECIAL[fn] = _metadata if fn is not torch.numel else (lambda f, a, k: a[0].numel())
    for name in ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"):
        _SPECIAL[getattr(T, name)] = _new_factory
    # the storage this rank holds is the local shard's (memory tools such as torch's MemTracker
    # count storages; a gathered copy would count the whole tensor on every rank)
    _SPECIAL[T.untyped_storage] = lambda f, a, k: a[0]._local.untyped_storage()
    for name in (
        "uniform_",
        "normal_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
    ):
        _SPECIAL[getattr(T, name)] = _random_inplace
    init = torch.nn.init
    for name in (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    ):
        fn = getattr(init, name, None)
        if fn is not None:
            _SPECIAL[fn] = _random_inplace
    for fn in (torch.rand_like, torch.randn_like, torch.randint_like):
        _SPECIAL[fn] = _random_like
    for fn in (torch.nn.functional.dropout, torch.dropout):
        _SPECIAL[fn] = _dropout
    for name in dir(torch):
        if name.startswith("_foreach_"):
            _SPECIAL[getattr(torch, name)] = _foreach
    _SPECIAL[torch.autograd.grad] = _autograd_grad
    _SPECIAL[torch.autograd.backward] = _autograd_backward


_register_specials()
