"""Every redistribution between placement pairs on a 1-D mesh (4 ranks) and a 2x2 mesh, even and
uneven shapes, forward against the whole tensor and backward against the identity's gradient."""

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from dt_helpers import make_dtensor, noise_like  # noqa: E402

from hp_dtensor import (  # noqa: E402
    DTensor,
    Partial,
    Replicate,
    Shard,
    init_device_mesh,
    local_shape_and_offset,
)
from hp_testing.pytest_plugin import rank_pool_fixture  # noqa: E402

pool = rank_pool_fixture(4)

OPTS_1D = [
    Shard(0),
    Shard(1),
    Replicate(),
    Partial("sum"),
    Partial("avg"),
    Partial("max"),
    Partial("min"),
]
OPTS_2D = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]
SHAPES = [(8, 4), (7, 5), (3, 2)]


def _valid(pl):
    ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
    return not (len(ops) > 1 and ops & {"max", "min"})


def _check_pairs(mesh, states, shapes):
    coord = mesh.get_coordinate()
    n_checked = 0
    for shape in shapes:
        g = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
        full = torch.randn(shape, generator=g, dtype=torch.float64)
        for src, dst in itertools.product(states, repeat=2):
            x = make_dtensor(full, mesh, src, requires_grad=True)
            leaf = x._local if x._local.is_leaf else None
            y = x.redistribute(mesh, dst)
            assert y.placements == tuple(dst)
            # forward: the local piece is right, and the whole tensor is intact
            if not any(isinstance(p, Partial) for p in dst):
                lshape, off = local_shape_and_offset(full.shape, mesh.shape, coord, dst)
                expect = full
                for k, (s, o) in enumerate(zip(lshape, off)):
                    expect = expect.narrow(k, o, s)
                torch.testing.assert_close(y.to_local(), expect, msg=f"{src}->{dst} {shape}")
            torch.testing.assert_close(y.full_tensor(), full, msg=f"{src}->{dst} {shape}")
            # backward: d/dx sum(full(y) * w) = w, read back in x's gradient representation
            if leaf is not None and not any(
                isinstance(p, Partial) and p.reduce_op != "sum" for p in src
            ):
                w = noise_like(full, seed=5)
                (y.full_tensor() * w).sum().backward()
                got = DTensor.from_local(
                    leaf.grad,
                    mesh,
                    [Replicate() if isinstance(p, Partial) else p for p in src],
                    shape=full.shape,
                ).full_tensor()
                torch.testing.assert_close(got, w, msg=f"grad {src}->{dst} {shape}")
            n_checked += 1
    return n_checked


def _pairs_1d():
    mesh = init_device_mesh("cpu", (4,))
    return _check_pairs(mesh, [(p,) for p in OPTS_1D], SHAPES)


def _pairs_2d():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    states = [s for s in itertools.product(OPTS_2D, repeat=2) if _valid(s)]
    return _check_pairs(mesh, states, [(8, 4), (7, 5)])


def test_every_pair_1d(pool):
    assert pool.run(_pairs_1d) == [len(OPTS_1D) ** 2 * len(SHAPES)] * 4


def test_every_pair_2d(pool):
    n = sum(1 for s in itertools.product(OPTS_2D, repeat=2) if _valid(s))
    assert pool.run(_pairs_2d) == [n * n * 2] * 4


def _extreme_grad():
    """Partial(max) -> Replicate: the gradient goes to the rank holding the max."""
    mesh = init_device_mesh("cpu", (4,))
    r = mesh.get_local_rank()
    local = torch.tensor([float(r), 3.0 - r, 1.0], requires_grad=True)
    x = DTensor.from_local(local, mesh, [Partial("max")])
    y = x.full_tensor()
    (y * torch.tensor([1.0, 2.0, 4.0])).sum().backward()
    return local.grad.tolist()


def test_partial_max_gradient_goes_to_argmax(pool):
    grads = pool.run(_extreme_grad)
    # column 0: max 3 on rank 3; column 1: max 3 on rank 0; column 2: tie on all ranks
    assert grads[0] == [0.0, 2.0, 1.0]
    assert grads[3] == [1.0, 0.0, 1.0]
    assert grads[1] == [0.0, 0.0, 1.0]


def _cached_and_async():
    from hp_dtensor._redistribute import compile_plan

    mesh = init_device_mesh("cpu", (4,))
    x = make_dtensor(torch.ones(8, 4), mesh, [Shard(0)])
    before = compile_plan.cache_info().hits
    for _ in range(3):
        y = x.redistribute(mesh, [Replicate()], async_op=True)
    assert torch.equal(y.to_local(), torch.ones(8, 4))
    return compile_plan.cache_info().hits - before


def test_plans_are_reused(pool):
    assert min(pool.run(_cached_and_async)) >= 2
