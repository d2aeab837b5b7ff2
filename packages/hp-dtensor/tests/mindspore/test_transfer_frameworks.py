"""Cross-mesh transfers, one test body for two frameworks, on 4 ranks: ``plan_transfer(...).run``
between meshes over the same ranks in another shape, over overlapping rank sets and over
disjoint ones, 1-D and 2-D, uneven shapes, Partial sources summed on the way; gradients
through ``redistribute`` to another mesh; ``transfer_state_dict``; a bad piece refused on
every rank. Each result is checked against a numpy oracle, then the two frameworks' results
against each other. Values are integers in float32, so every comparison is exact.

The torch half runs on 4 gloo ranks; the MindSpore half on 4 msrun CPU workers (skipped
where MindSpore is not installed: ``nox -s tests_mindspore`` installs it). MindSpore has no
point-to-point kernels on CPU: its platform sends each box as a two-rank broadcast."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from hp_testing.msrun import run_framework
from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.dirname(__file__))
from fw_adapters import FRAMEWORKS  # noqa: E402

pool4 = rank_pool_fixture(4)
SHAPE = (5, 7)  # uneven over 2, 3 and 4 ranks on both dims

# (name, src ranks, src mesh shape, dst ranks, dst mesh shape)
MESHES = [
    ("same ranks, 2-D to reversed 1-D", [0, 1, 2, 3], (2, 2), [3, 2, 1, 0], (4,)),
    ("same ranks, 2-D to transposed 2-D", [0, 1, 2, 3], (2, 2), [0, 2, 1, 3], (2, 2)),
    ("overlapping", [0, 1, 2], (3,), [1, 2, 3], (3,)),
    ("disjoint", [0, 1], (2,), [2, 3], (2,)),
]
SRC_1D = ["S0", "S1", "R", "P"]
DST_1D = ["S0", "S1", "R"]
SRC_2D = [("S0", "S1"), ("R", "S0"), ("P", "S1"), ("S1", "P"), ("R", "R")]
DST_2D = [("S1", "S0"), ("R", "S1")]


def _placement(name):
    from hp_dtensor import Partial, Replicate, Shard

    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial("sum")}[name]


def _ints(seed, shape=SHAPE):
    return np.random.default_rng(seed).integers(-8, 9, shape).astype(np.float32)


def _piece(x, ranks, mesh_shape, names, rank):
    """``rank``'s local piece of ``x`` laid out as ``names`` (Partial: an uneven split of the
    sum, which the transfer must add up)."""
    from hp_dtensor._shard_math import local_shape_and_offset
    from hp_dtensor._transfer import _Side

    placements = [_placement(n) for n in names]
    coord = _Side(tuple(ranks), tuple(mesh_shape), ()).coordinate(rank)
    size, off = local_shape_and_offset(x.shape, mesh_shape, coord, placements)
    part = x[tuple(slice(o, o + s) for o, s in zip(off, size))].copy()
    for d, n in enumerate(names):
        if n == "P":  # contributions: k * noise on the others, the rest on the last
            noise = _ints(100 + d, part.shape)
            k, last = coord[d], mesh_shape[d] - 1
            part = part - last * noise if k == last else noise + 0 * part
    return part


def _box(x, ranks, mesh_shape, names, rank):
    from hp_dtensor._shard_math import local_shape_and_offset
    from hp_dtensor._transfer import _Side

    coord = _Side(tuple(ranks), tuple(mesh_shape), ()).coordinate(rank)
    size, off = local_shape_and_offset(x.shape, mesh_shape, coord, [_placement(n) for n in names])
    return x[tuple(slice(o, o + s) for o, s in zip(off, size))]


def transfer_body(framework: str):
    """{case: verdict} checked against numpy here, and {case: array} for the cross-framework
    comparison."""
    import hp_dtensor as hp

    fw = FRAMEWORKS[framework]
    world_mesh = hp.init_device_mesh("cpu", (4,))
    me = world_mesh.get_rank()
    x = _ints(1)
    x[x == 0] = -0.0  # signed zeros must arrive as they are (copies, not sums)
    verdicts, arrays = {}, {}
    for name, sr, ss, dr, ds in MESHES:
        src_mesh = hp.DeviceMesh("cpu", np.array(sr).reshape(ss).tolist())
        dst_mesh = hp.DeviceMesh("cpu", np.array(dr).reshape(ds).tolist())
        srcs = SRC_1D if len(ss) == 1 else SRC_2D
        dsts = DST_1D if len(ds) == 1 else DST_2D
        for s_names in srcs:
            s_names = (s_names,) if isinstance(s_names, str) else s_names
            for d_names in dsts:
                d_names = (d_names,) if isinstance(d_names, str) else d_names
                case = f"{name}: {s_names} -> {d_names}"
                plan = hp.plan_transfer(
                    src_mesh,
                    [_placement(n) for n in s_names],
                    dst_mesh,
                    [_placement(n) for n in d_names],
                    SHAPE,
                    fw.tensor(x).dtype,
                )
                local = fw.tensor(_piece(x, sr, ss, s_names, me)) if me in sr else None
                out = plan.run(local)
                if me not in dr:
                    verdicts[case] = "ok" if out is None else f"got {type(out).__name__}"
                    continue
                got = fw.numpy(out.to_local())
                want = _box(x, dr, ds, d_names, me)
                same = np.array_equal(got, want)
                if "P" not in s_names:  # a sum of contributions makes its own zeros
                    same = same and np.array_equal(np.signbit(got), np.signbit(want))
                verdicts[case] = "ok" if same else f"{got} != {want}"
                arrays[case] = got
    verdicts.update(_gradients(hp, fw, me, arrays))
    verdicts.update(_state_dict(hp, fw, me, arrays))
    verdicts.update(_refusal(hp, fw, me))
    return verdicts, arrays


def _gradients(hp, fw, me, arrays):
    """redistribute to a mesh over the same ranks, differentiated: the loss
    sum(out * g) over the destination's pieces; the source piece's gradient is g's box in
    the source layout (a Partial or replicated source: all of g, the redundant form)."""
    src = hp.DeviceMesh("cpu", [[0, 1], [2, 3]])
    dst = hp.DeviceMesh("cpu", [3, 1, 2, 0])
    x, g = _ints(1), _ints(2)
    verdicts = {}
    if fw.name == "mindspore":  # not differentiable there yet: refused, naming the way
        from hp_dtensor.errors import ShardingError

        t = hp.DTensor.from_local(
            fw.tensor(_box(x, [0, 1, 2, 3], (2, 2), ("S0", "S1"), me).copy()),
            src,
            [_placement("S0"), _placement("S1")],
            shape=SHAPE,
        )
        try:
            t.redistribute(dst, [_placement("S0")])
            return {"another mesh refused": "not refused"}
        except ShardingError as e:
            return {"another mesh refused": "ok" if "plan_transfer" in str(e) else str(e)}
    for s_names, d_name in ((("S0", "S1"), "S1"), (("P", "S0"), "S0"), (("R", "S1"), "R")):
        pl = [_placement(n) for n in s_names]
        g_local = fw.tensor(_box(g, [3, 1, 2, 0], (4,), (d_name,), me).copy())

        def f(local, pl=pl, d_name=d_name, g_local=g_local):
            t = hp.DTensor.from_local(local, src, pl, shape=SHAPE)
            out = t.redistribute(dst, [_placement(d_name)]).to_local()
            return (out * g_local).sum()

        _, (dx,) = fw.grads(f, [_piece(x, [0, 1, 2, 3], (2, 2), s_names, me)])
        grad_names = tuple("R" if n == "P" else n for n in s_names)
        want = _box(g, [0, 1, 2, 3], (2, 2), grad_names, me)
        case = f"gradient {s_names} -> {d_name}"
        verdicts[case] = "ok" if np.array_equal(dx, want) else f"{dx} != {want}"
        arrays[case] = dx
    return verdicts


def _state_dict(hp, fw, me, arrays):
    """Two tensors from Shard(0) on ranks 0-1 to Shard(1) and Replicate on ranks 2-3."""
    src, dst = hp.DeviceMesh("cpu", [0, 1]), hp.DeviceMesh("cpu", [2, 3])
    full = {"w": _ints(5), "b": _ints(6, (3,))}
    sd = layouts = None
    if me in (0, 1):
        sd = {
            n: hp.DTensor.from_local(
                fw.tensor(_box(v, [0, 1], (2,), ("S0",), me).copy()),
                src,
                [_placement("S0")],
                shape=v.shape,
            )
            for n, v in full.items()
        }
    if me in (2, 3):
        layouts = {"w": [_placement("S1")], "b": [_placement("R")]}
    out = hp.transfer_state_dict(sd, layouts, src_mesh=src, dst_mesh=dst)
    if me not in (2, 3):
        return {"state dict": "ok" if out is None else f"got {type(out).__name__}"}
    got = {n: fw.numpy(t.to_local()) for n, t in out.items()}
    want = {"w": _box(full["w"], [2, 3], (2,), ("S1",), me), "b": full["b"]}
    ok = sorted(got) == sorted(want) and all(np.array_equal(got[n], want[n]) for n in want)
    arrays["state dict"] = got["w"]
    return {"state dict": "ok" if ok else f"{got} != {want}"}


def _refusal(hp, fw, me):
    """Rank 1 passes a piece of the wrong shape: every rank raises ShardingError before any
    box moves, and the group still works afterwards."""
    from hp_dtensor.errors import ShardingError

    src, dst = hp.DeviceMesh("cpu", [0, 1, 2]), hp.DeviceMesh("cpu", [1, 2, 3])
    x = _ints(1)
    plan = hp.plan_transfer(
        src, [_placement("S0")], dst, [_placement("S1")], SHAPE, fw.tensor(x).dtype
    )
    local = None
    if me in (0, 1, 2):
        piece = _box(x, [0, 1, 2], (3,), ("S0",), me)
        local = fw.tensor(piece[:1].copy() if me == 1 else piece.copy())
    try:
        plan.run(local)
        verdict = "not refused"
    except ShardingError as e:
        verdict = "ok" if "(1, 7)" in str(e) or "rank(s) [1]" in str(e) else str(e)
    again = plan.run(fw.tensor(_box(x, [0, 1, 2], (3,), ("S0",), me).copy()) if me < 3 else None)
    if me in (1, 2, 3) and not np.array_equal(
        fw.numpy(again.to_local()), _box(x, [1, 2, 3], (3,), ("S1",), me)
    ):
        verdict = "the transfer after the refusal is wrong"
    out = {"refused on every rank": verdict}
    # bf16: exact on torch; refused on every rank on MindSpore's CPU (no kernels to copy
    # bf16 slices there), before any box moves
    if fw.name == "torch":
        import torch

        bf16 = torch.bfloat16
        cast = lambda a: torch.tensor(a).to(bf16)  # noqa: E731
        back = lambda t: t.float().numpy()  # noqa: E731
    else:
        import mindspore as ms

        bf16 = ms.bfloat16
        cast = lambda a: ms.Tensor(a).astype(bf16)  # noqa: E731
        back = lambda t: t.astype(ms.float32).asnumpy()  # noqa: E731
    plan = hp.plan_transfer(src, [_placement("S0")], dst, [_placement("S1")], SHAPE, bf16)
    piece = cast(_box(x, [0, 1, 2], (3,), ("S0",), me).copy()) if me < 3 else None
    try:
        got = plan.run(piece)
        ok = me == 0 or np.array_equal(back(got.to_local()), _box(x, [1, 2, 3], (3,), ("S1",), me))
        out["bf16"] = "ok" if fw.name == "torch" and ok else "not refused on MindSpore"
    except ShardingError as e:
        out["bf16"] = "ok" if fw.name == "mindspore" and "float32" in str(e) else str(e)
    return out


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_transfers(framework, request, tmp_path):
    results = run_framework(
        framework, request, tmp_path, transfer_body, framework, pool="pool4", workers=4
    )
    for rank, (verdicts, _) in enumerate(results):
        failed = {k: v for k, v in verdicts.items() if v != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
        # 49 moves, 3 gradients (torch; MindSpore: 1 refusal), a state dict, a bad piece, bf16
        assert len(verdicts) == (55 if framework == "torch" else 53), len(verdicts)
    request.config.cache_transfer = getattr(request.config, "cache_transfer", {})
    request.config.cache_transfer[framework] = [a for _, a in results]


def test_frameworks_agree(request):
    """torch's and MindSpore's results, case by case and rank by rank, are the same arrays."""
    cache = getattr(request.config, "cache_transfer", {})
    if set(cache) != {"torch", "mindspore"}:
        pytest.skip(
            "needs both frameworks' runs (MindSpore is installed by nox -s tests_mindspore)"
        )
    for rank, (a, b) in enumerate(zip(cache["torch"], cache["mindspore"])):
        assert {k for k in a if not k.startswith("gradient")} == set(b)
        for case in b:
            np.testing.assert_array_equal(a[case], b[case], err_msg=f"rank {rank}: {case}")
