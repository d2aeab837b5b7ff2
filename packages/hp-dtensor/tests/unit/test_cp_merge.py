"""Context parallelism's folding of attention blocks into a rank's rows: the merge of one
block into the running output and log-sum-exp (compiled, as CUDA runs it, against eager, on
CPU, on the slices the forward hands it), the row folds that copy a chunk's first block in
and write its last straight into the input dtype (against a float64 reference, with and
without known counts), the travelling key/value gradient accumulators of the ring, and fake
tensors (a dry run), which never take the compiled form."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hp_dtensor.parallel import _context as ctxp


@pytest.fixture
def nan_empty():
    """``torch.empty`` filled with NaN (deterministic mode's fill), so that a buffer read
    before it is written shows in the result instead of passing on zeroed memory."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(was)


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, s, d, lo, hi = 2, 3, 12, 8, 4, 10
    out = torch.randn(b, h, s, d, dtype=dtype, generator=g)
    lse = torch.randn(b, h, s, dtype=dtype, generator=g)
    lse[0, 0, 5] = float("-inf")  # a row no earlier block reached
    wide = torch.randn(b, h, hi - lo, d + 4, dtype=dtype, generator=g)
    o = wide[..., :d]  # not contiguous, as a padded kernel output is
    lb = torch.randn(b, h, hi - lo, dtype=dtype, generator=g)
    return out, lse, o, lb, lo, hi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_merge_equals_eager_on_slices(monkeypatch, dtype):
    out, lse, o, lb, lo, hi = _case(dtype)
    want_out, want_lse = out.clone(), lse.clone()
    ctxp._merge_rows(want_out[:, :, lo:hi], want_lse[:, :, lo:hi], o, lb)
    monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    merge = ctxp._merge_fn(out)
    assert merge is ctxp._compiled_merge()
    merge(out[:, :, lo:hi], lse[:, :, lo:hi], o, lb)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    # rows outside the slice untouched, to the bit; the merge moved the slice
    assert torch.equal(out[:, :, :lo], _case(dtype)[0][:, :, :lo])
    assert not torch.allclose(out[:, :, lo:hi], _case(dtype)[0][:, :, lo:hi])


@pytest.mark.parametrize("compiled", [False, True])
def test_the_last_merge_writes_the_input_dtype_as_the_in_place_merge_rounded(monkeypatch, compiled):
    out, lse, o, lb, lo, hi = _case(torch.float32)
    want_out, want_lse = out.clone(), lse.clone()
    ctxp._merge_rows(want_out[:, :, lo:hi], want_lse[:, :, lo:hi], o, lb)
    if compiled:
        monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    into = ctxp._merge_fn(out, ctxp._merge_rows_into)
    assert (into is ctxp._merge_rows_into) is not compiled
    dst = torch.zeros(out.shape, dtype=torch.bfloat16)
    before = out.clone()
    into(out[:, :, lo:hi], lse[:, :, lo:hi], o, lb, dst[:, :, lo:hi])
    assert torch.equal(out, before)  # the running output is left alone
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    # within one bf16 step of the in-place merge's result rounded (the sum's order differs)
    torch.testing.assert_close(
        dst[:, :, lo:hi].float(), want_out[:, :, lo:hi], rtol=2**-8, atol=1e-6
    )
    assert not dst[:, :, :lo].any() and not dst[:, :, hi:].any()


def _blocks(dtype, seed=1):
    """Blocks of rows over 3 chunks of 2 rows: (lo, hi, g, lb), chunk 0 reached once, chunk 1
    three times, chunk 2 twice, in an order where runs split by first/last."""
    gen = torch.Generator().manual_seed(seed)
    spans = [(0, 6), (2, 6), (2, 4)]
    return [
        (
            lo,
            hi,
            torch.randn(1, 2, hi - lo, 4, generator=gen).to(dtype),
            torch.randn(1, 2, hi - lo, generator=gen).to(
                torch.float32 if dtype != torch.float64 else dtype
            ),
        )
        for lo, hi in spans
    ]


def _reference(blocks, merge):
    out = torch.zeros(1, 2, 6, 4, dtype=torch.float64)
    if not merge:
        for lo, hi, g, _ in blocks:
            out[:, :, lo:hi] += g.double()
        return out, None
    lse = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
    for lo, hi, _, lb in blocks:
        lse[:, :, lo:hi] = torch.logaddexp(lse[:, :, lo:hi], lb.double())
    for lo, hi, g, lb in blocks:
        out[:, :, lo:hi] += g.double() * torch.exp(lb.double() - lse[:, :, lo:hi]).unsqueeze(-1)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_row_folds_equal_a_float64_reference(monkeypatch, nan_empty, dtype, merge, known, compiled):
    if compiled:
        monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    blocks = _blocks(dtype)
    counts = [1, 3, 2] if known else None
    fold = ctxp._RowFold((1, 2, 6, 4), dtype, torch.device("cpu"), 2, counts, merge=merge)
    for lo, hi, g, lb in blocks:
        fold.add(lo, hi, g, lb if merge else None)
    got = fold.result()
    assert got.dtype == dtype
    want, want_lse = _reference(blocks, merge)
    # accumulated in float32 (float64 for float64), rounded once to the input dtype
    tol = {torch.bfloat16: 8e-3, torch.float32: 2e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol)
    if merge:
        torch.testing.assert_close(fold.lse.double(), want_lse, rtol=tol, atol=tol)
    assert fold.seen == [1, 3, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_travelling_key_value_accumulators_sum_in_float32(nan_empty, dtype):
    gen = torch.Generator().manual_seed(2)
    like = torch.empty(1, 2, 8, 4, dtype=dtype)
    steps = [[(0, 8)], [(0, 4)], [(2, 6), (6, 8)], [(4, 8)]]  # contributions per ring step
    parts = [
        [(lo, hi, torch.randn(1, 2, hi - lo, 4, generator=gen).to(dtype)) for lo, hi in s]
        for s in steps
    ]
    want = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
    for step in parts:
        for lo, hi, g in step:
            want[:, :, lo:hi] += g.double()
    orders = {
        "a first step covering every row": [0, 1, 2, 3],
        "a first step covering some": [1, 2, 3, 0],
        "two contributions at the last step": [0, 1, 3, 2],
    }
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-6
    for name, order in orders.items():
        acc = None
        for i, step in enumerate(order):
            # taken over, as a kernel's outputs are
            contributions = [(lo, hi, g.clone()) for lo, hi, g in parts[step]]
            acc = ctxp._fold_block(acc, like, contributions, last=i == len(order) - 1)
            if i < len(order) - 1:
                assert acc.dtype == ctxp._acc_dtype(dtype), name
        assert acc.dtype == dtype, name
        torch.testing.assert_close(
            acc.double(), want.to(dtype).double(), rtol=tol, atol=tol, msg=name
        )
    # one step only (cp = 1): the first is the last, every row covered or some
    g = parts[0][0][2]
    assert torch.equal(ctxp._fold_block(None, like, [(0, 8, g.clone())], last=True), g)
    half = ctxp._fold_block(None, like, [(0, 4, g[:, :, :4].clone())], last=True)
    assert half.dtype == dtype and torch.equal(half[:, :, :4], g[:, :, :4])
    assert not half[:, :, 4:].any()


def _sdpa_reference(q, k, v, dout, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


CASES = {  # name: (cp, causal, load_balance, kv heads, value head dim, documents)
    "cp2 causal balanced": (2, True, True, 4, 16, None),
    "cp4 causal balanced gqa": (4, True, True, 2, 16, None),
    "cp4 causal unbalanced": (4, True, False, 4, 16, None),
    "cp2 full balanced": (2, False, True, 4, 16, None),
    "cp4 full unbalanced gqa": (4, False, False, 2, 16, None),
    "cp2 narrow values": (2, True, True, 4, 8, None),
    "cp3 documents": (3, True, True, 4, 16, (5, 11, 8)),
    "cp2 documents full": (2, False, True, 2, 16, (7, 17)),
    # rows that see nothing in several blocks: the own block must come first, as in the ring
    "cp4 short documents": (4, True, True, 4, 16, (2, 7, 8, 14, 1)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_rings_steps_in_one_process_equal_sdpa_on_the_whole_sequence(nan_empty, case, dtype):
    """Every rank's forward and ring backward steps, the accumulators handed on as the ring
    sends them (``_ring_in_one_process``, what the benchmark times), against SDPA on the whole
    sequence in float64: outputs and gradients, in float64 to rounding, in bf16 within its
    rounding (accumulated in float32)."""
    cp, causal, lb, hkv, dv, docs = CASES[case]
    seq = sum(docs) if docs else 8 * cp
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, seq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, hkv, seq, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, hkv, seq, dv, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, 4, seq, dv, generator=gen, dtype=torch.float64)
    pos = torch.arange(seq)
    mask = torch.ones(seq, seq, dtype=torch.bool)
    if docs:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        mask &= doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    want = _sdpa_reference(q, k, v, dout, mask)
    layout = ctxp._positions(cp, lb, seq, docs)
    pieces = [[t.to(dtype)[:, :, layout[r]] for t in (q, k, v, dout)] for r in range(cp)]
    cfgs = [
        ctxp._Config(None, cp, r, lb, causal, 16**-0.5, 4 // hkv, "ring", False, docs)
        for r in range(cp)
    ]
    got = ctxp._ring_in_one_process(pieces, cfgs)
    for r in range(cp):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got[r], want):
            w = w[:, :, layout[r]]
            assert g.dtype == dtype and g.shape == w.shape, (case, r, name)
            if dtype == torch.float64:
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"{case} {r} {name}")
            else:  # bf16 inputs: within a few bf16 steps of the largest value
                err = (g.double() - w).abs().max() / w.abs().max()
                assert err < 3e-2, (case, r, name, err.item())


def test_fake_tensors_merge_eagerly(monkeypatch):
    monkeypatch.setattr(ctxp, "_COMPILE_MERGE_ON", ("cpu",))
    with FakeTensorMode():
        out = torch.empty(1, 2, 4, 8)
        assert ctxp._merge_fn(out) is ctxp._merge_rows
        assert ctxp._merge_fn(out, ctxp._merge_rows_into) is ctxp._merge_rows_into
    assert ctxp._merge_fn(torch.empty(1)) is ctxp._compiled_merge()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_merge_equals_eager_and_fake_cuda_tensors_run_eagerly():
    """On a GPU host: CUDA tensors take the compiled merge, with eager's values; fake CUDA
    tensors (a dry run on that host) take the eager one and run through it."""
    out, lse, o, lb, lo, hi = (t.cuda() if torch.is_tensor(t) else t for t in _case(torch.float32))
    want_out, want_lse = out.clone(), lse.clone()
    ctxp._merge_rows(want_out[:, :, lo:hi], want_lse[:, :, lo:hi], o, lb)
    merge = ctxp._merge_fn(out)
    assert merge is ctxp._compiled_merge()
    merge(out[:, :, lo:hi], lse[:, :, lo:hi], o, lb)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    with FakeTensorMode() as mode:
        f_out, f_lse, f_o, f_lb = (mode.from_tensor(t) for t in (out, lse, o, lb))
        assert f_out.device.type == "cuda"
        assert ctxp._merge_fn(f_out) is ctxp._merge_rows
        ctxp._merge_fn(f_out)(f_out[:, :, lo:hi], f_lse[:, :, lo:hi], f_o, f_lb)  # shapes only


def test_a_dry_run_with_document_masks_needs_no_values():
    """Under ``FakeTensorMode`` (the planner's dry run) document masks decide which blocks
    exist from the positions alone: fake tensors hold no values to test."""
    docs, cp = (5, 11, 8), 3
    with FakeTensorMode():
        pieces = [[torch.randn(1, 4, 8, 16) for _ in range(4)] for _ in range(cp)]
        cfgs = [
            ctxp._Config(None, cp, r, True, True, 0.25, 1, "ring", False, docs) for r in range(cp)
        ]
        got = ctxp._ring_in_one_process(pieces, cfgs)
    assert [tuple(t.shape) for t in got[0]] == [(1, 4, 8, 16)] * 4
