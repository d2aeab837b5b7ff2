"""Expert networks: the SwiGLU ``FeedForward`` and ``GroupedExperts`` (every expert in one
grouped matmul per projection).

Single-device code. Parallel styles make the parameters DTensors (experts split on dim 0 over an
expert-parallel mesh, the hidden dimension split over a tensor-parallel one); ``GroupedExperts``
reads the placements to know which reductions its forward needs, so no flag is set on it.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
import hp_kernels.moe as kmoe
from hp_dtensor import DTensor, Shard
from hp_kernels.moe import swiglu

from ._checks import check_bool, check_positive_int, check_tensor
from ._dispatch import LocalDispatcher, TokenDispatcher
from .errors import MoEConfigError

__all__ = ["FeedForward", "GroupedExperts", "grouped_mm", "grouped_mm_supported"]


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (a dense layer, or the shared experts of a MoE).

    Args:
        dim: model width.
        hidden_dim: inner width.
        bias: give the three ``nn.Linear`` children biases (Llama and Qwen have none).
    """

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False) -> None:
        super().__init__()
        _positive(dim=dim, hidden_dim=hidden_dim)
        check_bool(bias, "bias", "FeedForward")
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., dim) -> (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _positive(**values: int) -> None:
    for name, v in values.items():
        check_positive_int(v, name)


_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# dtypes the grouped GEMM kernels take, per device type (CUDA: the sm90 CUTLASS kernels)
_GMM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch`` has a grouped matmul for these operands: the op exists, the device and
    dtype have a kernel, and every row stride is a multiple of 16 bytes (the kernels' rule)."""
    dtypes = _GMM_DTYPES.get(x.device.type, ())
    if torch.compiler.is_compiling() or not kmoe.has_data(x):
        # the op's meta function (what compile traces, and fake tensors run) wants bf16
        dtypes = tuple(d for d in dtypes if d == torch.bfloat16)
    if _GMM is None or x.dtype not in dtypes:
        return False
    es = x.element_size()
    if x.dim() != 2 or x.stride(1) != 1 or (x.stride(0) * es) % 16:
        return False
    for w in weights:
        if w.dtype != x.dtype or w.dim() != 3 or any(s * es % 16 for s in w.shape[1:]):
            return False
    return True


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` rows grouped by expert times each expert's ``w[e].T``: ``(R, in)`` x ``(E, out,
    in)`` -> ``(R, out)``; expert ``e`` owns rows ``offsets[e-1]:offsets[e]`` (int32, cumulative,
    on ``x``'s device). Rows after ``offsets[-1]`` are left unspecified. One grouped GEMM where
    torch has one for the operands (``grouped_mm_supported``), else a loop of matmuls (which
    reads the offsets on the host)."""
    check_tensor(x, "x", "grouped_mm", ndim=2)
    check_tensor(w, "w", "grouped_mm", ndim=3)
    check_tensor(offsets, "offsets", "grouped_mm", ndim=1)
    if x.shape[1] != w.shape[2] or offsets.shape[0] != w.shape[0]:
        raise MoEConfigError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets "
            f"{tuple(offsets.shape)}: need x (R, in), w (E, out, in) and offsets (E,)"
        )
    if offsets.is_floating_point():
        raise MoEConfigError(f"grouped_mm: offsets has dtype {offsets.dtype}: give int32 offsets")
    if grouped_mm_supported(x, w):
        return _GMM(x, w.transpose(-2, -1), offs=offsets)
    return _matmul_loop(x, w, offsets)


@torch.compiler.disable
def _matmul_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``'s loop of matmuls. Never traced by ``torch.compile``: the row bounds are
    read on the host, and a graph specialised on them would recompile whenever the routing
    changes (a graph break instead, once per call)."""
    out = x.new_zeros((x.shape[0], w.shape[1]))
    if kmoe.has_data(offsets):
        bounds = [0, *offsets.tolist()]
    else:  # a dry run (fake tensors): routing unknown, taken as balanced over the experts
        bounds = [0, *itertools.accumulate(kmoe.balanced_split(x.shape[0], w.shape[0]))]
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi] @ w[e].transpose(0, 1)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over the group: the input of a
    tensor-parallel region whose ranks hold the same rows."""

    @staticmethod
    def forward(ctx, x, group, platform):
        ctx.group, ctx.platform = group, platform
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.platform.all_reduce(g, "sum", ctx.group)
        return g, None, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: the output of a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group, platform):
        x = x.contiguous().clone()
        platform.all_reduce(x, "sum", group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts computed together.

    Parameters ``w1`` (gate) and ``w3`` (up) are ``[E, hidden_dim, dim]``, ``w2`` (down)
    ``[E, dim, hidden_dim]`` (torchtitan's layout and names). ``forward(x, num_tokens_per_expert)``
    takes rows already grouped by expert (``x[:n0]`` for expert 0, the next ``n1`` for expert 1,
    ...) and computes each projection of every expert with one grouped matmul; rows after
    ``num_tokens_per_expert.sum()`` (copies dropped over capacity) come back unspecified.

    ``dispatcher`` is the token dispatcher the owning ``MoE`` uses (a ``LocalDispatcher`` until
    a parallel style installs another); it holds configuration only (the mesh), never a batch's
    state.

    Example::

        experts = GroupedExperts(64, 128, num_experts=4)
        y = experts(torch.randn(10, 64), torch.tensor([3, 0, 5, 2]))   # (10, 64)
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        _positive(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        self.num_experts = num_experts
        self.dim, self.hidden_dim = dim, hidden_dim
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.dispatcher: TokenDispatcher = LocalDispatcher(num_experts)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised as an ``nn.Linear`` of its shape would be."""
        with torch.no_grad():
            for w in (self.w1, self.w2, self.w3):
                bound = 1.0 / math.sqrt(w.shape[-1])
                _local(w).uniform_(-bound, bound)

    def _tensor_parallel_group(self):
        """The (group, platform) of the mesh dimension that splits the hidden dim, or None."""
        w1 = self.w1
        if not isinstance(w1, DTensor):
            return None
        for d, p in enumerate(w1.placements):
            if isinstance(p, Shard) and p.dim == 1:
                mesh = w1.device_mesh
                if mesh.shape[d] == 1:
                    return None
                return mesh.get_group(d), hp.get_platform(mesh.device_type)
        return None

    def forward(
        self,
        x: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        *,
        row_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (R, dim) grouped by local expert, ``num_tokens_per_expert`` (local experts,)
        -> (R, dim). ``row_weights`` (R,): multiply each row's hidden activation (the same as
        its output: ``w2`` is linear), fused into the SwiGLU (``ctx.row_gates`` of a dispatch
        with ``gates_to_experts``). Rows after ``num_tokens_per_expert.sum()`` belong to no
        expert: their outputs, and the gradients their inputs and ``row_weights`` receive, are
        unspecified (the dispatchers never read them)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        fn = "GroupedExperts"
        check_tensor(x, "x", fn, ndim=2)
        check_tensor(num_tokens_per_expert, "num_tokens_per_expert", fn)
        if x.shape[1] != self.dim:
            raise MoEConfigError(
                f"{fn}: x has shape {tuple(x.shape)}; the experts take (rows, dim={self.dim})"
            )
        if num_tokens_per_expert.is_floating_point():
            raise MoEConfigError(
                f"{fn}: num_tokens_per_expert has dtype {num_tokens_per_expert.dtype}: give "
                "integer counts"
            )
        if row_weights is not None:
            check_tensor(row_weights, "row_weights", fn)
            if tuple(row_weights.shape) != (x.shape[0],):
                raise MoEConfigError(
                    f"{fn}: row_weights has shape {tuple(row_weights.shape)}: give one weight "
                    f"per row of x, shape ({x.shape[0]},)"
                )
        if num_tokens_per_expert.shape != (w1.shape[0],):
            raise MoEConfigError(
                f"num_tokens_per_expert has shape {tuple(num_tokens_per_expert.shape)}; this "
                f"rank holds {w1.shape[0]} experts: give one count per local expert"
            )
        tp = self._tensor_parallel_group()
        if tp is not None:  # the same rows on every tp rank: their gradients are partial sums
            x = _CopyToGroup.apply(x, *tp)
            if row_weights is not None:
                row_weights = _CopyToGroup.apply(row_weights, *tp)
        dtype = _compute_dtype(x, w1)
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        offsets = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
        h = swiglu(grouped_mm(x, w1, offsets), grouped_mm(x, w3, offsets), row_weights)
        out = grouped_mm(h, w2, offsets)
        if tp is not None:
            out = _ReduceFromGroup.apply(out, *tp)
        return out

    def takes_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` on rows like ``x`` (``(..., dim)``) runs torch's grouped
        GEMM rather than the loop of matmuls (a graph break under ``torch.compile``): decided
        from the dtype it computes in (autocast's when autocast is on, else the weights') and
        the shapes, as ``forward`` decides."""
        w = [_local(t) for t in (self.w1, self.w2, self.w3)]
        dtype = _compute_dtype(x, w[0])
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        return grouped_mm_supported(rows, *(t.to(dtype) for t in w))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """autocast's dtype when it is on for the device (grouped GEMMs are not on its op lists),
    else the weights' dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return w.dtype
