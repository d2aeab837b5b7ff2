"""One-sided collectives on 2 and 4 CPU ranks against gloo (the oracle), with uneven sizes,
float32 / bfloat16 / int64, workspace growth and reuse, and errors raised on every rank."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from hp_kernels import comm
from hp_testing.pytest_plugin import rank_pool_fixture

warnings.filterwarnings(
    "ignore", message=".*reduce_scatter_tensor.*deprecated", category=FutureWarning
)

pool2 = rank_pool_fixture(2)
pool4 = rank_pool_fixture(4)
# the two-copy path through shared slots, used where cross-process reads are not allowed
pool3_slots = rank_pool_fixture(3, env={"HP_KERNELS_CMA": "0"})

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _gather_body(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    for shape in [(7, 3), (1,), (0, 5), (33, 65)]:  # odd sizes, an empty one
        x = _data(shape, dtype, 10 + rank)
        ours = torch.empty((world * shape[0], *shape[1:]), dtype=dtype)
        ref = torch.empty_like(ours)
        comm.all_gather_into_tensor(ours, x)
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(ours, ref), shape
    return True


def _a2a_body(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # splits[i][j]: rows rank i sends to rank j, some zero
        splits = torch.randint(0, 4, (world, world), generator=g).tolist()
        x = _data((sum(splits[rank]), 3, 2), dtype, 20 + rank)
        rows_out = sum(splits[i][rank] for i in range(world))
        ours = torch.empty((rows_out, 3, 2), dtype=dtype)
        ref = torch.empty_like(ours)
        out_splits = [splits[i][rank] for i in range(world)]
        comm.all_to_all_single(ours, x, out_splits, splits[rank])
        dist.all_to_all_single(ref, x, out_splits, splits[rank])
        assert torch.equal(ours, ref)
    x = _data((world * 5,), dtype, 30 + rank)  # even split, no sizes given
    ours, ref = torch.empty_like(x), torch.empty_like(x)
    comm.all_to_all_single(ours, x)
    dist.all_to_all_single(ref, x)
    assert torch.equal(ours, ref)
    return True


def _rs_body(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    for n in (1, 13, 1000):
        x = _data((world * n,), dtype, 40 + rank)
        full = [_data((world * n,), dtype, 40 + r).double() for r in range(world)]
        exact = torch.stack(full).sum(0)[rank * n : (rank + 1) * n]
        ours = torch.empty((n,), dtype=dtype)
        comm.reduce_scatter_tensor(ours, x)
        if dtype == torch.bfloat16:  # accumulated in float32, rounded once
            assert torch.equal(ours, exact.float().to(dtype))
        else:
            ref = torch.empty_like(ours)
            dist.reduce_scatter_tensor(ref, x)
            if dtype == torch.int64:
                assert torch.equal(ours, ref)
            else:  # float32 sums in another order than gloo's: rounding-level differences
                torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        if dtype != torch.int64:
            comm.reduce_scatter_tensor(ours, x, "avg")
            torch.testing.assert_close(
                ours.double(),
                exact / world,
                rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                atol=1e-6,
            )
    return True


def _ar_body(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    for n in (1, 3, 1001):  # fewer elements than ranks, uneven chunks
        x = _data((n,), dtype, 50 + rank)
        full = torch.stack([_data((n,), dtype, 50 + r).double() for r in range(world)])
        for op in ("sum", "max", "avg"):
            if op == "avg" and dtype == torch.int64:
                continue
            ours = x.clone()
            comm.all_reduce(ours, op)
            exact = {"sum": full.sum(0), "max": full.max(0).values, "avg": full.mean(0)}[op]
            if dtype == torch.int64 or op == "max":
                assert torch.equal(ours, exact.to(dtype)), op
            elif dtype == torch.float32 and op == "sum":
                ref = x.clone()
                dist.all_reduce(ref)
                torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(
                    ours.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5
                )
    return True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_into_tensor(pool2, pool4, dtype):
    assert pool2.run(_gather_body, dtype) == [True] * 2
    assert pool4.run(_gather_body, dtype) == [True] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all_single_uneven(pool2, pool4, dtype):
    assert pool2.run(_a2a_body, dtype) == [True] * 2
    assert pool4.run(_a2a_body, dtype) == [True] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_tensor(pool2, pool4, dtype):
    assert pool2.run(_rs_body, dtype) == [True] * 2
    assert pool4.run(_rs_body, dtype) == [True] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce(pool2, pool4, dtype):
    assert pool2.run(_ar_body, dtype) == [True] * 2
    assert pool4.run(_ar_body, dtype) == [True] * 4


def _wire_body():
    """bf16 on the wire, float32 accumulation: within bf16 rounding of the float32 result and
    closer to it than a reduction done in bf16 (gloo's, on bf16 inputs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 4096
    x = torch.randn(world * n, generator=torch.Generator().manual_seed(60 + rank)) * 10
    exact = torch.empty(n)
    dist.reduce_scatter_tensor(exact, x)  # float32 oracle
    ours = torch.empty(n)
    comm.reduce_scatter_tensor(ours, x, group=None, wire_dtype=torch.bfloat16)
    low = torch.empty(n, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(low, x.to(torch.bfloat16))
    err_ours = (ours - exact).abs()
    err_low = (low.float() - exact).abs()
    # each input rounds by <= 2^-9 relative, the sum is exact in float32
    bound = (
        sum(
            torch.randn(world * n, generator=torch.Generator().manual_seed(60 + r)).mul(10).abs()
            for r in range(world)
        )[rank * n : (rank + 1) * n]
        * 2.0**-8
    )
    assert bool((err_ours <= bound + 1e-6).all())
    assert err_ours.mean() < err_low.mean(), (err_ours.mean(), err_low.mean())
    y = x[:n].clone()
    ar_exact = y.clone()
    dist.all_reduce(ar_exact)
    comm.all_reduce(y, wire_dtype=torch.bfloat16)
    torch.testing.assert_close(y, ar_exact, rtol=2**-7, atol=world * 2**-7 * 40)
    return float(err_ours.mean()), float(err_low.mean())


def test_low_precision_wire(pool4):
    results = pool4.run(_wire_body)
    assert all(ours < low for ours, low in results)


def _growth_body():
    """Calls of growing size (the workspace grows collectively), interleaved ops, reuse."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for n in (4, 100_000, 8, 300_000, 16):
        x = torch.full((n,), float(rank + 1))
        out = torch.empty(world * n)
        comm.all_gather_into_tensor(out, x)
        assert torch.equal(
            out, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n)
        )
        comm.all_reduce(x)
        assert bool((x == world * (world + 1) / 2).all())
    # only one rank's input outgrows the workspace: all_to_all with one big split
    big = 2_000_000
    splits_in = [big if (rank == 0 and j == world - 1) else 1 for j in range(world)]
    x = torch.arange(sum(splits_in), dtype=torch.float32)
    out_rows = [(big if (i == 0 and rank == world - 1) else 1) for i in range(world)]
    ours = torch.empty(sum(out_rows))
    ref = torch.empty_like(ours)
    comm.all_to_all_single(ours, x, out_rows, splits_in)
    dist.all_to_all_single(ref, x, out_rows, splits_in)
    assert torch.equal(ours, ref)
    return True


def test_workspace_growth_and_reuse(pool2):
    assert pool2.run(_growth_body) == [True] * 2


def _subgroup_body():
    """A collective on a subgroup (ranks 1 and 3) next to one on the world."""
    rank = dist.get_rank()
    sub = dist.new_group([1, 3])
    x = torch.full((5,), float(rank))
    if rank in (1, 3):
        out = torch.empty(10)
        comm.all_gather_into_tensor(out, x, group=sub)
        assert torch.equal(out, torch.tensor([1.0] * 5 + [3.0] * 5))
    y = torch.full((3,), float(rank))
    comm.all_reduce(y)
    assert torch.equal(y, torch.full((3,), 6.0))
    return True


def test_subgroup(pool4):
    assert pool4.run(_subgroup_body) == [True] * 4


def _error_body(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if kind == "size":
            x = torch.ones(3 + rank)
            comm.all_gather_into_tensor(torch.empty(world * (3 + rank)), x)
        elif kind == "dtype":
            x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
            comm.all_reduce(x)
        elif kind == "splits":
            comm.all_to_all_single(
                torch.empty(world + (rank == 0)),
                torch.ones(world),
                [1] * (world - 1) + [1 + (rank == 0)],
                [1] * world,
            )
        elif kind == "noncontiguous":
            x = torch.ones(4, 4).t()
            comm.all_reduce(x)
        elif kind == "output-size":
            comm.all_gather_into_tensor(torch.empty(5), torch.ones(4))
        elif kind == "one-rank-output":  # only rank 1 is wrong: rank 0 must not wait forever
            comm.all_gather_into_tensor(torch.empty(world * 4 + rank), torch.ones(4))
        elif kind == "one-rank-noncontiguous":
            x = torch.ones(4, 4)
            comm.reduce_scatter_tensor(
                torch.empty(8),
                (x.t() if rank == 0 else x).reshape(-1)[:16].view(4, 4).t() if rank == 0 else x,
            )
        elif kind == "one-rank-splits":
            comm.all_to_all_single(
                torch.empty(world), torch.ones(world), None, [1] * (world - 1) + [1 + rank]
            )
        elif kind == "one-rank-op":
            comm.all_reduce(torch.ones(3), "max" if rank == 0 else "prod")
    except (ValueError, TypeError) as exc:
        message = str(exc)
    else:
        return "no error"
    # the group still works afterwards
    y = torch.ones(2)
    comm.all_reduce(y)
    assert torch.equal(y, torch.full((2,), float(world)))
    return message


@pytest.mark.parametrize(
    "kind, words",
    [
        ("size", ["all_gather_into_tensor", "rank 0: 3", "rank 1: 4"]),
        ("dtype", ["disagree on dtype", "float64"]),
        ("splits", ["rank 1 sends 1 rows to rank 0", "output_split_sizes[1] is 2"]),
        ("noncontiguous", ["contiguous"]),
        ("output-size", ["output has 5 elements"]),
        ("one-rank-output", ["output has 9 elements", "rank(s) [1] passed invalid arguments"]),
        ("one-rank-noncontiguous", ["contiguous", "rank(s) [0] passed invalid arguments"]),
        ("one-rank-splits", ["sums to 3", "rank(s) [1] passed invalid arguments"]),
        ("one-rank-op", ["op='prod'", "rank(s) [1] passed invalid arguments"]),
    ],
)
def test_bad_input_raises_on_every_rank(pool2, kind, words):
    messages = pool2.run(_error_body, kind)
    if kind.startswith("one-rank"):  # the bad rank names its argument, the other names the rank
        joined = " | ".join(messages)
        for word in words:
            assert word in joined, (kind, messages)
        assert all("no error" != m for m in messages)
        return
    for message in messages:
        for word in words:
            assert word in message, (kind, message)


def _paths_body():
    """Which path a rank reads a peer's input by (in-place symmetric, cross-process read or
    shared slot) must not change results: ranks 0 and 2 hold their inputs in symmetric memory,
    the others in ordinary tensors."""
    import hp_kernels.symm_mem as symm
    from hp_kernels.comm import _workspace

    rank, world = dist.get_rank(), dist.get_world_size()
    mem = symm.empty((4096,), torch.float32)
    out = {}
    for sym in (False, True):

        def place(t, sym=sym):
            if sym and rank % 2 == 0:
                view = mem.buffer[16 * rank : 16 * rank + t.numel()].view(t.shape)  # odd offsets
                view.copy_(t)
                return view
            return t

        x = place(_data((6, 5), torch.float32, 70 + rank))
        got = torch.empty(world * 6, 5)
        comm.all_gather_into_tensor(got, x)
        ref = torch.empty_like(got)
        dist.all_gather_into_tensor(ref, x.clone())
        assert torch.equal(got, ref)
        splits = [(rank + j) % 3 for j in range(world)]
        x = place(_data((sum(splits), 5), torch.float32, 80 + rank))
        out_splits = [(i + rank) % 3 for i in range(world)]
        got = torch.empty(sum(out_splits), 5)
        comm.all_to_all_single(got, x, out_splits, splits)
        ref = torch.empty_like(got)
        dist.all_to_all_single(ref, x.clone(), out_splits, splits)
        assert torch.equal(got, ref)
        x = place(_data((world * 7,), torch.float32, 90 + rank))
        got = torch.empty(7)
        comm.reduce_scatter_tensor(got, x)
        ref = torch.empty(7)
        dist.reduce_scatter_tensor(ref, x.clone())
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        out[sym] = _workspace(None).cma
    mem.close()
    return out[False]


def test_read_paths_agree(pool4, pool3_slots):
    assert pool4.run(_paths_body) == [True] * 4  # cross-process reads allowed here
    assert pool3_slots.run(_paths_body) == [False] * 3
    for body in (_gather_body, _a2a_body, _rs_body, _ar_body):
        assert pool3_slots.run(body, torch.bfloat16) == [True] * 3


_EXITING = """
import atexit, sys
import torch, torch.distributed as dist

def left():  # registered before hp_kernels.comm's own handler, so it runs after it
    print("LEFT", len(comm._workspaces), flush=True)

atexit.register(left)
from hp_kernels import comm

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
x = torch.arange(64, dtype=torch.float32) + rank
out = torch.empty_like(x)
comm.all_to_all_single(out, x)
dist.all_to_all_single(out, x)
dist.destroy_process_group()
"""


def test_workspaces_are_released_at_exit(tmp_path):
    """A workspace holds its process group; left to the interpreter's last teardown after
    destroy_process_group (with gloo work done on the group) it made 4-rank jobs abort at
    exit now and then ("terminate called without an active exception"). comm releases them
    in an atexit handler; each rank exits cleanly with none left."""
    script = tmp_path / "exiting.py"
    script.write_text(_EXITING)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "LEFT 0" in out, out
