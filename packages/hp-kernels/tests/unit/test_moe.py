"""permute_tokens / unpermute_tokens against a loop-by-loop reference, with gradients."""

import pytest
import torch

from hp_kernels import moe


def _reference(tokens, idx, probs, num_experts):
    rows, sources = [], []
    for e in range(num_experts):  # stable: token order within an expert
        for t in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                if idx[t, j] == e:
                    rows.append(tokens[t])
                    sources.append((t, j))
    permuted = torch.stack(rows)
    out = torch.zeros_like(tokens)
    for r, (t, j) in enumerate(sources):
        out[t] = out[t] + probs[t, j] * permuted[r]
    return permuted, out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_matches_reference_with_gradients(k):
    g = torch.Generator().manual_seed(k)
    T, H, E = 11, 6, 5
    tokens = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)
    perm = moe.permute_tokens(tokens, idx, E)
    expert_out = perm.tokens * 1.5 + 0.25  # any per-row expert
    out = moe.unpermute_tokens(expert_out, perm.order, probs)

    t2 = tokens.detach().clone().requires_grad_(True)
    p2 = probs.detach().clone().requires_grad_(True)
    ref_perm, _ = _reference(t2, idx, p2, E)
    _, ref_out = _reference(ref_perm * 1.5 + 0.25, idx, p2, E)  # rows already per token copy
    assert torch.equal(perm.tokens.detach(), ref_perm.detach())
    assert perm.counts.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    assert perm.offsets.tolist() == [0, *torch.cumsum(perm.counts, 0).tolist()]
    # the reference's second call re-permutes ref_perm rows as tokens: build it directly instead
    ref_out = torch.zeros_like(t2)
    for t in range(T):
        for j in range(k):
            ref_out[t] = ref_out[t] + p2[t, j] * (t2[t] * 1.5 + 0.25)
    torch.testing.assert_close(out, ref_out)
    upstream = torch.randn(T, H, generator=g, dtype=torch.float64)
    (out * upstream).sum().backward()
    (ref_out * upstream).sum().backward()
    torch.testing.assert_close(tokens.grad, t2.grad)
    torch.testing.assert_close(probs.grad, p2.grad)


def test_unweighted_roundtrip_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 4, (7, 2), generator=g)
    perm = moe.permute_tokens(tokens, idx, 4)
    back = moe.unpermute_tokens(perm.tokens, perm.order, num_tokens=7)
    torch.testing.assert_close(back, 2 * tokens)
    assert torch.autograd.gradcheck(
        lambda t: moe.unpermute_tokens(
            moe.permute_tokens(t, idx, 4).tokens,
            perm.order,
            torch.full((7, 2), 0.3, dtype=torch.float64),
        ),
        (tokens,),
    )


def test_empty_experts_and_int32_ids():
    tokens = torch.arange(12.0).reshape(4, 3)
    perm = moe.permute_tokens(tokens, torch.tensor([3, 0, 3, 0], dtype=torch.int32), 6)
    assert perm.counts.tolist() == [2, 0, 0, 2, 0, 0]
    assert perm.order.tolist() == [1, 3, 0, 2]


def test_bad_input():
    tokens = torch.randn(4, 3)
    with pytest.raises(ValueError, match="expert ids must lie in"):
        moe.permute_tokens(tokens, torch.tensor([[0], [5], [1], [2]]), 5)
    with pytest.raises(ValueError, match="T = tokens.shape"):
        moe.permute_tokens(tokens, torch.zeros(3, 2, dtype=torch.int64), 5)
    with pytest.raises(TypeError, match="int64 or int32"):
        moe.permute_tokens(tokens, torch.zeros(4, 2), 5)
    with pytest.raises(ValueError, match="one row per entry"):
        moe.unpermute_tokens(torch.randn(5, 3), torch.arange(4))


def test_keep_drops_copies_after_every_expert_and_combines_them_as_zero():
    g = torch.Generator().manual_seed(3)
    T, H, E, k = 9, 4, 3, 2
    tokens = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(T, k, generator=g) > 0.3
    perm = moe.permute_tokens(tokens, idx, E, keep=keep)
    n_kept = int(keep.sum())
    assert perm.counts.sum() == n_kept
    assert torch.equal(perm.order[perm.inverse], torch.arange(T * k))  # inverse permutations
    kept_ids = idx.reshape(-1)[perm.order[:n_kept]]
    assert torch.equal(kept_ids, kept_ids.sort(stable=True).values)  # grouped by expert
    assert not keep.reshape(-1)[perm.order[n_kept:]].any()  # the dropped ones last
    rows = perm.tokens * 2.0
    rows = torch.cat([rows[:n_kept], torch.full_like(rows[n_kept:], float("nan"))])
    out = moe.unpermute_tokens(rows, perm.order, probs, inverse=perm.inverse, keep=keep)
    ref = (2.0 * tokens[:, None, :] * (probs * keep)[..., None]).sum(1)
    torch.testing.assert_close(out, ref)
    up = torch.randn(T, H, generator=g, dtype=torch.float64)
    (out * up).sum().backward()
    t2 = tokens.detach().clone().requires_grad_(True)
    p2 = probs.detach().clone().requires_grad_(True)
    ((2.0 * t2[:, None, :] * (p2 * keep)[..., None]).sum(1) * up).sum().backward()
    torch.testing.assert_close(tokens.grad, t2.grad)
    torch.testing.assert_close(probs.grad, p2.grad)


def test_count_experts_and_gather_rows():
    ids = torch.tensor([[2, 0], [2, 2], [1, 0]])
    assert moe.count_experts(ids, 4).tolist() == [2, 1, 3, 0]
    src = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    order = torch.tensor([3, 0, 4, 1, 2])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(5)
    assert torch.autograd.gradcheck(lambda s: moe.gather_rows(s, order, inverse), (src,))


def test_fake_tensors_are_ordered_without_reading_their_data():
    """Under FakeTensorMode (hp-plan's dry run) ids have no data: has_data says so, and
    expert_order / permute_tokens take torch's sort instead of the compiled kernel (which reads
    raw pointers) and skip the range check, with the shapes and dtypes of a real call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_kernels.moe import balanced_split, expert_order, has_data, permute_tokens

    ids = torch.tensor([[3, 0], [1, 3], [2, 2]])
    real_order, real_counts = expert_order(ids, 4)
    assert has_data(ids)
    with FakeTensorMode() as mode:
        fake_ids = mode.from_tensor(ids)
        assert not has_data(fake_ids)
        order, counts = expert_order(fake_ids, 4)
        keep = mode.from_tensor(torch.tensor([[True, False], [True, True], [False, True]]))
        kept_order, kept_counts = expert_order(fake_ids, 4, keep=keep)
        perm = permute_tokens(mode.from_tensor(torch.randn(3, 8)), fake_ids, 4)
    assert order.shape == real_order.shape and order.dtype == real_order.dtype
    assert counts.shape == real_counts.shape == (4,) and kept_counts.shape == (4,)
    assert kept_order.shape == (6,) and perm.tokens.shape == (6, 8)
    assert balanced_split(10, 4) == [3, 3, 2, 2] and balanced_split(8, 4) == [2, 2, 2, 2]
    assert sum(balanced_split(7, 3)) == 7


def test_compiled_order_and_swiglu_match_eager_without_graph_breaks():
    """Under torch.compile the CPU ids are ordered by torch's stable sort traced into the graph
    (the counting-sort extension reads raw pointers): the same order and counts as eager, also
    with dropped copies, one graph and no break; ``check=True`` still refuses an id out of
    range, compiled as eager. The SwiGLU traces to the same values and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (12, 3), generator=g)
    keep = torch.rand(12, 3, generator=g) > 0.3

    def order(i, k):
        return moe.expert_order(i, 5, keep=k, check=False)

    compiled = torch.compile(order, fullgraph=True)
    for k in (None, keep):
        got, want = compiled(ids, k), order(ids, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not counters["graph_break"]
    with pytest.raises(Exception, match="num_experts=5"):
        torch.compile(lambda i: moe.expert_order(i, 5))(torch.tensor([[0, 7]]))

    a = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    want = moe.swiglu(a, b, w)
    got = torch.compile(moe.swiglu, fullgraph=True)(a, b, w)
    torch.testing.assert_close(got, want)
    gw = torch.autograd.grad(want.sum(), (a, b, w))
    gg = torch.autograd.grad(got.sum(), (a, b, w))
    for x, y in zip(gg, gw):
        torch.testing.assert_close(x, y)
