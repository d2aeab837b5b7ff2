"""The planner, checked by simulating its steps on every rank of 1-D, 2-D and 3-D meshes."""

import itertools
import math
import random

import numpy as np
import pytest

from hp_dtensor import Partial, Replicate, Shard, chunk_size_and_offset, plan_redistribute

R, P, PA, PM, PN = Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


def _coords(mesh_shape):
    return list(itertools.product(*[range(s) for s in mesh_shape]))


def make_locals(full, mesh_shape, placements, noise):
    """Per-coordinate local arrays of ``full`` (integers, so every check is exact)."""
    out = {}
    for c in _coords(mesh_shape):
        x = full
        for d, p in enumerate(placements):
            n, i = mesh_shape[d], c[d]
            if isinstance(p, Shard):
                length, start = chunk_size_and_offset(x.shape[p.dim], n, i)
                x = np.take(x, range(start, start + length), axis=p.dim)
            elif isinstance(p, Partial):
                r = noise[: x.size].reshape(x.shape)
                if p.reduce_op == "sum":
                    x = x - (n - 1) * r if i == 0 else r + 0 * x
                elif p.reduce_op == "avg":
                    x = x + r * (2 * i - (n - 1))
                elif p.reduce_op == "max":
                    x = x - i * np.abs(r)
                else:
                    x = x + i * np.abs(r)
        out[c] = x
    return out


_REDUCE = {
    "sum": lambda xs: sum(xs),
    "avg": lambda xs: sum(xs) / len(xs),
    "max": lambda xs: np.maximum.reduce(xs),
    "min": lambda xs: np.minimum.reduce(xs),
}


def _groups(mesh_shape, d):
    lines = {}
    for c in _coords(mesh_shape):
        key = c[:d] + c[d + 1 :]
        lines.setdefault(key, []).append(c)
    return [sorted(v, key=lambda c: c[d]) for v in lines.values()]


def simulate(locals_, mesh_shape, plan):
    loc = dict(locals_)
    for st in plan.steps:
        d, n = st.mesh_dim, mesh_shape[st.mesh_dim]
        for line in _groups(mesh_shape, d):
            xs = [loc[c] for c in line]
            if st.kind == "all_gather":
                full = np.concatenate(xs, axis=st.src.dim)
                new = [full] * n
            elif st.kind == "chunk":
                new = []
                for i, x in enumerate(xs):
                    length, start = chunk_size_and_offset(x.shape[st.dst.dim], n, i)
                    new.append(np.take(x, range(start, start + length), axis=st.dst.dim))
            elif st.kind == "all_reduce":
                red = _REDUCE[st.src.reduce_op](xs)
                new = [red] * n
            elif st.kind == "reduce_scatter":
                red = _REDUCE[st.src.reduce_op](xs)
                new = []
                for i in range(n):
                    length, start = chunk_size_and_offset(red.shape[st.dst.dim], n, i)
                    new.append(np.take(red, range(start, start + length), axis=st.dst.dim))
            elif st.kind == "all_to_all":
                full = np.concatenate(xs, axis=st.src.dim)
                new = []
                for i in range(n):
                    length, start = chunk_size_and_offset(full.shape[st.dst.dim], n, i)
                    new.append(np.take(full, range(start, start + length), axis=st.dst.dim))
            elif st.kind == "pad":
                k = st.src.dim
                sizes = [x.shape[k] for x in xs]
                total = sum(sizes)
                new = []
                for i, x in enumerate(xs):
                    shape = list(x.shape)
                    shape[k] = total
                    z = np.zeros(shape, dtype=x.dtype)
                    start = sum(sizes[:i])
                    idx = [slice(None)] * x.ndim
                    idx[k] = slice(start, start + sizes[i])
                    z[tuple(idx)] = x
                    new.append(z)
            elif st.kind == "partition":
                if st.dst.reduce_op == "sum":
                    new = [x if i == 0 else np.zeros_like(x) for i, x in enumerate(xs)]
                else:
                    new = list(xs)
            else:
                raise AssertionError(st.kind)
            for c, x in zip(line, new):
                loc[c] = x
    return loc


def assemble(loc, mesh_shape, placements):
    """The global array from locals: undo placements from the last mesh dim to the first."""
    cur = dict(loc)
    shape = list(mesh_shape)
    for d in reversed(range(len(mesh_shape))):
        p = placements[d]
        nxt = {}
        for line in _groups(tuple(shape), d):
            xs = [cur[c] for c in line]
            if isinstance(p, Shard):
                v = np.concatenate(xs, axis=p.dim)
            elif isinstance(p, Partial):
                v = _REDUCE[p.reduce_op](xs)
            else:
                for x in xs[1:]:
                    assert np.array_equal(x, xs[0]), "replicated values differ"
                v = xs[0]
            nxt[line[0][:d] + (0,) + line[0][d + 1 :]] = v
        cur = nxt
        shape[d] = 1
    return next(iter(cur.values()))


def _check(mesh_shape, shape, src, dst, seed=0):
    rng = np.random.default_rng(seed)
    full = rng.integers(-50, 50, size=shape).astype(np.float64)
    noise = rng.integers(-9, 9, size=math.prod(shape)).astype(np.float64)
    loc = make_locals(full, mesh_shape, src, noise)
    assert np.array_equal(assemble(loc, mesh_shape, src), full)
    plan = plan_redistribute(mesh_shape, src, dst, shape)
    out = simulate(loc, mesh_shape, plan)
    got = assemble(out, mesh_shape, dst)
    np.testing.assert_array_equal(got, full, err_msg=str(plan))
    if not any(isinstance(p, Partial) for p in dst):
        ref = make_locals(full, mesh_shape, dst, noise)
        for c in ref:
            np.testing.assert_array_equal(out[c], ref[c], err_msg=f"{plan} at {c}")


OPTS_1D = [Shard(0), Shard(1), R, P, PA, PM, PN]


@pytest.mark.parametrize("shape", [(8, 4), (7, 5), (3, 2)])
def test_every_pair_1d(shape):
    for src, dst in itertools.product(OPTS_1D, repeat=2):
        _check((4,), shape, (src,), (dst,))


def _valid(pl):
    ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
    return not (len(ops) > 1 and ops & {"max", "min"})


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3)])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5)])
def test_every_pair_2d(mesh_shape, shape):
    opts = [Shard(0), Shard(1), R, P, PM]
    states = [s for s in itertools.product(opts, repeat=2) if _valid(s)]
    for src, dst in itertools.product(states, repeat=2):
        _check(mesh_shape, shape, src, dst)


def test_sampled_pairs_3d():
    rng = random.Random(0)
    opts = [Shard(0), Shard(1), Shard(2), R, P, PA]
    states = [s for s in itertools.product(opts, repeat=3)]
    for i in range(250):
        src, dst = rng.choice(states), rng.choice(states)
        _check((2, 2, 2), (4, 6, 5) if i % 2 else (8, 4, 6), src, dst, seed=i)


def test_plans_are_cheapest_and_readable():
    assert str(plan_redistribute((4,), (Shard(0),), (R,), (8, 4))) == (
        "(S(0)) -> (R): all_gather[0](S(0)->R)"
    )
    assert [s.kind for s in plan_redistribute((4,), (P,), (Shard(1),), (8, 4)).steps] == [
        "reduce_scatter"
    ]
    assert [s.kind for s in plan_redistribute((4,), (Shard(0),), (Shard(1),), (8, 4)).steps] == [
        "all_to_all"
    ]
    # nested shards: the inner split (mesh dim 1) is undone first
    kinds = [
        (s.kind, s.mesh_dim)
        for s in plan_redistribute((2, 2), (Shard(0), Shard(0)), (R, R), (8, 4)).steps
    ]
    assert kinds == [("all_gather", 1), ("all_gather", 0)]
    assert plan_redistribute((2, 2), (R, Shard(0)), (R, Shard(0)), (8, 4)).is_noop
    # size-1 mesh dims never communicate
    assert plan_redistribute((1, 4), (Shard(0), R), (R, R), (8, 4)).is_noop


def test_plans_are_cached():
    a = plan_redistribute((2, 2), (Shard(0), P), (R, Shard(1)), (8, 4))
    b = plan_redistribute([2, 2], [Shard(0), P], [R, Shard(1)], [8, 4])
    assert a is b


def test_plans_do_not_depend_on_the_hash_seed():
    """Every rank must choose the same plan: string hashing differs between processes."""
    import os
    import subprocess
    import sys

    code = (
        "from hp_dtensor import *\n"
        "P=Partial(); import itertools\n"
        "opts=[Shard(0),Shard(1),Replicate(),P,Partial('avg')]\n"
        "for s,d in itertools.product(itertools.product(opts,repeat=2),repeat=2):\n"
        "    print(plan_redistribute((2,2),s,d,(8,4)))\n"
    )
    outs = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert len(outs) == 1
