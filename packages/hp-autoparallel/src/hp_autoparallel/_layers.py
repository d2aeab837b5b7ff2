"""What one block costs for one microbatch on one rank: the activations it keeps for backward
under each recompute mode, and the work of its forward (FLOPs by kind, bytes of memory-bound
kernels, bytes of each collective). Pure Python over a :class:`~hp_autoparallel.ModelSpec`.

``tokens`` is the microbatch's tokens on one context-parallel rank (sequences x seq_len / cp):
tensor-parallel ranks see all of them in the projections (their input is all-gathered under
sequence parallelism) and a ``1 / tp`` slice of them elsewhere; a MoE runs on all of them on
every tensor-parallel rank (hp-trainer gathers its input, and its experts split over ``etp``).
``seq`` is the whole sequence (the keys a causal query sees, on average half of them).

NOTE [Saved activations] (bf16 values unless said; per token, before the ``tokens`` factor):

- attention (GQA): the norm's input (``d / tp``, sequence-sharded), the gathered projection
  input (``d``, saved once for q/k/v), q/k/v after RoPE (``(h + 2 kv) hd / tp``, what the
  fused attention saves) and with Qwen3's q/k norms their inputs too, the attention output
  (``h hd / tp``) and its fp32 log-sum-exp; Qwen3.5's gated attention adds the gate and the
  gated output;
- MLA: the norm input, the gathered input, the query and key/value latents before and after
  their norms (whole on each tp rank), the assembled queries and keys, the ``wkv_b`` output
  that the values view, the output and log-sum-exp;
- dense SwiGLU: the norm input, the gathered input, ``w1`` and ``w3`` outputs, ``silu`` of
  the first and the product (``4 ffn / tp``);
- MoE: the norm input, the gathered input, router scores (fp32), the permuted rows (``k d``),
  the experts' gate, up and product (``3 k h_e / etp``; the fused SwiGLU saves its inputs),
  the shared experts as a SwiGLU of their width; the combine saves nothing (gather backward);
- ``selective`` keeps the checkpoint input (``d / tp``), the matmul outputs (a row-parallel
  output is ``d`` before its reduce-scatter) and the attention outputs; grouped GEMMs are not
  among hp-offload's saved ops, so a MoE's experts are recomputed;
- ``full`` keeps the checkpoint input only; both recompute one block at a time in backward,
  when that block's whole set is alive again.
- each RMSNorm (CUDA's fused kernel) saves its input and an fp32 rstd per token;
- under autocast without FSDP (fp32 parameters) the block's input and the ffn norm's input
  are fp32 and every projection reading a norm's output saves its own bf16 cast of it (q, k,
  v: three; w1, w3: two); ``tests/unit/test_saved_measured.py`` checks the dense block's bytes
  per token in every mode against torch's allocator on the CPU.
Gated DeltaNet blocks are estimated from their projection widths (not derived op by op); MLA,
Gated DeltaNet and MoE blocks get the fp32 norm inputs under autocast but not the per-projection
copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ._spec import ModelSpec

__all__ = [
    "LayerWork",
    "flops_per_token",
    "kind_layer",
    "kind_of",
    "kind_pairs",
    "kind_params",
    "layer_kinds",
    "saved_bytes",
    "work",
]

_LSE = 4  # fp32 log-sum-exp per head and token


@lru_cache(maxsize=1024)
def layer_kinds(spec: ModelSpec, lo: int, hi: int) -> dict[tuple[str, bool], int]:
    """``{(mixer, is_moe): count}`` over blocks ``lo .. hi - 1`` (every block of a kind has the
    same parameters and costs). Do not modify the returned dict (it is cached)."""
    out: dict[tuple[str, bool], int] = {}
    for i in range(lo, hi):
        key = (spec.mixer(i), spec.layer_is_moe(i))
        out[key] = out.get(key, 0) + 1
    return out


@lru_cache(maxsize=1024)
def kind_layer(spec: ModelSpec, kind: tuple[str, bool]) -> int:
    """The first block index of ``kind``."""
    for i in range(spec.n_layers):
        if (spec.mixer(i), spec.layer_is_moe(i)) == kind:
            return i
    raise AssertionError(f"no block of kind {kind}")  # pragma: no cover - callers pass kinds


@lru_cache(maxsize=1024)
def kind_pairs(spec: ModelSpec, lo: int, hi: int) -> dict:
    """``{(kind of block i - 1, kind of block i): count}`` over blocks ``lo .. hi - 1``."""
    out: dict = {}
    prev = None
    for i in range(lo, hi):
        k = (spec.mixer(i), spec.layer_is_moe(i))
        if prev is not None:
            out[(prev, k)] = out.get((prev, k), 0) + 1
        prev = k
    return out


@lru_cache(maxsize=1024)
def kind_params(spec: ModelSpec, kind: tuple[str, bool]):
    """The parameters (``LayerParams``) of one block of ``kind``."""
    return spec.layer_params(kind_layer(spec, kind))


@lru_cache(maxsize=256)
def flops_per_token(spec: ModelSpec, seq: int) -> float:
    """``spec.flops_per_token(seq)``, cached."""
    return spec.flops_per_token(seq)


def kind_of(spec: ModelSpec, layer: int) -> tuple[str, bool]:
    """Block ``layer``'s kind."""
    return (spec.mixer(layer), spec.layer_is_moe(layer))


def _mixer_elements(spec: ModelSpec, mixer: str, mode: str, tp: int, ab: int) -> float:
    """Saved values per token of the token mixer (NOTE [Saved activations]), in units of
    ``ab``-byte elements; the fp32 log-sum-exp is converted to those units."""
    d, h, kv, hd = spec.dim, spec.n_heads, spec.n_kv_heads, spec.head_dim
    lse = h / tp * _LSE / ab
    if mixer == "mla":
        qk, v = spec.qk_dim, spec.v_dim
        ql = spec.q_lora_rank or 0
        lat = spec.kv_lora_rank + spec.qk_rope_head_dim
        if mode == "selective":  # matmul outputs and the attention output
            q_mm = (ql + h * qk / tp) if ql else h * qk / tp
            return d / tp + q_mm + lat + h * (spec.qk_nope_head_dim + v) / tp + d + h * v / tp + lse
        q_lat = 2 * ql if ql else 0
        return (
            d / tp
            + d
            + q_lat
            + lat
            + spec.kv_lora_rank
            + 2 * h * qk / tp  # assembled queries and keys
            + h * (spec.qk_nope_head_dim + v) / tp  # wkv_b output (the values view it)
            + h * v / tp
            + lse
        )
    if mixer == "linear_attention":
        nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
        key, value = nk * spec.linear_key_head_dim, nv * spec.linear_value_head_dim
        proj = (2 * key + 2 * value + 2 * nv) / tp
        if mode == "selective":
            return d / tp + proj + d
        return d / tp + d + proj + (2 * key + value) / tp + 3 * value / tp
    rows = 2 * h if mixer == "gated_attention" else h  # Qwen3.5: query and gate rows
    if mode == "selective":
        return d / tp + (rows + 2 * kv) * hd / tp + d + h * hd / tp + lse
    n = d / tp + d + (h + 2 * kv) * hd / tp + h * hd / tp + lse
    if spec.qk_norm:
        n += (h + kv) * hd / tp
    if mixer == "gated_attention":
        n += 2 * h * hd / tp
    return n


def _ffn_elements(spec: ModelSpec, moe: bool, mode: str, tp: int, etp: int, ab: int) -> float:
    d = spec.dim
    if moe:
        k, he, hs = spec.top_k, spec.expert_hidden, spec.shared_hidden
        if mode == "selective":  # router and shared-expert matmul outputs; experts recomputed
            return d / tp + spec.num_experts + (2 * hs + d if hs else 0)
        scores = spec.num_experts * 4 / ab
        return d / tp + d + scores + k * d + 3 * k * he / etp + 4 * hs
    f = spec.ffn_hidden
    if mode == "selective":
        return d / tp + 2 * f / tp + d
    return d / tp + d + 4 * f / tp


_RSTD = 4  # fp32 reciprocal RMS per token, saved by each (fused) RMSNorm


def _projections(spec: ModelSpec, mixer: str, moe: bool) -> tuple[int, int]:
    """How many linear layers read the attention norm's and the ffn norm's output (under
    autocast each casts it to bf16 on its own, and saves its own copy)."""
    attn = 3 if mixer in ("attention", "gated_attention") else 1
    ffn = 2 if not moe else 1
    return attn, ffn


@lru_cache(maxsize=4096)
def saved_bytes(
    spec: ModelSpec,
    kind: tuple[str, bool],
    mode: str,
    tokens: int,
    tp: int,
    etp: int,
    ab: int,
    autocast: bool = False,
) -> float:
    """Bytes one block of ``kind`` keeps from its forward to its backward, per microbatch of
    ``tokens`` tokens, under ``mode`` (``"none"``, ``"selective"``, ``"full"``; swap keeps
    what ``"none"`` does, on the host).

    ``autocast``: the trainer without FSDP (fp32 parameters under ``torch.autocast``): the
    residual stream is fp32 (the embedding's output is, and ``fp32 + bf16`` adds are), so the
    block's input and its ffn-norm input are saved in 4 bytes, and each projection that reads
    a norm's output casts it to ``ab`` bytes itself and saves that copy (autocast caches the
    casts of parameters only): q, k and v three copies, SwiGLU's w1 and w3 two (NOTE [Saved
    activations])."""
    mixer, moe = kind
    d = spec.dim
    stream = 4 if autocast else ab
    if mode == "full":
        return tokens * d / tp * stream
    m = "selective" if mode == "selective" else "none"
    n = _mixer_elements(spec, mixer, m, tp, ab) + _ffn_elements(spec, moe, m, tp, etp, ab)
    extra = 0.0  # bytes per token beyond the elements of ``ab`` bytes
    if m == "selective":
        n -= d / tp  # the ffn norm's input is not saved: only the block's input is
        extra += (stream - ab) * d / tp
    else:
        extra += 2 * (stream - ab) * d / tp + 2 * _RSTD / tp  # the norms' inputs, rstd
        if autocast:
            pa, pf = _projections(spec, mixer, moe)
            extra += (pa - 1 + pf - 1) * ab * d  # one cast copy per projection
    return tokens * (n * ab + extra)


@dataclass(frozen=True)
class LayerWork:
    """One block's forward on one rank for one microbatch.

    ``matmul``, ``attention``, ``grouped`` are FLOPs (dense GEMMs, the attention core, the
    experts' grouped GEMMs); ``elementwise`` bytes moved by memory-bound kernels; ``tp_gathers``
    / ``tp_scatters`` the tensor-parallel all-gathers / reduce-scatters of ``tp_bytes`` each;
    ``tp_grad_allreduce`` bytes all-reduced over tp in backward (MLA's replicated latent
    weights); ``cp_bytes`` the key/value bytes one ring step moves; ``cp_features`` the head
    features per token the ring merges; ``a2a_bytes`` what one expert all-to-all sends (two per
    forward: dispatch and combine); ``moe_*`` the part of the forward that ``selective``
    recomputes in a MoE block (its experts)."""

    matmul: float
    attention: float
    grouped: float
    elementwise: float
    tp_gathers: int
    tp_scatters: int
    tp_bytes: float
    tp_grad_allreduce: float
    cp_bytes: float
    cp_features: float
    a2a_bytes: float
    moe_grouped: float
    moe_elementwise: float


@lru_cache(maxsize=4096)
def work(
    spec: ModelSpec, kind: tuple[str, bool], tokens: int, seq: int, tp: int, etp: int, ab: int
) -> LayerWork:
    """The forward of one block of ``kind`` (see :class:`LayerWork`)."""
    mixer, moe = kind
    layer = kind_layer(spec, kind)
    d, h, hd = spec.dim, spec.n_heads, spec.head_dim
    t = tokens
    mp = spec.mixer_params(layer)
    fp = spec.ffn_params(layer)
    norms = 2 * d
    # dense GEMMs: split projections on 1/tp of the weights, replicated ones whole
    mix_repl = mp.replicated - norms - (2 * hd if spec.qk_norm else 0)
    if mixer == "mla":  # the latent norms are no matmuls
        mix_repl -= spec.kv_lora_rank + (spec.q_lora_rank or 0)
    if mixer == "linear_attention":
        mix_repl = 0
    if spec.attention_bias and mixer != "mla":
        mix_repl -= d
    matmul = 2 * t * (mp.tp / tp + max(mix_repl, 0))
    matmul += 2 * t * (fp.tp / tp + fp.replicated)  # dense ffn / router, shared experts
    grouped = 2 * t * spec.top_k * 3 * d * spec.expert_hidden / etp if moe else 0.0
    # attention core, causal: each query sees half the sequence on average
    if mixer == "linear_attention":
        nv = spec.linear_num_value_heads
        dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        attention = 2 * t * nv / tp * (4 * dk * dv + 64 * (dk + dv))  # chunked delta rule
    else:
        attention = t * seq * h / tp * (spec.qk_dim + spec.v_dim)
    # memory-bound kernels: norms, RoPE, SwiGLU, residual adds (read + write)
    elem = 2 * d / tp + 3 * d / tp  # attention norm, residual
    if mixer != "linear_attention":
        elem += 4 * (h + spec.n_kv_heads) * spec.qk_dim / tp  # RoPE on q and k
    else:
        elem += 6 * (spec.linear_num_value_heads * spec.linear_value_head_dim) / tp
    elem += 2 * d / tp + 3 * d / tp  # ffn norm, residual
    moe_elem = 0.0
    if moe:
        k = spec.top_k
        moe_elem = 3 * spec.num_experts + 4 * k * d + 3 * k * spec.expert_hidden / etp + d
        elem += moe_elem + (3 * spec.shared_hidden if spec.shared_hidden else 0)
    else:
        elem += 3 * spec.ffn_hidden / tp
    gathers = 2 if tp > 1 else 0
    scatters = (2 if not moe or etp > 1 else 1) if tp > 1 else 0
    grad_ar = max(mix_repl, 0) * ab if (mixer == "mla" and tp > 1) else 0.0
    if mixer == "mla":
        kv_bytes = t * h * (spec.qk_dim + spec.v_dim) / tp * ab
    elif mixer == "linear_attention":
        kv_bytes = 0.0  # state maps are all-gathered once per block: small
    else:
        kv_bytes = t * 2 * spec.n_kv_heads * hd / tp * ab
    return LayerWork(
        matmul=matmul,
        attention=attention,
        grouped=grouped,
        elementwise=t * elem * ab,
        tp_gathers=gathers,
        tp_scatters=scatters,
        tp_bytes=t * d * ab,
        tp_grad_allreduce=grad_ar,
        cp_bytes=kv_bytes,
        cp_features=h * spec.v_dim / tp if mixer != "linear_attention" else 0.0,
        a2a_bytes=t * spec.top_k * d * ab if moe else 0.0,
        moe_grouped=grouped,
        moe_elementwise=t * moe_elem * ab,
    )
