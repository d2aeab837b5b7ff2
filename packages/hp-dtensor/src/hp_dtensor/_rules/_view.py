"""Rules for views and shape ops: transpose, permute, reshape, squeeze, indexing, cat, split..."""

from __future__ import annotations

import math

from .._placement import Partial, Shard
from ._core import REPLICATE, Call, Strategy, normalize_dim, per_mesh_dim

__all__ = [
    "permute_like_rule",
    "reshape_rule",
    "getitem_rule",
    "split_rule",
    "cat_rule",
    "stack_rule",
    "reshape_groups",
]


def _remap(call: Call, mapping, *, linear: bool = True, n_out: int | None = None) -> Strategy:
    """Strategy for one-tensor view ops: ``mapping[k]`` is the output dim of input dim ``k``
    (None: the dim must be gathered first). Partial passes through views (they are linear)."""

    def choose(d, cur):
        p = cur[0]
        new = list(cur)
        if isinstance(p, Shard):
            o = mapping[p.dim]
            if o is None:
                new[0] = REPLICATE
                out = REPLICATE
            else:
                out = Shard(o)
        elif isinstance(p, Partial) and not linear:
            new[0] = REPLICATE
            out = REPLICATE
        else:
            out = p
        return new, ([out] * n_out if n_out else out)

    return per_mesh_dim(call, choose)


def permute_like_rule(call: Call) -> Strategy | None:
    """transpose / swapaxes / t / permute / movedim / unsqueeze / squeeze / T / mT."""
    x = call.tensors[0]
    nd = x.ndim
    name = call.name.rstrip("_")
    if name in ("transpose", "swapaxes", "swapdims"):
        a = normalize_dim(call.arg(1, "dim0"), nd)
        b = normalize_dim(call.arg(2, "dim1"), nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    elif name in ("t", "get_T", "numpy_T"):
        perm = list(reversed(range(nd)))
    elif name in ("get_mT", "adjoint_like"):
        perm = list(range(nd))
        if nd >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
    elif name == "permute":
        dims = (
            call.args[1:]
            if len(call.args) > 2 or (len(call.args) == 2 and isinstance(call.args[1], int))
            else call.arg(1, "dims")
        )
        perm = [normalize_dim(d, nd) for d in dims]
    elif name == "movedim" or name == "moveaxis":
        src = call.arg(1, "source")
        dst = call.arg(2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src = [normalize_dim(s, nd) for s in src]
        dst = [normalize_dim(s, nd) for s in dst]
        order = [None] * nd
        for s, t in zip(src, dst):
            order[t] = s
        rest = iter(k for k in range(nd) if k not in src)
        perm = [o if o is not None else next(rest) for o in order]
    elif name == "unsqueeze":
        at = call.arg(1, "dim")
        at = at % (nd + 1) if at < 0 else at
        return _remap(call, [k if k < at else k + 1 for k in range(nd)])
    elif name == "squeeze":
        dim = call.arg(1, "dim", None)
        if dim is None:
            drop = {k for k in range(nd) if x.shape[k] == 1}
        else:
            dims = [dim] if isinstance(dim, int) else list(dim)
            drop = {normalize_dim(k, nd) for k in dims if x.shape[normalize_dim(k, nd)] == 1}
        mapping = []
        o = 0
        for k in range(nd):
            if k in drop:
                mapping.append(None)
            else:
                mapping.append(o)
                o += 1
        return _remap(call, mapping)
    else:
        return None
    inv = [0] * nd
    for o, k in enumerate(perm):
        inv[k] = o
    return _remap(call, inv)


def reshape_groups(a, b):
    """Pair up dims of shapes ``a`` and ``b`` into groups of equal product.

    Returns a list of (input dims, output dims). Size-1 dims form their own groups.
    """
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            raise ValueError(f"shapes {a} and {b} have different numbers of elements")
        gi, gj = [i], [j]
        pa, pb = a[i], b[j]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def _resolve_shape(shape, numel):
    shape = list(shape)
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def reshape_rule(call: Call, out_shape) -> Strategy | None:
    """view / reshape / flatten / unflatten / view_as / reshape_as / expand."""
    x = call.tensors[0]
    if 0 in x.shape:
        return None
    out_shape = _resolve_shape(out_shape, x.numel())
    if call.name in ("expand", "expand_as"):
        lead = len(out_shape) - x.ndim
        mapping = [(k + lead if x.shape[k] == out_shape[k + lead] else None) for k in range(x.ndim)]
        return _remap(call, mapping)
    if math.prod(out_shape) != x.numel():
        return None
    factor = {}
    for s, p in zip(call.mesh_shape, x.placements):
        if isinstance(p, Shard):
            factor.setdefault(p.dim, []).append(s)
    mapping = [None] * x.ndim
    for gi, gj in reshape_groups(x.shape, out_shape):
        if len(gi) == 1 and len(gj) == 1:
            mapping[gi[0]] = gj[0]
            continue
        if not gi or not gj:
            continue
        k = gi[0]
        sizes = factor.get(k, [])
        if not sizes or len(sizes) > 1 or any(kk in factor for kk in gi[1:]):
            continue  # sharded inner dims of a merged group must be gathered (mapping None)
        n = sizes[0]
        if len(gj) == 1:  # merge: outermost input dim sharded evenly
            if x.shape[k] % n == 0:
                mapping[k] = gj[0]
        elif out_shape[gj[0]] % n == 0:  # split: outermost output dim takes the shard
            mapping[k] = gj[0]
    return _remap(call, mapping)


def getitem_rule(call: Call) -> Strategy | None:
    """Basic indexing (ints, slices, None, Ellipsis); advanced indexing uses the fallback."""
    x = call.tensors[0]
    idx = call.args[1]
    if not isinstance(idx, tuple):
        idx = (idx,)
    for it in idx:
        if isinstance(it, bool) or not (
            it is None or it is Ellipsis or isinstance(it, (int, SliceKey))
        ):
            return None  # x[True] adds a dim like None; advanced indexing: the fallback
    n_real = sum(1 for it in idx if it is not None and it is not Ellipsis)
    if n_real > x.ndim:
        return None
    if Ellipsis in idx:
        e = idx.index(Ellipsis)
        idx = idx[:e] + (SliceKey(None, None, None),) * (x.ndim - n_real) + idx[e + 1 :]
    else:
        idx = idx + (SliceKey(None, None, None),) * (x.ndim - n_real)
    mapping = [None] * x.ndim
    k = o = 0
    for it in idx:
        if it is None:
            o += 1
            continue
        if isinstance(it, int):
            k += 1
            continue
        if it.is_full(x.shape[k]):
            mapping[k] = o
        k += 1
        o += 1
    return _remap(call, mapping)


class SliceKey(tuple):
    """Hashable stand-in for a ``slice`` (slices are unhashable before Python 3.12)."""

    __slots__ = ()

    def __new__(cls, start, stop, step):
        return super().__new__(cls, (start, stop, step))

    def is_full(self, size: int) -> bool:
        start, stop, step = self
        return (
            (step in (None, 1))
            and (start in (None, 0) or start <= -size)
            and (stop is None or stop >= size)
        )


def split_rule(call: Call, dim: int, n_out: int, *, drop_dim: bool = False) -> Strategy:
    """split / chunk / tensor_split / unbind along ``dim``: that dim is gathered if sharded."""
    x = call.tensors[0]
    dim = normalize_dim(dim, x.ndim)
    mapping = []
    for k in range(x.ndim):
        if k == dim:
            mapping.append(None)
        else:
            mapping.append(k - 1 if drop_dim and k > dim else k)
    return _remap(call, mapping, n_out=n_out)


def cat_rule(call: Call, dim: int) -> Strategy | None:
    """cat / concat / concatenate of tensors along ``dim`` (1-D empty tensors are skipped)."""
    ts = call.tensors
    nd = max(t.ndim for t in ts)
    dim = normalize_dim(dim, nd)

    def choose(d, cur):
        n = len(cur)
        real = [i for i in range(n) if ts[i].ndim == nd]
        if all(isinstance(cur[i], Partial) for i in real) and len({cur[i] for i in real}) == 1:
            return list(cur), cur[real[0]]
        votes: dict[int, int] = {}
        for i in real:
            p = cur[i]
            if isinstance(p, Shard) and p.dim != dim:
                votes[p.dim] = votes.get(p.dim, 0) + ts[i].numel()
        if votes:
            k = max(votes, key=lambda v: votes[v])
            return [Shard(k) if i in real else REPLICATE for i in range(n)], Shard(k)
        return [REPLICATE] * n, REPLICATE

    return per_mesh_dim(call, choose)


def stack_rule(call: Call, dim: int) -> Strategy | None:
    """stack: like cat along a new dim."""
    ts = call.tensors
    nd = ts[0].ndim
    dim = dim % (nd + 1) if dim < 0 else dim

    def choose(d, cur):
        n = len(cur)
        if all(isinstance(p, Partial) for p in cur) and len(set(cur)) == 1:
            return list(cur), cur[0]
        votes: dict[int, int] = {}
        for i, p in enumerate(cur):
            if isinstance(p, Shard):
                votes[p.dim] = votes.get(p.dim, 0) + ts[i].numel()
        if votes:
            k = max(votes, key=lambda v: votes[v])
            return [Shard(k)] * n, Shard(k if k < dim else k + 1)
        return [REPLICATE] * n, REPLICATE

    return per_mesh_dim(call, choose)
