"""The cross-mesh planner (pure): over many random layouts, every destination box is tiled
exactly by what it receives plus what it copies locally, no rank receives a byte it already
holds, and the bytes sent are the minimum: what each destination needs and does not hold."""

import math
import random

import pytest

from hp_dtensor import Partial, Replicate, Shard
from hp_dtensor._transfer import _overlap, _plan, _Side


def _random_side(rng, world, ndim):
    n = rng.choice([1, 2, 3, 4])
    ranks = tuple(rng.sample(range(world), n))
    shape = (n,) if n in (1, 3) or rng.random() < 0.5 else (2, n // 2)
    pls = []
    for _ in shape:
        pls.append(rng.choice([Replicate(), Shard(rng.randrange(ndim))]))
    return _Side(ranks, shape, tuple(pls))


def _vol(size):
    return math.prod(size)


@pytest.mark.parametrize("seed", range(300))
def test_random_layouts_move_the_minimum(seed):
    rng = random.Random(seed)
    ndim = rng.choice([1, 2, 3])
    shape = tuple(rng.choice([1, 3, 4, 5, 8]) for _ in range(ndim))
    src, dst = _random_side(rng, 6, ndim), _random_side(rng, 6, ndim)
    transfers, reduce = _plan(src, dst, shape, 4)
    assert not reduce
    sent = sum(t.nbytes for t in transfers if t.src != t.dst)
    minimum = 0
    for d in dst.ranks:
        d_off, d_size = dst.box(d, shape)
        mine = [t for t in transfers if t.dst == d]
        # the pieces tile the box: volumes add up and no two overlap
        assert sum(_vol(t.size) for t in mine) == _vol(d_size)
        for i, a in enumerate(mine):
            assert _overlap(a.offset, a.size, d_off, d_size) == (a.offset, a.size)
            for b in mine[i + 1 :]:
                assert _overlap(a.offset, a.size, b.offset, b.size) is None
        held = 0
        if d in src.ranks:
            s_off, s_size = src.box(d, shape)
            hit = _overlap(s_off, s_size, d_off, d_size)
            held = _vol(hit[1]) if hit else 0
            for t in mine:  # nothing it holds comes over the wire
                if t.src != d:
                    assert _overlap(t.offset, t.size, s_off, s_size) is None
        minimum += (_vol(d_size) - held) * 4
    assert sent == minimum


def test_partial_sources_send_every_contribution():
    src = _Side((0, 1), (2,), (Partial(),))
    dst = _Side((2, 3), (2,), (Shard(0),))
    transfers, reduce = _plan(src, dst, (4, 2), 4)
    assert reduce
    assert sorted((t.src, t.dst, t.offset) for t in transfers) == [
        (0, 2, (0, 0)),
        (0, 3, (2, 0)),
        (1, 2, (0, 0)),
        (1, 3, (2, 0)),
    ]


def test_replicated_sources_share_the_sending():
    src = _Side((0, 1), (2,), (Replicate(),))
    dst = _Side((2, 3, 4, 5), (4,), (Shard(0),))
    transfers, _ = _plan(src, dst, (8,), 1)
    senders = [t.src for t in transfers]
    assert senders.count(0) == senders.count(1) == 2
