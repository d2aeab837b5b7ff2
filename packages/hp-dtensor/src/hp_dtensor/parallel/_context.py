"""Context parallelism: a sequence split over the ranks of a 1-D ``cp`` mesh, and attention
over the whole sequence computed from the pieces.

``context_parallel_shard`` / ``context_parallel_unshard`` cut a tensor along its sequence
dimension and put it back (see ``_cp_plan`` for the chunk layout; load balancing gives rank
``r`` chunks ``r`` and ``2 cp - 1 - r`` so that causal work is even).
``context_parallel_attention`` takes this rank's queries, keys and values in SDPA layout
``(batch, heads, seq_local, head_dim)`` and returns this rank's output:

- ``"ring"``: the keys and values travel around the ring, one rank's per step; each step
  attends this rank's queries to them as blocks of whole chunks (full or causal) with a fused
  attention kernel that also returns the log-sum-exp (CPU flash; cuDNN or flash on CUDA), and
  the partial outputs are merged by log-sum-exp in float32 (float64 for float64 inputs). The
  backward recomputes the blocks from the merged output and log-sum-exp, and the key/value
  gradients travel back with their blocks.
- ``"allgather"``: the keys and values are all-gathered once (their gradients reduce-scattered);
  then the same blocks.
- ``"ulysses"``: all-to-all from sequence-split to head-split, ordinary attention over the
  whole sequence for this rank's heads, and back. With fewer key/value heads than ranks, the
  key/value heads are replicated so each rank has the one its query heads use.
- ``"usp"``: on a 2-D (ring, Ulysses) mesh, Ulysses over the inner dimension (each rank gets
  its head group of its Ulysses group's ring piece), the ring over the outer one.

``overlap=True`` (``AsyncContextParallel``; ring only) posts the next step's key/value transfer
before this step's blocks, so they run together; in backward the key/value gradient
accumulators' transfer also runs during the next block's kernels (they need the accumulators
only to add into). ``ContextParallel`` / ``AsyncContextParallel`` apply
it to an attention module through ``parallelize_module``: inside the module's forward, calls
to ``torch.nn.functional.scaled_dot_product_attention`` become context-parallel.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from .._backend import get_platform
from .._checks import check_bool
from .._mesh import DeviceMesh
from ..errors import ContextParallelError, HPDTensorTypeError, MeshError
from . import _cp_plan as plan
from ._style import ParallelStyle

__all__ = [
    "METHODS",
    "AsyncContextParallel",
    "ContextParallel",
    "context_parallel_attention",
    "context_parallel_loss",
    "context_parallel_shard",
    "context_parallel_unshard",
]

#: the attention methods of ``context_parallel_attention``
METHODS = ("ring", "allgather", "ulysses", "usp")


# -- checks -------------------------------------------------------------------------------------
def _check_mesh(mesh: Any, fn: str, *, usp: bool = False) -> None:
    """A 1-D mesh; with ``usp`` a 2-D one with named dimensions (ring, Ulysses)."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{fn}: mesh must be a DeviceMesh (the cp one), got {type(mesh).__name__}")
    if usp:
        if mesh.ndim != 2 or not mesh.mesh_dim_names:
            raise MeshError(
                f"{fn}: method='usp' needs a 2-D mesh with named dimensions (ring, ulysses), "
                f"got a {mesh.ndim}-D one {mesh.mesh_dim_names}"
            )
    elif mesh.ndim != 1:
        raise MeshError(
            f"{fn}: context parallelism needs a 1-D mesh, got a {mesh.ndim}-D one "
            f"{mesh.mesh_dim_names}: pass mesh['cp'] (or method='usp' for a 2-D one)"
        )
    if getattr(mesh, "framework", "torch") != "torch":
        raise MeshError(f"{fn}: context parallelism runs on torch meshes only")


def _check_length(length: int, cp: int, load_balance: bool, what: str) -> None:
    n = plan.num_chunks(cp, load_balance)
    if length % n:
        how = f"2 x cp = {n} (load_balance=True)" if load_balance else f"cp = {n}"
        raise ContextParallelError(
            f"{what}: sequence length {length} is not divisible by {how}: pad the sequence to "
            f"a multiple of {n}"
        )


def _check_tensor(x, arg: str, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise HPDTensorTypeError(f"{fn}: {arg} is a {type(x).__name__}: pass a torch.Tensor")


def _seq_dim(seq_dim: int, x: torch.Tensor, fn: str) -> int:
    _check_tensor(x, "x_local" if "unshard" in fn else "x", fn)
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise HPDTensorTypeError(
            f"{fn}: seq_dim={seq_dim!r} must be an int (the tensor dimension of the sequence)"
        )
    if not -x.ndim <= seq_dim < x.ndim:
        raise ContextParallelError(
            f"{fn}: seq_dim={seq_dim} is out of range for a {x.ndim}-D tensor: give the "
            "sequence dimension"
        )
    return seq_dim % x.ndim


# -- shard / unshard ----------------------------------------------------------------------------
def _check_documents(documents, seq: int, cp: int, fn: str) -> tuple[int, ...]:
    docs = tuple(documents)
    if not docs or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in docs):
        raise ContextParallelError(
            f"{fn}: document_lengths={documents!r} must be positive ints (each document's "
            "token count, in sequence order)"
        )
    if sum(docs) != seq:
        raise ContextParallelError(
            f"{fn}: document_lengths sum to {sum(docs)}, but the sequence has {seq} tokens: "
            "give every document's length, padding included"
        )
    if seq % cp:
        raise ContextParallelError(
            f"{fn}: sequence length {seq} is not divisible by cp = {cp}: pad the sequence"
        )
    return docs


def _positions(cp: int, load_balance: bool, seq: int, documents) -> list[list[int]]:
    """Every rank's global positions, in its local order."""
    if documents is not None and load_balance:
        spans = plan.document_layout(list(documents), cp)
        return [[i for a, b in spans[r] for i in range(a, b)] for r in range(cp)]
    return [plan.positions(seq, cp, r, load_balance) for r in range(cp)]


def _usp_layout(mesh: DeviceMesh, seq: int, load_balance: bool, fn: str) -> list[list[int]]:
    """Every rank's positions on a (ring, Ulysses) mesh, in row-major rank order."""
    ring, uly = mesh.shape
    n = plan.num_chunks(ring, load_balance) * uly
    if seq % n:
        raise ContextParallelError(
            f"{fn}: sequence length {seq} is not divisible by {n} (the ring's "
            f"{plan.num_chunks(ring, load_balance)} chunks x {uly} Ulysses ranks): pad it"
        )
    return [
        plan.usp_positions(seq, ring, uly, r, u, load_balance)
        for r in range(ring)
        for u in range(uly)
    ]


def _usp_rank(mesh: DeviceMesh) -> int:
    ring, uly = _usp_meshes(mesh)
    return ring.get_local_rank() * uly.size() + uly.get_local_rank()


def context_parallel_shard(
    x: torch.Tensor,
    mesh: DeviceMesh,
    seq_dim: int,
    *,
    load_balance: bool = True,
    document_lengths=None,
) -> torch.Tensor:
    """This rank's part of ``x`` along ``seq_dim`` (a new tensor): chunk ``r`` of ``cp``, or
    with ``load_balance`` chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, concatenated. For a
    sequence packed from documents (``document_lengths``, in order), load balancing is per
    document (``_cp_plan.document_layout``: no length needs to divide by anything; every rank
    gets ``seq / cp`` tokens). On a 2-D (ring, Ulysses) mesh, the layout of
    ``method="usp"`` (``_cp_plan.usp_positions``). Differentiable."""
    fn = f"context_parallel_shard(seq_dim={seq_dim})"
    dim = _seq_dim(seq_dim, x, "context_parallel_shard")
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        _check_mesh(mesh, fn, usp=True)
        pos = _usp_layout(mesh, x.shape[dim], load_balance, fn)[_usp_rank(mesh)]
        return x.index_select(dim, torch.tensor(pos, device=x.device))
    _check_mesh(mesh, "context_parallel_shard")
    cp, rank = mesh.size(), mesh.get_local_rank()
    if document_lengths is not None and load_balance:
        docs = _check_documents(document_lengths, x.shape[dim], cp, fn)
        idx = torch.tensor(_positions(cp, True, x.shape[dim], docs)[rank], device=x.device)
        return x.index_select(dim, idx)
    _check_length(x.shape[dim], cp, load_balance, fn)
    c = x.shape[dim] // plan.num_chunks(cp, load_balance)
    parts = [x.narrow(dim, ch * c, c) for ch in plan.local_chunks(cp, rank, load_balance)]
    return torch.cat(parts, dim)


def _gather_seq(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, rank 0's first."""
    cp = mesh.size()
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((cp * xt.shape[0], *xt.shape[1:]))
    get_platform(mesh.device_type).all_gather_into(out, xt, mesh.get_group())
    return out.movedim(0, dim)


def _inverse(layout: list[int]) -> list[int]:
    """For the ranks' layout (the global position of each laid-out token), the laid-out index
    of each global position."""
    order = [0] * len(layout)
    for j, i in enumerate(layout):
        order[i] = j
    return order


def _to_natural(
    x: torch.Tensor, dim: int, cp: int, load_balance: bool, inverse=False, documents=None
):
    """Reorder ``x`` along ``dim`` between the ranks' layout (every rank's local tokens, rank
    0's first) and the global order (``inverse``: global -> layout)."""
    if documents is not None and load_balance:
        layout = [i for pos in _positions(cp, True, x.shape[dim], documents) for i in pos]
        order = layout if inverse else _inverse(layout)
        return x.index_select(dim, torch.tensor(order, device=x.device))
    n = plan.num_chunks(cp, load_balance)
    if n == cp:  # one chunk per rank: the layout is the global order
        return x
    order = plan.natural_order(cp, load_balance)
    if inverse:
        order = [order.index(i) for i in range(n)]
    shape = x.shape
    chunks = x.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])
    idx = torch.tensor(order, device=x.device)
    return chunks.index_select(dim, idx).reshape(shape)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, load_balance, documents):
        ctx.mesh, ctx.dim, ctx.lb, ctx.docs = mesh, dim, load_balance, documents
        if mesh.ndim == 2:  # the (ring, Ulysses) layout
            whole = _gather_seq(x, mesh.flatten(), dim)
            layout = [
                i for pos in _usp_layout(mesh, whole.shape[dim], load_balance, "") for i in pos
            ]
            order = _inverse(layout)
            return whole.index_select(dim, torch.tensor(order, device=x.device))
        whole = _gather_seq(x, mesh, dim)
        return _to_natural(whole, dim, mesh.size(), load_balance, documents=documents)

    @staticmethod
    def backward(ctx, g):
        part = context_parallel_shard(
            g, ctx.mesh, ctx.dim, load_balance=ctx.lb, document_lengths=ctx.docs
        )
        return part, None, None, None, None


def context_parallel_unshard(
    x_local: torch.Tensor,
    mesh: DeviceMesh,
    seq_dim: int,
    *,
    load_balance: bool = True,
    document_lengths=None,
) -> torch.Tensor:
    """The whole tensor from every rank's ``context_parallel_shard`` part (an all-gather; the
    same ``load_balance`` and ``document_lengths``). Differentiable: the result is a replicated
    value (the same on every rank), so the gradient reaching this rank's part is this rank's
    chunks of the incoming gradient."""
    dim = _seq_dim(seq_dim, x_local, "context_parallel_unshard")
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        _check_mesh(mesh, "context_parallel_unshard", usp=True)
        return _Unshard.apply(x_local, mesh, dim, load_balance, None)
    _check_mesh(mesh, "context_parallel_unshard")
    cp = mesh.size()
    docs = None
    if document_lengths is not None and load_balance:
        docs = _check_documents(
            document_lengths, x_local.shape[dim] * cp, cp, "context_parallel_unshard"
        )
    else:
        n = len(plan.local_chunks(cp, mesh.get_local_rank(), load_balance))
        if x_local.shape[dim] % n:
            raise ContextParallelError(
                f"context_parallel_unshard(seq_dim={seq_dim}): local length "
                f"{x_local.shape[dim]} is not divisible by the {n} chunks a rank holds "
                f"(load_balance={load_balance})"
            )
    return _Unshard.apply(x_local, mesh, dim, load_balance, docs)


# -- block kernels --------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _fused_kind(q: torch.Tensor, v: torch.Tensor) -> str:
    """Which fused kernel serves a block: the CPU flash kernel; on CUDA (sm80+) for half types
    cuDNN's attention (what SDPA picks on Hopper; head dims up to 128, multiples of 8) or else
    flash (up to 256), as far as ``torch.backends.cuda`` enables them; the math fallback for
    anything else (float32 on CUDA, value heads wider than query heads), which holds each
    block's scores whole in float32."""
    if v.shape[-1] > q.shape[-1]:
        return "math"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        d = q.shape[-1]
        if d % 8 or torch.cuda.get_device_capability(q.device) < (8, 0):
            return "math"
        if torch.backends.cuda.cudnn_sdp_enabled() and d <= 128:
            return "cudnn"
        if torch.backends.cuda.flash_sdp_enabled() and d <= 256:
            return "flash"
    return "math"


def _pad_v(v: torch.Tensor, d: int) -> torch.Tensor:
    """Value heads narrower than the query heads, zero-padded for the fused kernels."""
    return v if v.shape[-1] == d else F.pad(v, (0, d - v.shape[-1]))


def _block_fwd(q, k, v, causal: bool, scale: float, mask=None):
    """``(out, lse, aux)`` of one block: ``out`` in q's dtype, ``lse`` in the accumulation
    dtype (-inf, with a zero output, for rows ``mask`` hides everything from), ``aux`` what
    the backward of the kernel needs."""
    kind = "math" if mask is not None else _fused_kind(q, v)
    acc = _acc_dtype(q.dtype)
    dv = v.shape[-1]
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, _pad_v(v, q.shape[-1]), 0.0, causal, attn_mask=None, scale=scale
        )
        return out[..., :dv], lse.to(acc), None
    if kind == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, _pad_v(v, q.shape[-1]), None, True, 0.0, causal, False, scale=scale
        )
        lse = res[1].reshape(res[1].shape[:3])  # cuDNN's is (b, h, s, 1)
        return res[0][..., :dv], lse.to(acc), res[2:8]
    if kind == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, _pad_v(v, q.shape[-1]), 0.0, causal, False, scale=scale
        )
        return res[0][..., :dv], res[1].to(acc), res[2:8]
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: p = 0
    out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.to(acc))
    return out.to(q.dtype), lse, None


def _causal_mask(s: torch.Tensor) -> torch.Tensor:
    lq, lk = s.shape[-2:]
    return torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1)


def _block_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, aux, mask=None):
    """``(dq, dk, dv)`` of one block (in the kernel's dtype: the callers add them into float32
    accumulators), from the merged output and log-sum-exp of its queries (the standard
    recomputation)."""
    kind = "math" if mask is not None else _fused_kind(q, v)
    acc = _acc_dtype(q.dtype)
    d, dv_dim = q.shape[-1], v.shape[-1]
    if kind == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_v(dout, d),
            q,
            k,
            _pad_v(v, d),
            _pad_v(out, d),
            lse,
            0.0,
            causal,
            attn_mask=None,
            scale=scale,
        )
        return dq, dk, dv[..., :dv_dim]
    if kind in ("cudnn", "flash"):  # the CUDA kernels' backward takes dense slices
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        q, k = q.contiguous(), k.contiguous()
        dout, v, out = (_pad_v(t, d).contiguous() for t in (dout, v, out))
        if kind == "cudnn":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout,
                q,
                k,
                v,
                out,
                lse.float().unsqueeze(-1).contiguous(),
                seed,
                offset,
                None,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                scale=scale,
            )
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout,
                q,
                k,
                v,
                out,
                lse.float().contiguous(),
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                seed,
                offset,
                scale=scale,
            )
        return dq, dk, dv[..., :dv_dim]
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    s = torch.matmul(qa, ka.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    g = dout.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, va.transpose(-1, -2))
    delta = (g * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return torch.matmul(ds, ka) * scale, torch.matmul(ds.transpose(-1, -2), qa) * scale, dv


def _merge_rows(cur_o, cur_l, o, lb) -> None:
    """``(cur_o, cur_l) <- merge((cur_o, cur_l), (o, lb))`` in place: the outputs rescaled by
    their share of the combined softmax denominator."""
    new = torch.logaddexp(cur_l, lb)
    cur_o.mul_(torch.exp(cur_l - new).unsqueeze(-1))
    cur_o.addcmul_(o, torch.exp(lb - new).unsqueeze(-1))
    cur_l.copy_(new)


def _merge_rows_into(cur_o, cur_l, o, lb, dst) -> None:
    """:func:`_merge_rows` for the rows' last block: the merged output written to ``dst`` (in
    its own dtype, a different tensor from ``cur_o``) instead of back into ``cur_o``."""
    new = torch.logaddexp(cur_l, lb)
    dst.copy_(cur_o * torch.exp(cur_l - new).unsqueeze(-1) + o * torch.exp(lb - new).unsqueeze(-1))
    cur_l.copy_(new)


_COMPILE_MERGE_ON = ("cuda",)  # device types whose merge is compiled (tests add "cpu")


@functools.cache
def _compiled(fn):
    """``fn`` (one of the merges above) through ``torch.compile``: a pure function, so the
    cache holds no model's or mesh's state; dynamo's recompile limit for it is shared by the
    process."""
    return torch.compile(fn, dynamic=None)


def _compiled_merge():
    """The compiled :func:`_merge_rows`."""
    return _compiled(_merge_rows)


def _merge_fn(t: torch.Tensor, fn=_merge_rows):
    """``fn`` (:func:`_merge_rows` or :func:`_merge_rows_into`) for ``t``'s rows: on CUDA
    compiled (fused kernels, the output rows and the log-sum-exp rows; eager it is seven small
    ones per block, which at 4-8k-token blocks cost as much as the attention: RESULTS.md);
    eager elsewhere and for fake tensors (a dry run under ``FakeTensorMode``: compiled code
    would read their empty storage)."""
    if t.device.type not in _COMPILE_MERGE_ON or is_fake(t):
        return fn
    return _compiled(fn)


class _RowFold:
    """A local tensor's rows accumulated over the blocks that reach them, in the accumulation
    dtype: summed (gradients), or with ``merge`` merged by log-sum-exp (the forward's output,
    whose running ``lse`` this holds). The rows come in whole chunks of ``chunk`` rows.

    With ``counts`` (how many blocks reach each chunk, known from the plan) a chunk's first
    block is copied in (no zero fill beforehand) and, for 16-bit inputs, its last is folded
    straight into the result in the input dtype (no separate conversion pass afterwards): at
    2-4k-token blocks these elementwise passes were much of the blockwise path's cost beyond
    the kernels (RESULTS.md). The two buffers are made when first needed. Without ``counts``
    (document masks, where a block may reach no row) the accumulator starts at zero (and
    ``lse`` at -inf) and :meth:`result` converts it."""

    def __init__(self, shape, dtype, device, chunk: int, counts, merge: bool = False) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.acc_dtype = _acc_dtype(dtype)
        self.chunk, self.counts = chunk, counts
        self.seen = [0] * (self.shape[2] // chunk)
        self.split = counts is not None and self.acc_dtype != dtype  # the last fold converts
        self._acc = self._out = None
        if counts is None:
            self._acc = torch.zeros(self.shape, dtype=self.acc_dtype, device=device)
        self.lse = None
        if merge:
            self.lse = (
                torch.empty(self.shape[:3], dtype=self.acc_dtype, device=device)
                if counts is not None
                else torch.full(self.shape[:3], float("-inf"), dtype=self.acc_dtype, device=device)
            )

    def _buffer(self, final: bool) -> torch.Tensor:
        """The accumulator, or with ``final`` (and :attr:`split`) the result, made on first use."""
        if final and self.split:
            if self._out is None:
                self._out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            return self._out
        if self._acc is None:
            self._acc = torch.empty(self.shape, dtype=self.acc_dtype, device=self.device)
        return self._acc

    def add(self, lo: int, hi: int, g: torch.Tensor, lb: torch.Tensor | None = None) -> None:
        """Fold one block's rows ``lo:hi`` (``g``, and with ``merge`` its log-sum-exp ``lb``)."""
        c = self.chunk
        runs: list[list] = []  # [first chunk, end chunk, (first, last)]
        for ch in range(lo // c, hi // c):
            n = self.seen[ch]
            if self.counts is not None and n >= self.counts[ch]:
                raise RuntimeError(
                    f"context parallelism: local chunk {ch} reached by more blocks than the "
                    f"plan's {self.counts[ch]}"
                )
            state = (n == 0, self.split and n + 1 == self.counts[ch])
            self.seen[ch] = n + 1
            if runs and runs[-1][2] == state:
                runs[-1][1] = ch + 1
            else:
                runs.append([ch, ch + 1, state])
        for a, b, (first, last) in runs:
            rows, part = slice(a * c, b * c), slice(a * c - lo, b * c - lo)
            self._fold(rows, g[:, :, part], None if lb is None else lb[:, :, part], first, last)

    def _fold(self, rows: slice, g, lb, first: bool, last: bool) -> None:
        # last (16-bit inputs): straight into the result, from the accumulator unless first
        dst = self._buffer(last)[:, :, rows]
        if first:
            dst.copy_(g)
            if lb is not None:
                self.lse[:, :, rows].copy_(lb)
            return
        acc = self._buffer(False)[:, :, rows]
        if lb is None:  # a sum
            if last:
                torch.add(acc, g, out=dst)
            else:
                acc.add_(g)
        elif last:
            _merge_fn(acc, _merge_rows_into)(acc, self.lse[:, :, rows], g, lb, dst)
        else:
            _merge_fn(acc)(acc, self.lse[:, :, rows], g, lb)

    def result(self) -> torch.Tensor:
        """The accumulated tensor in the input dtype (every block folded in)."""
        if self.counts is None:
            return self._acc.to(self.dtype)
        if self.seen != self.counts:
            raise RuntimeError(
                f"context parallelism: local chunks reached by {self.seen} blocks, the plan "
                f"says {self.counts}"
            )
        return self._out if self.split else self._acc


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of expanded key/value heads summed back per group (in float32 at least)."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2, dtype=_acc_dtype(t.dtype))


# -- communication ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Config:
    mesh: DeviceMesh
    cp: int
    rank: int
    load_balance: bool
    causal: bool
    scale: float
    groups: int  # query heads per key/value head
    method: str
    overlap: bool
    documents: tuple[int, ...] | None = None  # packed documents' lengths (document masks)
    device: Any = None


class _Shift:
    """Tensors of one dtype sent to the next rank of the ring and received from the previous
    one, as one all-to-all with a single non-empty split each way."""

    def __init__(self, tensors: list[torch.Tensor], cfg: _Config) -> None:
        self.shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.buf = torch.empty_like(flat)
        n, cp, r = flat.numel(), cfg.cp, cfg.rank
        send = [0] * cp
        recv = [0] * cp
        send[(r + 1) % cp] = n
        recv[(r - 1) % cp] = n
        self.work = get_platform(cfg.mesh.device_type).all_to_all(
            self.buf, flat, recv, send, cfg.mesh.get_group(), async_op=True
        )
        self._keep = flat

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None  # waited once: a second wait returns the same tensors
        self._keep = None
        sizes = [math.prod(s) for s in self.shapes]
        return [p.view(s) for p, s in zip(self.buf.split(sizes), self.shapes)]


def _ring_blocks(k, v, cfg: _Config):
    """Yield ``(src, k_block, v_block)`` for every rank's keys and values, this rank's first,
    then around the ring; with ``overlap`` the next transfer is in flight meanwhile."""
    cur = [k, v]
    for i in range(cfg.cp):
        src = (cfg.rank - i) % cfg.cp
        last = i == cfg.cp - 1
        pending = _Shift(cur, cfg) if cfg.overlap and not last else None
        yield src, cur[0], cur[1]
        if not last:
            cur = (pending or _Shift(cur, cfg)).wait()


def _gathered_blocks(k, v, cfg: _Config):
    """Yield ``(src, k_block, v_block)`` for every rank, from one all-gather of each."""
    ks = _stack_gather(k, cfg)
    vs = _stack_gather(v, cfg)
    for i in range(cfg.cp):
        src = (cfg.rank - i) % cfg.cp
        yield src, ks[src], vs[src]


def _stack_gather(t: torch.Tensor, cfg: _Config) -> torch.Tensor:
    out = t.new_empty((cfg.cp, *t.shape))
    get_platform(cfg.mesh.device_type).all_gather_into(
        out.view(cfg.cp * t.shape[0], *t.shape[1:]), t.contiguous(), cfg.mesh.get_group()
    )
    return out


# -- ring / all-gather attention -------------------------------------------------------------------
def _calls(cfg: _Config, src: int, lq: int, lk: int):
    """``((q_lo, q_hi), (k_lo, k_hi), is_causal, mask)`` for this rank's queries against rank
    ``src``'s keys: blocks of whole chunks, or with documents one masked block (None when
    nothing is visible)."""
    if cfg.documents is not None:
        mask = _document_mask(cfg, cfg.rank, src, lq)
        if mask is not None:
            yield (0, lq), (0, lk), False, mask
        return
    nq = len(plan.local_chunks(cfg.cp, cfg.rank, cfg.load_balance))
    cq, ck = lq // nq, lk // nq
    for (qlo, qhi), (klo, khi), causal in plan.block_calls(
        cfg.cp, cfg.rank, src, cfg.causal, cfg.load_balance
    ):
        yield (qlo * cq, qhi * cq), (klo * ck, khi * ck), causal, None


def _document_mask(cfg: _Config, rank: int, src: int, lq: int) -> torch.Tensor | None:
    """Which of rank ``src``'s keys each of rank ``rank``'s queries sees (the same document,
    and not later when causal); None when none."""
    positions = _positions(cfg.cp, cfg.load_balance, lq * cfg.cp, cfg.documents)
    doc = [d for d, n in enumerate(cfg.documents) for _ in range(n)]
    pq = torch.tensor(positions[rank], device=cfg.device)
    pk = torch.tensor(positions[src], device=cfg.device)
    dq = torch.tensor([doc[i] for i in positions[rank]], device=cfg.device)
    dk = torch.tensor([doc[i] for i in positions[src]], device=cfg.device)
    # whether anything is visible, from the positions (not from the mask: a dry run's fake
    # tensors hold no values): some document with a key no later than one of its queries
    last_q: dict[int, int] = {}
    for i in positions[rank]:
        last_q[doc[i]] = max(last_q.get(doc[i], i), i)
    if not any(
        doc[j] in last_q and (not cfg.causal or j <= last_q[doc[j]]) for j in positions[src]
    ):
        return None
    mask = dq[:, None] == dk[None, :]
    if cfg.causal:
        mask &= pk[None, :] <= pq[:, None]
    return mask


def _chunk_counts(cfg: _Config) -> list[int] | None:
    """How many blocks reach each of this rank's local query chunks (from the plan: each
    rank's keys once), or None with document masks (known only from the masks)."""
    if cfg.documents is not None:
        return None
    counts = [0] * len(plan.local_chunks(cfg.cp, cfg.rank, cfg.load_balance))
    for src in range(cfg.cp):
        for (qlo, qhi), _, _ in plan.block_calls(
            cfg.cp, cfg.rank, src, cfg.causal, cfg.load_balance
        ):
            for c in range(qlo, qhi):
                counts[c] += 1
    return counts if all(counts) else None


def _query_chunk(cfg: _Config, lq: int) -> int:
    """Rows per local query chunk (the whole local sequence with document masks)."""
    if cfg.documents is not None:
        return lq
    return lq // len(plan.local_chunks(cfg.cp, cfg.rank, cfg.load_balance))


def _forward(q, k, v, cfg: _Config, blocks=None):
    """This rank's ``(out, lse, aux)`` over ``blocks`` (``(src, k_block, v_block)`` of every
    rank; by default moved by ``cfg.method``)."""
    b, h, lq, _ = q.shape
    fold = _RowFold(
        (b, h, lq, v.shape[-1]),
        q.dtype,
        q.device,
        _query_chunk(cfg, lq),
        _chunk_counts(cfg),
        merge=True,
    )
    aux = {}
    if blocks is None:
        blocks = _ring_blocks(k, v, cfg) if cfg.method == "ring" else _gathered_blocks(k, v, cfg)
    for src, kb, vb in blocks:
        calls = _calls(cfg, src, lq, kb.shape[2])
        for i, ((qlo, qhi), (klo, khi), causal, mask) in enumerate(calls):
            o, lb, aux[(src, i)] = _block_fwd(
                q[:, :, qlo:qhi],
                _expand(kb[:, :, klo:khi], cfg.groups),
                _expand(vb[:, :, klo:khi], cfg.groups),
                causal,
                cfg.scale,
                mask,
            )
            fold.add(qlo, qhi, o, lb)
    return fold.result(), fold.lse, aux


def _query_rows(rows: dict | None, dout, q, out, lse, qlo: int, qhi: int) -> tuple:
    """Query rows ``qlo:qhi`` of ``dout``, ``q``, ``out`` and ``lse`` as dense tensors (the
    fused kernels' backward takes dense ones), made once per backward in ``rows``: each query
    chunk meets every rank's keys, and a copy per block was a quarter of the kernels. One
    ``rows`` dict belongs to one ``(dout, q, out, lse)``: the key says nothing else."""
    hit = None if rows is None else rows.get((qlo, qhi))
    if hit is None:
        hit = tuple(t[:, :, qlo:qhi].contiguous() for t in (dout, q, out, lse))
        if rows is not None:
            rows[(qlo, qhi)] = hit
    return hit


class _RankGrads:
    """One rank's part of the blockwise backward: its queries' gradient, summed over every
    rank's key/value block (:meth:`block`), and the blocks' key/value gradients handed back
    per block for the caller to move (:meth:`ring_fold` folds them into the ring's travelling
    accumulators). Made once per backward: it also keeps the dense query rows
    (:func:`_query_rows`)."""

    def __init__(self, dout, q, out, lse, aux, cfg: _Config) -> None:
        self.dout, self.q, self.out, self.lse, self.aux, self.cfg = dout, q, out, lse, aux, cfg
        self.rows: dict = {}
        self.dq = _RowFold(
            q.shape, q.dtype, q.device, _query_chunk(cfg, q.shape[2]), _chunk_counts(cfg)
        )

    def block(self, src: int, kb, vb) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Fold the gradient of this rank's queries against rank ``src``'s keys and values
        (``kb``, ``vb``) into the query gradient; return the block's key/value gradient
        contributions, ``(k_lo, k_hi, dk, dv)`` of rows ``k_lo:k_hi`` (float32 at least for
        grouped heads, else the kernel's dtype)."""
        cfg = self.cfg
        contributions = []
        calls = _calls(cfg, src, self.q.shape[2], kb.shape[2])
        for i, ((qlo, qhi), (klo, khi), causal, mask) in enumerate(calls):
            g_rows, q_rows, o_rows, l_rows = _query_rows(
                self.rows, self.dout, self.q, self.out, self.lse, qlo, qhi
            )
            gq, gk, gv = _block_bwd(
                g_rows,
                q_rows,
                _expand(kb[:, :, klo:khi], cfg.groups),
                _expand(vb[:, :, klo:khi], cfg.groups),
                o_rows,
                l_rows,
                causal,
                cfg.scale,
                self.aux[(src, i)],
                mask,
            )
            self.dq.add(qlo, qhi, gq)
            contributions.append(
                (klo, khi, _reduce_groups(gk, cfg.groups), _reduce_groups(gv, cfg.groups))
            )
        return contributions

    def ring_block(self, i: int, kb, vb) -> list:
        """Ring step ``i``'s kernels (rank ``src = rank - i``'s block ``kb``, ``vb``): the
        query gradient folded in, the block's key/value contributions returned for
        :meth:`ring_fold` (they need no accumulator yet: with ``overlap`` the accumulators'
        transfer is still in flight meanwhile)."""
        return self.block((self.cfg.rank - i) % self.cfg.cp, kb, vb)

    def ring_fold(self, i: int, parts: list, kb, vb, dkb, dvb):
        """Step ``i``'s contributions ``parts`` folded into the block's travelling gradient
        accumulators ``dkb``, ``dvb`` (None at step 0, where they start); returns them, at the
        last step (complete, on their way home) in the keys' and values' dtype: the rounding is
        the same before the last transfer as after it, and for 16-bit inputs that transfer
        carries half the bytes."""
        last = i == self.cfg.cp - 1
        dkb = _fold_block(dkb, kb, [(lo, hi, gk) for lo, hi, gk, _ in parts], last)
        dvb = _fold_block(dvb, vb, [(lo, hi, gv) for lo, hi, _, gv in parts], last)
        return dkb, dvb

    def dq_result(self) -> torch.Tensor:
        """The query gradient in the queries' dtype (once every block has been through)."""
        return self.dq.result()


def _fold_block(acc, like: torch.Tensor, parts, last: bool) -> torch.Tensor:
    """A travelling key/value gradient accumulator (shaped as ``like``; None before its first
    step) plus this rank's contributions ``(lo, hi, g)`` of rows ``lo:hi``: a first
    contribution covering every row is taken as the accumulator (no zero fill); at the ``last``
    step the result is in ``like``'s dtype, a single contribution added straight into it. The
    contributions are the kernels' fresh outputs (or views of them, for padded values): the
    first one may become the accumulator, added into in place at later steps."""
    dtype, acc_dtype = like.dtype, _acc_dtype(like.dtype)
    whole = len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == like.shape[2]
    if acc is None:
        if whole:
            g = parts[0][2]
            return g.to(dtype) if last else g.to(acc_dtype)
        acc = torch.zeros(like.shape, dtype=acc_dtype, device=like.device)
    if last and len(parts) == 1 and acc_dtype != dtype:
        lo, hi, g = parts[0]
        res = torch.empty(like.shape, dtype=dtype, device=like.device)
        torch.add(acc[:, :, lo:hi], g, out=res[:, :, lo:hi])
        res[:, :, :lo].copy_(acc[:, :, :lo])
        res[:, :, hi:].copy_(acc[:, :, hi:])
        return res
    for lo, hi, g in parts:
        acc[:, :, lo:hi] += g
    return acc.to(dtype) if last else acc


def _backward(dout, q, k, v, out, lse, aux, cfg: _Config):
    grads = _RankGrads(dout, q, out, lse, aux, cfg)
    if cfg.method == "allgather":
        acc = _acc_dtype(q.dtype)
        ks, vs = _stack_gather(k, cfg), _stack_gather(v, cfg)
        dks = torch.zeros(ks.shape, dtype=acc, device=k.device)
        dvs = torch.zeros(vs.shape, dtype=acc, device=v.device)
        for src in range(cfg.cp):
            for lo, hi, gk, gv in grads.block(src, ks[src], vs[src]):
                dks[src][:, :, lo:hi] += gk
                dvs[src][:, :, lo:hi] += gv
        platform, group = get_platform(cfg.mesh.device_type), cfg.mesh.get_group()
        dk = torch.empty(k.shape, dtype=acc, device=k.device)
        dv = torch.empty(v.shape, dtype=acc, device=v.device)
        platform.reduce_scatter_into(dk, dks.view(-1, *k.shape[1:]), "sum", group)
        platform.reduce_scatter_into(dv, dvs.view(-1, *v.shape[1:]), "sum", group)
        return grads.dq_result(), dk.to(k.dtype), dv.to(v.dtype)
    # ring: each block's gradient accumulators travel with it and come home after cp shifts;
    # with overlap, the next block's keys/values and this block's accumulators are in flight
    # while the next block's kernels run (they need the accumulators only to fold into)
    kb, vb, acc = k, v, None
    for i in range(cfg.cp):
        last = i == cfg.cp - 1
        kv_next = _Shift([kb, vb], cfg) if cfg.overlap and not last else None
        parts = grads.ring_block(i, kb, vb)
        held = (None, None) if acc is None else acc.wait()
        acc = _Shift(list(grads.ring_fold(i, parts, kb, vb, *held)), cfg)
        del parts, held  # sent (copied): not kept alive through the next block's kernels
        if not cfg.overlap:
            acc.wait()
        if not last:
            kb, vb = (kv_next or _Shift([kb, vb], cfg)).wait()
    dkb, dvb = acc.wait()
    return grads.dq_result(), dkb, dvb


def _ring_in_one_process(pieces, cfgs: list[_Config]):
    """The ring's forward and backward for every rank in one process, with no transfers: the
    blockwise kernel path alone (``benchmarks/cp/attention.py`` times it; tests check it).
    ``pieces[r]`` is rank ``r``'s ``(q, k, v, dout)``, ``cfgs[r]`` its config. The forwards
    run one rank after another; the backward's steps in lockstep, each rank's step ``i`` and
    then the key/value gradient accumulators handed to the next rank, as the ring's shifts
    would. Returns every rank's ``(out, dq, dk, dv)``."""
    cp = len(pieces)
    grads, outs = [], []
    for r, cfg in enumerate(cfgs):
        q, _, v, dout = pieces[r]
        order = [(r - j) % cp for j in range(cp)]  # the ring's: this rank's own block first
        blocks = [(src, pieces[src][1], pieces[src][2]) for src in order]
        out, lse, aux = _forward(q, None, v, cfg, blocks=blocks)
        grads.append(_RankGrads(dout, q, out, lse, aux, cfg))
        outs.append(out)
    held = [(None, None)] * cp  # the accumulators at each rank, of block (rank - i)
    for i in range(cp):
        sent = []
        for r in range(cp):
            kb, vb = pieces[(r - i) % cp][1], pieces[(r - i) % cp][2]
            sent.append(grads[r].ring_fold(i, grads[r].ring_block(i, kb, vb), kb, vb, *held[r]))
        held = [sent[(r - 1) % cp] for r in range(cp)]
    return [(outs[r], grads[r].dq_result(), *held[r]) for r in range(cp)]


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse, aux = _forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.aux = cfg, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.aux, ctx.cfg)
        return dq, dk, dv, None


# -- Ulysses --------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """``x`` ``(cp, ...)``: piece ``j`` goes to rank ``j``; the result's piece ``j`` came from
    rank ``j``. Its own adjoint."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _all_to_all(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.mesh), None


def _all_to_all(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    splits = [x[0].numel()] * mesh.size()
    get_platform(mesh.device_type).all_to_all(
        out.view(-1), x.view(-1), splits, splits, mesh.get_group()
    )
    return out


def _heads_from_all(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``(b, h, s_local, d)`` -> ``(b, h / n, n s_local, d)``: this rank's head group, every
    rank's tokens (rank 0's first)."""
    b, h, s, d = x.shape
    n = mesh.size()
    y = _AllToAll.apply(x.view(b, n, h // n, s, d).movedim(1, 0), mesh)
    return y.movedim(0, 2).reshape(b, h // n, n * s, d)


def _tokens_from_all(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The inverse of :func:`_heads_from_all`."""
    b, hl, s, d = y.shape
    n = mesh.size()
    x = _AllToAll.apply(y.view(b, hl, n, s // n, d).movedim(2, 0), mesh)
    return x.movedim(0, 1).reshape(b, hl * n, s // n, d)


def _seq_to_heads(x: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """``(b, h, s_local, d)`` -> ``(b, h / cp, s, d)``, the sequence in global order."""
    y = _heads_from_all(x, cfg.mesh)
    return _to_natural(y, 2, cfg.cp, cfg.load_balance, documents=cfg.documents)


def _heads_to_seq(y: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    y = _to_natural(y, 2, cfg.cp, cfg.load_balance, inverse=True, documents=cfg.documents)
    return _tokens_from_all(y, cfg.mesh)


def _usp_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    names = mesh.mesh_dim_names
    return mesh[names[0]], mesh[names[1]]


def _usp(q, k, v, mesh: DeviceMesh, *, is_causal, load_balance, scale, overlap):
    """Ulysses over the mesh's second (inner) dimension, the ring over its first: the
    all-to-all gives each rank its head group of the ring piece its Ulysses group holds (in
    order), then those pieces go round the ring."""
    ring, uly = _usp_meshes(mesh)
    u, hkv = uly.size(), k.shape[1]
    nch = len(plan.local_chunks(ring.size(), ring.get_local_rank(), load_balance))
    if hkv % u:  # fewer key/value heads than Ulysses ranks: replicate them
        k, v = k.repeat_interleave(u // hkv, dim=1), v.repeat_interleave(u // hkv, dim=1)

    def to_piece(t):  # (source, chunk) -> (chunk, source): the ring piece in global order
        b, h, s, d = t.shape
        return t.view(b, h, u, nch, s // (u * nch), d).transpose(2, 3).reshape(b, h, s, d)

    def from_piece(t):
        b, h, s, d = t.shape
        return t.view(b, h, nch, u, s // (u * nch), d).transpose(2, 3).reshape(b, h, s, d)

    qh, kh, vh = (to_piece(_heads_from_all(t, uly)) for t in (q, k, v))
    o = context_parallel_attention(
        qh,
        kh,
        vh,
        ring,
        is_causal=is_causal,
        method="ring",
        load_balance=load_balance,
        scale=scale,
        enable_gqa=kh.shape[1] != qh.shape[1],
        overlap=overlap,
    )
    return _tokens_from_all(from_piece(o), uly)


def _ulysses(q, k, v, cfg: _Config):
    n, hkv = cfg.cp, k.shape[1]
    if hkv % n:  # fewer key/value heads than ranks: each rank gets its query heads' one
        k, v = k.repeat_interleave(n // hkv, dim=1), v.repeat_interleave(n // hkv, dim=1)
    qh, kh, vh = (_seq_to_heads(t, cfg) for t in (q, k, v))
    mask = None
    if cfg.documents is not None:  # the whole sequence in order: a block-diagonal mask
        doc = torch.repeat_interleave(
            torch.arange(len(cfg.documents), device=q.device),
            torch.tensor(cfg.documents, device=q.device),
        )
        mask = doc[:, None] == doc[None, :]
        if cfg.causal:
            mask &= torch.ones_like(mask).tril()
    o = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=mask,
        is_causal=cfg.causal and mask is None,
        scale=cfg.scale,
        enable_gqa=kh.shape[1] != qh.shape[1],
    )
    return _heads_to_seq(o, cfg)


# -- the entry point ------------------------------------------------------------------------------
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    *,
    is_causal: bool = True,
    method: str = "ring",
    load_balance: bool = True,
    scale: float | None = None,
    enable_gqa: bool = False,
    overlap: bool = False,
    document_lengths=None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose pieces the ranks of the
    1-D ``mesh`` hold as ``context_parallel_shard(..., load_balance=load_balance)`` gave them.
    ``document_lengths``: the sequence is packed from documents of these lengths (the same for
    the whole batch) and each token attends only within its own (causally unless
    ``is_causal=False``); the pieces must come from ``context_parallel_shard`` with the same
    lengths (per-document load balancing). Masked blocks run on the math kernel.

    ``q`` ``(batch, heads, seq_local, head_dim)``, ``k``/``v`` ``(batch, kv_heads, seq_local,
    head_dim)`` (``v`` may have its own head dim); ``enable_gqa`` as in
    ``scaled_dot_product_attention``. Returns this rank's output, differentiable. ``method``:
    ``"ring"``, ``"allgather"`` or ``"ulysses"`` (see the module docstring); ``overlap``:
    the next key/value transfer of the ring runs while this step's blocks compute. DTensor
    inputs (heads split by tensor parallelism) run on their local pieces and return a DTensor
    of the same layout. Every check happens before any communication.
    """
    from .._dtensor import DTensor

    def again(q, k, v):  # this call on other q, k, v (local pieces, or autocast's dtype)
        return context_parallel_attention(
            q,
            k,
            v,
            mesh,
            is_causal=is_causal,
            method=method,
            load_balance=load_balance,
            scale=scale,
            enable_gqa=enable_gqa,
            overlap=overlap,
            document_lengths=document_lengths,
        )

    if any(isinstance(t, DTensor) for t in (q, k, v)):  # tensor-parallel heads: local pieces
        from .._placement import Replicate, Shard

        ok = all(isinstance(t, DTensor) for t in (q, k, v)) and (
            q.placements == k.placements == v.placements
        )
        ok = ok and all(p == Shard(1) or isinstance(p, Replicate) for p in q.placements)
        if not ok:
            raise ContextParallelError(
                "context_parallel_attention: DTensor inputs must be q, k and v alike, split by "
                "heads (Shard(1)) or replicated on every mesh dimension; got "
                + ", ".join(
                    str(t.placements) if isinstance(t, DTensor) else "a plain tensor"
                    for t in (q, k, v)
                )
            )
        out = again(q.to_local(), k.to_local(), v.to_local())
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
    fn = "context_parallel_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name, fn)
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        # as scaled_dot_product_attention under autocast: in autocast's dtype, whatever q, k
        # and v come in; inside, autocast off (the merge and the math kernel keep float32)
        dtype = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return again(*(t.to(dtype) for t in (q, k, v)))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ContextParallelError(
            f"{fn}: q ({q.dtype}), k ({k.dtype}) and v ({v.dtype}) must share a dtype, as "
            "scaled_dot_product_attention requires outside autocast: cast them to one"
        )
    if method == "usp":
        return _usp_entry(
            q, k, v, mesh, is_causal, load_balance, scale, enable_gqa, overlap, document_lengths
        )
    _check_mesh(mesh, fn)
    if overlap and method != "ring":
        raise ContextParallelError(
            f"{fn}: overlap=True overlaps the ring's transfers; method={method!r} has none to "
            "overlap: use method='ring' or overlap=False"
        )
    if method not in METHODS:
        raise ContextParallelError(f"{fn}: method={method!r} is not one of {METHODS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ContextParallelError(
                f"{fn}: {name} must be (batch, heads, seq_local, head_dim), got shape "
                f"{tuple(t.shape)}"
            )
    cp, rank = mesh.size(), mesh.get_local_rank()
    b, h, s, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[2] != s or v.shape[2] != s:
        raise ContextParallelError(
            f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share "
            "the batch and the local sequence length"
        )
    if k.shape[3] != d or v.shape[1] != k.shape[1]:
        raise ContextParallelError(
            f"{fn}: k must have q's head dim {d} and v k's head count {k.shape[1]}"
        )
    hkv = k.shape[1]
    if hkv != h and not (enable_gqa and h % hkv == 0):
        raise ContextParallelError(
            f"{fn}: {h} query heads and {hkv} key/value heads need enable_gqa=True and a "
            "query head count divisible by the key/value one"
        )
    docs = None
    if document_lengths is not None:
        docs = _check_documents(document_lengths, s * cp, cp, fn)
        if not load_balance:
            _check_length(s * cp, cp, load_balance, fn)
    else:
        _check_length(s * cp, cp, load_balance, fn)
    if method == "ulysses":
        if h % cp:
            raise ContextParallelError(
                f"{fn}: method='ulysses' splits the {h} query heads over cp = {cp} ranks: use a "
                "head count divisible by cp, or method='ring'"
            )
        if hkv % cp and cp % hkv:
            raise ContextParallelError(
                f"{fn}: method='ulysses' needs the {hkv} key/value heads to divide by cp = {cp} "
                "or cp to divide by them (then they are replicated): use method='ring'"
            )
    # the fused kernels read the last dim densely (SDPA copies such inputs too)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cfg = _Config(
        mesh=mesh,
        cp=cp,
        rank=rank,
        load_balance=load_balance,
        causal=bool(is_causal),
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(d),
        groups=h // hkv,
        method=method,
        overlap=bool(overlap),
        documents=docs,
        device=q.device,
    )
    with _inside():  # SDPA calls made here are local ones, whatever modes are active
        if cp == 1 and docs is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, scale=cfg.scale, enable_gqa=hkv != h
            )
        if method == "ulysses":
            return _ulysses(q, k, v, cfg)
        return _BlockAttention.apply(q, k, v, cfg)


def _usp_entry(q, k, v, mesh, is_causal, load_balance, scale, enable_gqa, overlap, documents):
    fn = "context_parallel_attention(method='usp')"
    _check_mesh(mesh, fn, usp=True)
    if documents is not None:
        raise ContextParallelError(f"{fn}: document_lengths are not supported: use method='ring'")
    ring, uly = _usp_meshes(mesh)
    u = uly.size()
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h and not enable_gqa:
        raise ContextParallelError(f"{fn}: {h} query and {hkv} key/value heads need enable_gqa")
    if h % u:
        raise ContextParallelError(
            f"{fn}: the {h} query heads do not split over the {u} Ulysses ranks (the mesh's "
            "second dimension): use a head count divisible by it"
        )
    if hkv % u and u % hkv:
        raise ContextParallelError(
            f"{fn}: the {hkv} key/value heads must divide by the {u} Ulysses ranks, or they "
            "by them (replicated)"
        )
    _usp_layout(mesh, q.shape[2] * mesh.size(), load_balance, fn)  # the length check
    with _inside():
        return _usp(
            q,
            k,
            v,
            mesh,
            is_causal=is_causal,
            load_balance=load_balance,
            scale=scale,
            overlap=overlap,
        )


_STATE = threading.local()  # per thread: inside context_parallel_attention (no model state)


@contextlib.contextmanager
def _inside():
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


# -- losses ---------------------------------------------------------------------------------------
def context_parallel_loss(loss_sum: torch.Tensor, count, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence's mean token loss, as this rank's share, when the ranks of ``mesh``
    hold parts of the same sequences and count different numbers of tokens (ignored labels,
    padding): ``loss_sum`` (this rank's summed token losses) x ``cp`` / the tokens counted
    over all ranks (``count`` summed over ``mesh``; no gradient). The mean of the ranks'
    values is the mean over every counted token, and averaging the gradients over the ranks
    (as data-parallel training, FSDP over ``dp_shard x cp``, does) gives its gradient. A
    collective over ``mesh``."""
    _check_mesh(mesh, "context_parallel_loss")
    _check_tensor(loss_sum, "loss_sum", "context_parallel_loss")
    if isinstance(count, bool) or not isinstance(count, (int, float, torch.Tensor)):
        raise HPDTensorTypeError(
            f"context_parallel_loss: count={count!r} is a {type(count).__name__}: give the "
            "number of tokens this rank counted (an int or a tensor)"
        )
    total = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).reshape(1).clone()
    get_platform(mesh.device_type).all_reduce(total, "sum", mesh.get_group())
    if total.item() == 0:
        return loss_sum * 0.0
    return loss_sum * (mesh.size() / total.to(loss_sum.dtype))


# -- styles ---------------------------------------------------------------------------------------
# the C function itself: F.scaled_dot_product_attention may be rebound by other code
_SDPA = torch._C._nn.scaled_dot_product_attention


class _SDPAToContextParallel(TorchFunctionMode):
    """Inside an attention module's forward: ``scaled_dot_product_attention`` calls become
    ``context_parallel_attention`` over ``mesh``."""

    def __init__(self, mesh: DeviceMesh, style: ContextParallel) -> None:
        super().__init__()
        self.mesh, self.style = mesh, style

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA or getattr(_STATE, "depth", 0):
            return func(*args, **kwargs)
        names = (
            "query",
            "key",
            "value",
            "attn_mask",
            "dropout_p",
            "is_causal",
            "scale",
            "enable_gqa",
        )
        a = dict(zip(names, args))
        a.update(kwargs)
        if a.get("attn_mask") is not None:
            raise ContextParallelError(
                f"{type(self.style).__name__}: scaled_dot_product_attention(attn_mask=...) is "
                "not supported under context parallelism: use is_causal=True"
            )
        if a.get("dropout_p", 0.0):
            raise ContextParallelError(
                f"{type(self.style).__name__}: attention dropout is not supported under "
                "context parallelism: set dropout_p=0"
            )
        return context_parallel_attention(
            a["query"],
            a["key"],
            a["value"],
            self.mesh,
            is_causal=a.get("is_causal", False),
            method=self.style.method,
            load_balance=self.style.load_balance,
            scale=a.get("scale"),
            enable_gqa=a.get("enable_gqa", False),
            overlap=self.style.overlap,
        )


class _Binding:
    """A module's context-parallel mesh and style: configuration, shared (not copied) by a
    deep copy of the module."""

    def __init__(self, mesh: DeviceMesh, style: ContextParallel) -> None:
        self.mesh, self.style = mesh, style

    def __deepcopy__(self, memo):
        return self


def _enter_mode(module, args) -> None:
    binding = module._hp_context_parallel
    mode = _SDPAToContextParallel(binding.mesh, binding.style)
    mode.__enter__()
    module.__dict__.setdefault("_hp_cp_modes", []).append(mode)


def _exit_mode(module, args, output) -> None:
    module.__dict__["_hp_cp_modes"].pop().__exit__(None, None, None)


class ContextParallel(ParallelStyle):
    """For ``parallelize_module(attention, cp_mesh, ContextParallel(...))``: the module's
    ``scaled_dot_product_attention`` calls run as ``context_parallel_attention`` over the
    ranks of ``cp_mesh``, on sequence pieces laid out as ``context_parallel_shard`` gives them
    (``load_balance`` must match). The module's code and parameters are unchanged (through
    forward hooks); position-dependent buffers (RoPE tables, position ids) must be sharded the
    same way by the caller. Attention masks and dropout are refused. A
    ``torch.utils.checkpoint`` *inside* the module recomputes without this style (checkpoint the
    module or its parent instead)."""

    overlap = False
    splits_heads = False  # ring and all-gather need no divisibility; Ulysses checks its own

    def __init__(self, *, method: str = "ring", load_balance: bool = True) -> None:
        if method not in METHODS:
            raise ContextParallelError(
                f"{type(self).__name__}: method={method!r} is not one of {METHODS}"
            )
        check_bool(load_balance, "load_balance", type(self).__name__)
        self.method, self.load_balance = method, load_balance

    def validate(self, module: nn.Module, device_mesh: DeviceMesh, path: str) -> None:
        _check_mesh(
            device_mesh,
            f"{type(self).__name__} on {path or type(module).__name__}",
            usp=self.method == "usp",
        )

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.validate(module, device_mesh, "")
        if getattr(module, "_hp_context_parallel", None) is not None:
            raise ContextParallelError(
                f"{type(self).__name__}: {type(module).__name__} is context-parallel already"
            )
        module._hp_context_parallel = _Binding(device_mesh, self)
        module.register_forward_pre_hook(_enter_mode)
        module.register_forward_hook(_exit_mode, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method!r}, load_balance={self.load_balance})"


class AsyncContextParallel(ContextParallel):
    """``ContextParallel`` whose ring posts the next key/value transfer before the current
    step's blocks (``overlap=True``), in forward and backward, and in backward sends the
    key/value gradient accumulators on while the next block's kernels run. Ring only."""

    overlap = True

    def __init__(self, *, method: str = "ring", load_balance: bool = True) -> None:
        if method != "ring":
            raise ContextParallelError(
                f"AsyncContextParallel overlaps the ring's transfers: method={method!r} has "
                "none to overlap; use ContextParallel for it"
            )
        super().__init__(method=method, load_balance=load_balance)
