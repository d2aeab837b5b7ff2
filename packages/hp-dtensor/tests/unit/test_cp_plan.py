"""Context parallelism's chunk layout and block plan (pure Python): every visible (query, key)
pair of the whole sequence is computed exactly once, by the rank holding the query."""

import itertools

import pytest

from hp_dtensor.parallel import _cp_plan as plan


@pytest.mark.parametrize(
    "cp,load_balance,causal", itertools.product([1, 2, 3, 4], [True, False], [True, False])
)
def test_block_calls_cover_the_mask_once(cp, load_balance, causal):
    seq = 4 * plan.num_chunks(cp, load_balance)
    seen = {}
    for rank in range(cp):
        pos = plan.positions(seq, cp, rank, load_balance)
        local = len(pos)
        nq = len(plan.local_chunks(cp, rank, load_balance))
        c = local // nq
        for src in range(cp):
            kpos = plan.positions(seq, cp, src, load_balance)
            for (qlo, qhi), (klo, khi), is_causal in plan.block_calls(
                cp, rank, src, causal, load_balance
            ):
                for i in range(qlo * c, qhi * c):
                    for j in range(klo * c, khi * c):
                        if is_causal and j - klo * c > i - qlo * c:
                            continue  # the kernel's top-left causal mask
                        key = (pos[i], kpos[j])
                        seen[key] = seen.get(key, 0) + 1
    expected = {(i, j) for i in range(seq) for j in range(seq) if not causal or j <= i}
    assert set(seen) == expected
    assert set(seen.values()) == {1}


def test_layout():
    assert plan.local_chunks(4, 1, True) == (1, 6)
    assert plan.positions(8, 2, 0, True) == [0, 1, 6, 7]
    assert plan.positions(8, 2, 1, False) == [4, 5, 6, 7]
    # every rank's local chunks concatenated: rank 0 (0, 3), rank 1 (1, 2)
    assert plan.natural_order(2, True) == [0, 2, 3, 1]
    # load balancing gives each rank the same causal work
    for cp in (2, 4):
        work = []
        for r in range(cp):
            pos = plan.positions(8 * cp, cp, r, True)
            work.append(sum(p + 1 for p in pos))
        assert len(set(work)) == 1


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_document_layout_balances_tokens_and_work(cp):
    import random

    rng = random.Random(cp)
    docs = [rng.randint(1, 900) for _ in range(7)]
    docs[-1] += -sum(docs) % cp
    spans = plan.document_layout(docs, cp)
    held = sorted(i for r in spans for a, b in r for i in range(a, b))
    assert held == list(range(sum(docs)))  # every token once
    counts = [sum(b - a for a, b in r) for r in spans]
    assert len(set(counts)) == 1  # the same number of tokens everywhere
    starts, pos = {}, 0
    for n in docs:
        for i in range(pos, pos + n):
            starts[i] = pos
        pos += n
    work = [sum(i - starts[i] + 1 for a, b in r for i in range(a, b)) for r in spans]
    assert max(work) / min(work) < 1.01  # causal work within each document, even
    with pytest.raises(ValueError, match="not divisible by cp"):
        plan.document_layout([3], 2)
