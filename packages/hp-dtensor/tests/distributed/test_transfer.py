"""Cross-mesh transfers on 4 gloo ranks, against the whole tensor: every pair of placements over
meshes of the same ranks in another shape or order, of overlapping rank sets ([0, 1, 2] to
[1, 2, 3]) and of disjoint ones ([0, 1] to [2, 3]); 1-D and 2-D meshes; even and uneven shapes;
Partial sources summed on the way; gradients through a redistribute across meshes; bad input
refused on every rank before any transfer."""

import itertools

import pytest
import torch
import torch.distributed as dist

import hp_dtensor as hp
from hp_dtensor import Partial, Replicate, Shard, ShardingError
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(4)

MESHES = {
    "row": [[0, 1], [2, 3]],
    "col": [[0, 2], [1, 3]],
    "rev": [3, 2, 1, 0],
    "abc": [0, 1, 2],
    "bcd": [1, 2, 3],
    "ab": [0, 1],
    "cd": [2, 3],
}
PAIRS = [("row", "col"), ("row", "rev"), ("abc", "bcd"), ("ab", "cd"), ("bcd", "ab")]
SHAPES = [(4, 6), (5, 3)]  # even and uneven


def _placements(ndim):
    opts = [Replicate(), Shard(0), Shard(1)]
    return list(itertools.product(opts, repeat=ndim))


def _mesh(name):
    return hp.DeviceMesh("cpu", MESHES[name])


def _contributions(x, n, seed):
    """n tensors that sum to x (the pieces of a Partial source)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(x.shape, generator=g) for _ in range(n - 1)]
    return [x - sum(parts, torch.zeros_like(x)), *parts]


def _source_piece(x, mesh, placements, me, seed=0):
    if me not in mesh.rank_list:
        return None
    coord = hp._transfer._Side(mesh.rank_list, mesh.shape, ()).coordinate(me)
    full = x
    for dim, p in enumerate(placements):
        if isinstance(p, Partial):
            full = _contributions(x, mesh.shape[dim], seed + dim)[coord[dim]]
    size, off = hp.local_shape_and_offset(x.shape, mesh.shape, coord, placements)
    piece = full
    for d, (o, s) in enumerate(zip(off, size)):
        piece = piece.narrow(d, o, s)
    return piece.contiguous()


def _expected(x, mesh, placements, me):
    coord = hp._transfer._Side(mesh.rank_list, mesh.shape, ()).coordinate(me)
    size, off = hp.local_shape_and_offset(x.shape, mesh.shape, coord, placements)
    piece = x
    for d, (o, s) in enumerate(zip(off, size)):
        piece = piece.narrow(d, o, s)
    return piece


def _all_pairs(src_name, dst_name, partial):
    me = dist.get_rank()
    src, dst = _mesh(src_name), _mesh(dst_name)
    checked = 0
    for shape in SHAPES:
        x = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        src_opts = _placements(src.ndim)
        if partial:
            src_opts = [(Partial(),) + p[1:] for p in src_opts if not isinstance(p[0], Partial)]
        for sp in src_opts:
            for dp in _placements(dst.ndim):
                plan = hp.plan_transfer(src, sp, dst, dp, shape, torch.float32)
                out = plan.run(_source_piece(x, src, sp, me))
                if me in dst.rank_list:
                    torch.testing.assert_close(out.to_local(), _expected(x, dst, dp, me))
                    assert tuple(out.shape) == shape
                else:
                    assert out is None
                checked += 1
    return checked


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
@pytest.mark.parametrize("partial", [False, True], ids=["exact", "partial"])
def test_every_pair_of_placements(pool, src, dst, partial):
    counts = pool.run(_all_pairs, src, dst, partial)
    assert len(set(counts)) == 1 and counts[0] > 0


def _grad_across_meshes():
    a, b = _mesh("row"), _mesh("col")
    torch.manual_seed(0)
    full = torch.randn(5, 6)
    x = hp.distribute_tensor(full.clone(), a, [Shard(0), Shard(1)]).requires_grad_(True)
    y = x.redistribute(b, [Replicate(), Shard(0)])
    assert y.device_mesh == b
    torch.testing.assert_close(y.full_tensor(), full)
    (y * y).sum().to_local().backward()  # the loss sum(x^2): its gradient is 2x
    return x.grad.full_tensor(), x.grad.placements


def test_redistribute_across_meshes_is_differentiable(pool):
    torch.manual_seed(0)
    full = torch.randn(5, 6)
    for g, placements in pool.run(_grad_across_meshes):
        assert placements == (Shard(0), Shard(1))  # back on x's mesh, in x's placements
        torch.testing.assert_close(g, 2 * full)


def _bad(case):
    me = dist.get_rank()
    src, dst = _mesh("ab"), _mesh("cd")
    plan = hp.plan_transfer(src, [Shard(0)], dst, [Shard(0)], (4, 2), torch.float32)
    x = torch.zeros(4, 2)
    local = _source_piece(x, src, [Shard(0)], me)
    if case == "outsider" and me == 3:
        local = torch.zeros(2, 2)  # not in the source mesh
    if case == "shape" and me == 0:
        local = torch.zeros(3, 2)
    if case == "dtype" and me == 1:
        local = local.double()
    try:
        plan.run(local)
    except ShardingError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["outsider", "shape", "dtype"])
def test_bad_pieces_are_refused_on_every_rank(pool, case):
    msgs = pool.run(_bad, case)
    assert all(m is not None for m in msgs), msgs
    bad = {"outsider": 3, "shape": 0, "dtype": 1}[case]
    assert "TransferPlan.run: rank" in msgs[bad] and f"rank(s) [{bad}]" in msgs[(bad + 1) % 4]


def _refusals():
    a, b = _mesh("ab"), _mesh("cd")
    out = []
    for call in (
        lambda: hp.plan_transfer(a, [Shard(0)], b, [Partial()], (4,), torch.float32),
        lambda: hp.plan_transfer(a, [Shard(3)], b, [Shard(0)], (4,), torch.float32),
        lambda: hp.plan_transfer(a, [Shard(0)], b, [Shard(0)], (4,), "float"),
        lambda: hp.plan_transfer(a, [Shard(0)], "cd", [Shard(0)], (4,), torch.float32),
    ):
        try:
            call()
            out.append(None)
        except Exception as e:
            out.append(type(e).__name__)
    return out


def test_plans_that_cannot_be_made_are_refused(pool):
    res = pool.run(_refusals)
    assert res[0] == ["PlacementError", "PlacementError", "PlacementError", "HPDTensorTypeError"]


def _tp_plan():
    import hp_dtensor.parallel as hpp

    col, row = hpp.ColwiseParallel, hpp.RowwiseParallel
    plan = {
        "tok": row(input_layouts=Replicate(), output_layouts=Replicate()),
        "out": col(output_layouts=Replicate()),
    }
    for i in range(2):
        plan.update({f"layers.{i}.w{x}": col() for x in "qkv"})
        plan.update({f"layers.{i}.w1": col(), f"layers.{i}.w3": col()})
        plan.update({f"layers.{i}.wo": row(), f"layers.{i}.w2": row()})
    return plan


def _move_tiny_llama(async_op):
    """TinyLlama trained on FSDP 2 (ranks 0-1: every parameter Shard(0)) moved to TP 2 on
    ranks 2-3 (the Megatron plan); the logits there equal the whole model's."""
    import hp_dtensor.parallel as hpp
    from hp_testing.models import TinyLlama

    me = dist.get_rank()
    torch.manual_seed(0)
    ref = TinyLlama()
    ids = torch.randint(0, 37, (2, 8))
    fsdp, tp = _mesh("ab"), _mesh("cd")
    src = dst = None
    if me in fsdp.rank_list:  # the trainer's side
        src = {
            k: hp.distribute_tensor(v.detach().clone(), fsdp, [Shard(0)])
            for k, v in ref.state_dict().items()
        }
    if me in tp.rank_list:  # the rollout side: a model of random weights, laid out for TP
        torch.manual_seed(1)
        model = TinyLlama()
        hpp.parallelize_module(model, tp, _tp_plan())
        dst = {  # the norms stay whole (plain tensors): replicated
            k: v.placements if isinstance(v, hp.DTensor) else [Replicate()]
            for k, v in model.state_dict().items()
        }
    out = hp.transfer_state_dict(src, dst, src_mesh=fsdp, dst_mesh=tp, async_op=async_op)
    if async_op:
        out = out.wait()
    if me not in tp.rank_list:
        return out
    with torch.no_grad():
        for k, v in model.state_dict().items():
            (v.to_local() if isinstance(v, hp.DTensor) else v).copy_(out[k].to_local())
    return (model(ids) - ref(ids)).abs().max().item()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_model_moves_from_fsdp_to_tensor_parallel_ranks(pool, async_op):
    res = pool.run(_move_tiny_llama, async_op)
    assert res[0] is None and res[1] is None
    assert res[2] < 1e-5 and res[3] < 1e-5, res


def _review_cases():
    me = dist.get_rank()
    a3, b3 = _mesh("abc"), _mesh("bcd")
    out = {}
    # a Partial sum arriving replicated is the same bits on every destination rank
    vals = {0: 1e8, 1: -1e8, 2: 1.0}
    plan = hp.plan_transfer(a3, [Partial()], _mesh("rev"), [Replicate()], (4,), torch.float32)
    got = plan.run(torch.full((4,), vals[me]) if me in a3.rank_list else None)
    out["sum"] = got.to_local()[0].item()
    # the ranks must hold the same plan: one of them planned other placements
    dst_pl = [Replicate()] if me == 3 else [Shard(0)]
    plan = hp.plan_transfer(a3, [Shard(0)], b3, dst_pl, (6,), torch.float32)
    piece = torch.zeros(2) if me in a3.rank_list else None
    try:
        plan.run(piece)
        out["mismatch"] = None
    except ShardingError as e:
        out["mismatch"] = "planned different transfers" in str(e)
    # Partial('avg') is not a sum: refused, on every rank, by the state-dict path too
    src = None
    if me in (0, 1):
        x = hp.DTensor.from_local(torch.ones(2), _mesh("ab"), [Partial("avg")])
        src = {"w": x}
    lay = {"w": [Replicate()]} if me in (2, 3) else None
    try:
        hp.transfer_state_dict(src, lay, src_mesh=_mesh("ab"), dst_mesh=_mesh("cd"))
        out["avg"] = None
    except hp.PlacementError as e:
        out["avg"] = "Partial('sum')" in str(e)
    # async: the sources may change right after the call returns
    src = (
        {"w": hp.distribute_tensor(torch.arange(4.0), _mesh("ab"), [Shard(0)])} if me < 2 else None
    )
    lay = {"w": [Replicate()]} if me >= 2 else None
    handle = hp.transfer_state_dict(
        src, lay, src_mesh=_mesh("ab"), dst_mesh=_mesh("cd"), async_op=True
    )
    if src is not None:
        src["w"].to_local().add_(100)
    res = handle.wait()
    out["async"] = res["w"].to_local().tolist() if res is not None else None
    return out


def test_review_cases(pool):
    res = pool.run(_review_cases)
    sums = [r["sum"] for r in res]
    assert len(set(sums)) == 1, sums  # bitwise the same on every destination
    assert all(r["mismatch"] is True for r in res)
    assert all(r["avg"] is True for r in res)
    assert [r["async"] for r in res] == [None, None, [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
