"""Context parallelism's layout and block plan, in pure Python.

A sequence of length ``S`` is cut into chunks. Without load balancing there are ``cp`` chunks
and rank ``r`` holds chunk ``r``. With load balancing there are ``2 * cp`` and rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (head-tail), in that order: under a causal mask
every rank then has the same work. A rank's local sequence keeps the global order of its
tokens, so a causal mask over its own chunks is the ordinary top-left one.

Packed sequences (several documents, each attending only to itself) are balanced per document
instead (:func:`document_layout`): each document is cut into ``2 * cp`` pieces, head-tail as
above, whatever its length; the pieces' rounding is spread so that every rank holds the same
number of tokens.

The attention of a rank's queries against the keys of one rank (its own or another's) splits
into blocks of whole chunks, each either full or causal (or empty):
:func:`block_calls` gives them as few calls as possible, merged where the chunks are adjacent
in the local tensors.
"""

from __future__ import annotations

__all__ = [
    "block_calls",
    "chunk_kind",
    "document_layout",
    "local_chunks",
    "natural_order",
    "num_chunks",
    "positions",
    "usp_positions",
]


def num_chunks(cp: int, load_balance: bool) -> int:
    """How many chunks the sequence is cut into."""
    return 2 * cp if load_balance else cp


def local_chunks(cp: int, rank: int, load_balance: bool) -> tuple[int, ...]:
    """The global chunk ids rank ``rank`` holds, in its local order."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> list[int]:
    """The global positions of rank ``rank``'s local tokens, in local order."""
    c = seq_len // num_chunks(cp, load_balance)
    return [i for ch in local_chunks(cp, rank, load_balance) for i in range(ch * c, ch * c + c)]


def natural_order(cp: int, load_balance: bool) -> list[int]:
    """For the concatenation of every rank's local chunks (rank 0's first), the chunk index
    there of each global chunk: ``gathered_chunks[natural_order[g]]`` is global chunk ``g``."""
    layout = [ch for r in range(cp) for ch in local_chunks(cp, r, load_balance)]
    return [layout.index(g) for g in range(num_chunks(cp, load_balance))]


def chunk_kind(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """How queries of chunk ``q_chunk`` see keys of chunk ``k_chunk``: ``"full"``,
    ``"causal"`` (the same chunk) or None (all masked)."""
    if not causal or q_chunk > k_chunk:
        return "full"
    return "causal" if q_chunk == k_chunk else None


def block_calls(
    cp: int, rank: int, src: int, causal: bool, load_balance: bool
) -> list[tuple[tuple[int, int], tuple[int, int], bool]]:
    """The attention calls for rank ``rank``'s queries against rank ``src``'s keys: a list of
    ``((q_lo, q_hi), (k_lo, k_hi), is_causal)`` in local chunk indices (half-open), covering
    every visible (query, key) pair exactly once."""
    qs = local_chunks(cp, rank, load_balance)
    ks = local_chunks(cp, src, load_balance)
    kinds = {
        (a, b): chunk_kind(qa, kb, causal) for a, qa in enumerate(qs) for b, kb in enumerate(ks)
    }
    if all(k == "full" for k in kinds.values()):
        return [((0, len(qs)), (0, len(ks)), False)]
    if src == rank:
        # the own chunks in global order: the causal mask over their concatenation is exact
        return [((0, len(qs)), (0, len(ks)), True)]
    calls: list[tuple[tuple[int, int], tuple[int, int], bool]] = []
    groups: dict[tuple[int, ...], list[int]] = {}
    for a in range(len(qs)):
        seen = tuple(b for b in range(len(ks)) if kinds[(a, b)] == "full")
        if seen:
            groups.setdefault(seen, []).append(a)
    for seen, rows in groups.items():
        for lo, hi in _runs(rows):
            for klo, khi in _runs(list(seen)):
                calls.append(((lo, hi), (klo, khi), False))
    return calls


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as half-open runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def document_layout(doc_lengths: list[int], cp: int) -> list[list[tuple[int, int]]]:
    """Per rank, the ``(start, end)`` stretches of global positions it holds, ascending, for a
    sequence packed from documents of ``doc_lengths`` (summing to a multiple of ``cp``). Each
    document is cut into ``2 * cp`` pieces, piece ``p`` going to rank ``p`` or ``2 cp - 1 - p``
    (causal work even within every document); a document's ``n mod 2 cp`` extra tokens go
    round the ranks, continuing from the previous document's, so that every rank gets
    ``sum / cp`` tokens. No length needs to divide by anything."""
    total = sum(doc_lengths)
    if total % cp:
        raise ValueError(f"the documents' total length {total} is not divisible by cp = {cp}")
    out: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    turn, start = 0, 0
    for n in doc_lengths:
        base, rem = divmod(n, 2 * cp)
        sizes = [base] * (2 * cp)
        for t in range(rem):  # rank (turn + t) % cp: its head piece, then its tail piece
            r = (turn + t) % cp
            head_taken = t >= cp
            sizes[2 * cp - 1 - r if head_taken else r] += 1
        turn = (turn + rem) % cp
        for piece, size in enumerate(sizes):
            if size:
                owner = piece if piece < cp else 2 * cp - 1 - piece
                spans = out[owner]
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + size)
                else:
                    spans.append((start, start + size))
                start += size
    return out


def usp_positions(
    seq_len: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int, load_balance: bool
) -> list[int]:
    """The global positions of the tokens a rank of a (ring, Ulysses) mesh holds: its ring
    rank's chunks (laid out as :func:`positions` for ``ring`` ranks), each cut into
    ``ulysses`` equal parts, of which it holds part ``ulysses_rank``."""
    c = seq_len // num_chunks(ring, load_balance)
    part = c // ulysses
    return [
        i
        for ch in local_chunks(ring, ring_rank, load_balance)
        for i in range(ch * c + ulysses_rank * part, ch * c + (ulysses_rank + 1) * part)
    ]
