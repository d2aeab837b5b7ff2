"""Run on 2 MindSpore CPU workers (see test_mindspore_backend.py): every collective of the
MindSpore platform against a numpy oracle computed from all ranks' inputs; returns the rank's
verdicts, check by check."""

import traceback

import numpy as np


def _inputs(rank, shape, seed):
    return np.random.default_rng(seed + rank).standard_normal(shape).astype(np.float32)


def collectives_body():
    import mindspore as ms

    from hp_dtensor import get_platform

    plat = get_platform("cpu")
    assert plat.name == "mindspore", plat.name
    if not plat.is_initialized():
        plat.init_process_group(None, 60, "cpu")
    rank, world = plat.get_rank(), plat.get_world_size()
    results = {}

    def check(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per check
            results[name] = traceback.format_exc()

    everyone = [_inputs(r, (world * 3, 5), 10) for r in range(world)]
    mine = ms.Tensor(everyone[rank])

    def all_reduce():
        for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min), ("avg", np.mean)):
            t = ms.Tensor(everyone[rank])
            assert plat.all_reduce(t, op, None) is None
            np.testing.assert_allclose(
                t.asnumpy(), ref(np.stack(everyone), 0), rtol=1e-6, atol=1e-6
            )

    def all_gather():
        out = plat.zeros((world * world * 3, 5), ms.float32, "cpu")
        plat.all_gather_into(out, mine, None)
        np.testing.assert_array_equal(out.asnumpy(), np.concatenate(everyone, 0))

    def reduce_scatter():
        for op, ref in (("sum", np.sum), ("avg", np.mean), ("max", np.max)):
            out = plat.zeros((3, 5), ms.float32, "cpu")
            work = plat.reduce_scatter_into(out, mine, op, None, async_op=True)
            assert work.wait()
            full = ref(np.stack(everyone), 0)
            np.testing.assert_allclose(
                out.asnumpy(), full[rank * 3 : (rank + 1) * 3], rtol=1e-6, atol=1e-6
            )

    def all_to_all():
        splits = [[1, 4], [3, 0]]  # splits[p][q]: rows p sends to q (uneven, one empty)
        x = ms.Tensor(_inputs(rank, (sum(splits[rank]), 2), 20))
        out_splits = [splits[p][rank] for p in range(world)]
        out = plat.zeros((sum(out_splits), 2), ms.float32, "cpu")
        plat.all_to_all(out, x, out_splits, splits[rank], None)
        expect = []
        for p in range(world):
            src = _inputs(p, (sum(splits[p]), 2), 20)
            start = sum(splits[p][:rank])
            expect.append(src[start : start + splits[p][rank]])
        np.testing.assert_array_equal(out.asnumpy(), np.concatenate(expect, 0))

    def broadcast():
        t = ms.Tensor(everyone[rank])
        plat.broadcast(t, 1, None)
        np.testing.assert_array_equal(t.asnumpy(), everyone[1])

    def groups():
        g = plat.new_group([0, 1])
        assert g is None  # the whole world: the world group
        assert plat.group_ranks(None) == list(range(world))
        plat.barrier()

    for name, fn in [
        ("all_reduce", all_reduce),
        ("all_gather", all_gather),
        ("reduce_scatter", reduce_scatter),
        ("all_to_all", all_to_all),
        ("broadcast", broadcast),
        ("groups", groups),
    ]:
        check(name, fn)
    return results
