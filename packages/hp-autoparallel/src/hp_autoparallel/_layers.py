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
- each RMSNorm (CUDA's fused kernel) saves its input and an fp32 rstd per row (a token for
  the block's norms, a head and token for Qwen3's q/k norms); where
  ``F.rms_norm`` is torch's composite (the CPU's, ``GpuCalibration.rms_norm =
  "decomposed"``) it saves its input cast to fp32 (the input itself when fp32) and the fp32
  ``x * rstd`` for the weight's multiply: ``DECOMPOSED_NORM - b`` more bytes per element of
  a ``b``-byte input (the block's two norms, Qwen3's q/k norms, MLA's latent norms, the final
  norm);
- under autocast without FSDP (fp32 parameters) the block's input and the ffn norm's input
  are fp32 and every projection reading a norm's output saves its own bf16 cast of it (q, k,
  v: three; w1, w3: two); ``tests/unit/test_saved_measured.py`` checks the dense block's bytes
  per token in every mode against torch's allocator on the CPU, for Llama and Qwen3. MLA is
  not checked there: on the CPU its attention (value and query head dims differ) takes the
  math kernel, which saves fp32 scores, where CUDA's fused kernels save a log-sum-exp.
Qwen3.5's blocks (Gated DeltaNet, gated attention) are derived from hp-trainer's code in
``_qwen35_saved`` and checked the same way; not modelled there: context parallelism's state
passing in the Gated DeltaNet (its transition maps, each rank's first chunk needing a
gradient), and the shared expert's casts of Qwen3.5-MoE. MLA and MoE blocks get the fp32 norm
inputs under autocast but not the per-projection copies.

NOTE [Element-wise traffic] (bytes read + written per token by every aten op of a block other
than the GEMMs and the attention core, forward and backward; ``s`` the residual stream's bytes,
4 under autocast else ``a`` = 2; ``pa`` = 3 (q, k, v) and ``pf`` = 2 (w1, w3) projections read
the two norms' outputs; ``r = (h + kv) qk_dim`` the rotated features; ``f`` the ffn width):

- forward: 2 fused RMSNorms ``2 (2 s d + 4)`` (x in, y out, fp32 rstd), 2 residual adds
  ``2 (2 s + a) d``, RoPE on q and k ``10 a r`` (neg of half, cat, two muls, add), SwiGLU
  ``5 a f`` (silu, mul); under autocast each projection's cast of its norm's output
  ``(pa + pf)(s + a) d``;
- backward: the norms ``2 (3 s d + 4)``, the residual-gradient sums ``2 x 3 s d``, the sums of
  the gradients of a norm output read by several projections ``(pa - 1 + pf - 1) 3 s d``, RoPE
  ``10 a r``, SwiGLU ``9 a f``; under autocast the casts of the projections' input gradients
  back to fp32 ``(pa + pf)(s + a) d`` and of the residual branches' gradients to bf16
  ``2 (s + a) d``;
- so a Llama block under autocast moves ``192 d + 40 r + 28 f + 16`` bytes per token (fwd
  ``66 d + 20 r + 10 f + 8``), against ``60 d + 24 r + 18 f`` before this accounting;
- the head (per token): the final norm, its output's cast, ``F.cross_entropy(logits.float())``:
  ``(a + 4) v`` cast, ``8 v`` log_softmax, nll reads the target and its entry (``12``);
  backward ``4 v`` nll's gradient (written whole), ``12 v`` log_softmax's, ``(4 + a) v`` the
  cast back, the norm's and the cast's backward; the embedding's backward ``s d + 8``;
- per parameter and micro-step under autocast: ``CAST_BYTES`` (6) for each matmul weight's
  fp32 -> bf16 cast in the forward (again in a recomputed forward: the cache lives for one
  autocast region) and 6 for its gradient's cast back; every micro-step after the first adds
  ``ACCUMULATE_BYTES`` (12) per fp32 gradient; ``zero_grad(set_to_none=True)`` moves nothing
  and clipping is in the optimizer's 32 bytes.

``tests/unit/test_elementwise_measured.py`` checks the block's and the head's bytes per token
and the block's bytes per parameter against every aten op torch runs for the real model on the
CPU (a ``TorchDispatchMode`` summing the ops' input and output bytes). Qwen3.5's blocks are
counted as NOTE [Qwen3.5 traffic] says (its zero-centred norms and both token mixers, checked
the same way); MLA and MoE mixers / experts keep the earlier estimate (backward twice the
forward); Qwen3's q/k norms are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ._spec import ModelSpec

__all__ = [
    "LayerWork",
    "DECOMPOSED_NORM",
    "backward_transient",
    "block_elementwise",
    "block_ops",
    "block_step_ops",
    "down_params",
    "flops_per_token",
    "embedding_elementwise",
    "head_elementwise",
    "kind_layer",
    "kind_of",
    "kind_pairs",
    "kind_params",
    "layer_kinds",
    "rest_ops",
    "rest_step_ops",
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
        return d / tp + proj + d  # selective (without it: _qwen35_saved)
    rows = 2 * h if mixer == "gated_attention" else h  # Qwen3.5: query and gate rows
    if mode == "selective":
        return d / tp + (rows + 2 * kv) * hd / tp + d + h * hd / tp + lse
    n = d / tp + d + (h + 2 * kv) * hd / tp + h * hd / tp + lse  # (Qwen3.5's: _qwen35_saved)
    if spec.qk_norm:
        n += (h + kv) * hd / tp
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
    attn = {"attention": 3, "gated_attention": 3, "linear_attention": 6}.get(mixer, 1)
    ffn = 2 if not moe else 1
    return attn, ffn


#: the chunk length of hp-trainer's chunked gated delta rule (``GatedDeltaNet.chunk``)
GDN_CHUNK = 64


def _qwen35_norm(spec: ModelSpec, tp: int, ab: int, autocast: bool, readers: int) -> float:
    """Bytes per token one of Qwen3.5's zero-centred RMSNorms keeps: ``rms_norm`` of its fp32
    input (the input cast, or the fp32 stream itself) and the rstd, the fp32 normalised tensor
    for the ``1 + weight`` scale (the norm calls ``F.rms_norm`` without a weight, so the CPU's
    composite saves what CUDA's kernel does), and its output as the projections reading it
    keep it: under autocast each of the ``readers`` casts the fp32 output itself."""
    d = spec.dim
    out = readers * ab * d if autocast else ab * d
    return (8 * d + _RSTD) / tp + out


def _gdn_mixer(spec: ModelSpec, tp: int, ab: int, autocast: bool, seq: int) -> float:
    """Bytes per token hp-trainer's Gated DeltaNet keeps beyond its input norm (NOTE [Saved
    activations]): the q/k/v projections' outputs and their short convolutions (each SiLU
    saving the convolution's padded output), beta and the decay's softplus, the L2
    normalisation in fp32, the chunked delta rule's fp32 pieces (within-chunk decay, the
    triangular system and its solutions, the decayed queries and keys), the recurrence over
    chunks (the state per chunk; under autocast each matmul's bf16 operand casts), and the
    gated output norm. ``seq`` is the sequence each rank runs (0: long, the halo and the first
    chunk's state, which needs no gradient, taken as nothing)."""
    h, hk = spec.linear_num_value_heads / tp, spec.linear_num_key_heads / tp
    dk, dv, c = spec.linear_key_head_dim, spec.linear_value_head_dim, GDN_CHUNK
    key, value, a, low = hk * dk, h * dv, ab, ab < 4
    halo = (spec.linear_conv_kernel - 1) / seq if seq else 0.0
    n = -(-seq // c) if seq else 0
    later = _later_chunks(seq)  # the chunks after the first (their state needs a gradient)
    # projections: each convolution saves its input, its SiLU the padded convolution output;
    # beta's sigmoid output; the decay's softplus input and output (fp32)
    out = a * (2 * key + value) * (2 + halo) + a * h + 8 * h
    # L2 normalisation of q and k (repeated to the value heads): the fp32 input (twice when
    # it is a cast: ``_f32(q)`` is called twice) and the rsqrt
    out += 2 * ((2 if low else 1) * 4 * h * dk + 4 * h)
    # the chunked pieces (fp32): v (and beta) in fp32, k, the within-chunk decay and the
    # triangular system (c x c per head), u and w, three decays' exps, the chunk decay
    rule = 4 * value + (4 * h if low else 0) + 8 * h * dk + 8 * h * c + 4 * h * dv
    rule += 12 * h + 4 * h / c
    if autocast:  # the two within-chunk matmuls: operand casts and bf16 outputs; kb and q_s
        rule += 4 * a * h * dk + 2 * a * h * c + 8 * h * dk
    else:  # fp32 matmuls on views (the rule lays k, v and q out heads first), fp32
        # outputs; kb and the scaled queries for their products with the decays
        rule += 8 * h * dk + 8 * h * c
    # the recurrence, per chunk: under autocast the state's casts (twice), the scores' and the
    # corrected values' (else the corrected values in fp32), and after the first chunk (whose
    # zero state needs no gradient) the resolved keys' and decayed queries'. The state update
    # (the fp32 state, and under autocast the decayed keys' and corrected values' casts) is
    # kept for every chunk but the last, whose new state is not computed.
    state = dk * dv / c
    update = 4 * h * state + (a * h * (dk + dv) if autocast else 0.0)
    if autocast:
        rule += 2 * a * h * state + a * h * c + a * h * dv + later * (2 * a * h * dk + update)
    else:  # the fp32 matmuls keep every chunk's state (the last one's too), the corrected
        # values and, through their chunk views, the whole scores and (from the second chunk
        # on) the decayed keys and queries
        rule += update + 4 * h * dv + 4 * h * c + (8 * h * dk if n != 1 else 0.0)
    out += rule * _padded(seq)  # the rule runs on the sequence padded to whole chunks
    # the gated norm: its fp32 input and rstd per head, the normalised output, its product
    # with the weight (fp32 where the weight is: autocast's fp32 parameters), silu's fp32
    # input (the gate) and output, and the output projection's input
    out += 12 * value + (2 * a + (4 if autocast else a)) * value + 4 * h
    return out


def _later_chunks(seq: int) -> float:
    """The share of the chunked rule's chunks after the first (1 when ``seq`` is 0: long
    sequences): the first chunk's state needs no gradient, the last one's update is not run."""
    n = -(-seq // GDN_CHUNK) if seq else 0
    return (n - 1) / n if n else 1.0


def _padded(seq: int) -> float:
    """The chunked rule's tensors per token of ``seq``: it pads to whole chunks (1 when
    ``seq`` is 0: long sequences)."""
    return -(-seq // GDN_CHUNK) * GDN_CHUNK / seq if seq else 1.0


def _gdn_matmul_outputs(spec: ModelSpec, tp: int, ab: int, autocast: bool, seq: int) -> float:
    """Bytes per token of the Gated DeltaNet's batched matmul outputs, which selective
    recomputation keeps (hp-offload saves every matmul's output): the two within-chunk score
    matrices and, per chunk, the recurrence's three value-sized products and (but after the
    last chunk, whose new state is not computed) the state update's; bf16 under autocast,
    fp32 otherwise (the rule runs in fp32)."""
    h, dk, c = spec.linear_num_value_heads / tp, spec.linear_key_head_dim, GDN_CHUNK
    dv = spec.linear_value_head_dim
    size = ab if autocast else 4
    return size * h * (2 * c + 3 * dv + _later_chunks(seq) * dk * dv / c) * _padded(seq)


def _gated_attention_mixer(spec: ModelSpec, tp: int, ab: int, autocast: bool) -> float:
    """Bytes per token Qwen3.5's gated attention keeps beyond its input norm: the q and k
    zero-centred norms (fp32 input and normalised tensor, rstd per head), SDPA's q, k, v,
    output and log-sum-exp, the sigmoid gate, the gated product's operand and the output
    projection's input."""
    h, kv, hd, a = spec.n_heads / tp, spec.n_kv_heads / tp, spec.head_dim, ab
    # q/k norms: the fp32 input (in fp32 the query is a view of wq's output, which keeps the
    # gate's half too), the rstd and the fp32 normalised tensor
    out = 8 * (h + kv) * hd + 4 * (h + kv) + (4 * h * hd if ab == 4 else 0.0)
    out += a * (2 * h + 2 * kv) * hd + _LSE * h  # SDPA: q, k, v, output (laid out as the
    # merged heads read it: no copy); lse
    out += 2 * a * h * hd  # sigmoid(gate), wo's input
    return out


def _qwen35_saved(spec, kind, tp, etp, ab, autocast, seq) -> float:
    """Bytes per token one Qwen3.5 block keeps without recomputation: its two norms, the token
    mixer and the feed-forward (the SwiGLU's or the MoE's own saved set)."""
    mixer, moe = kind
    pa, pf = _projections(spec, mixer, moe)  # q, k, v, b, a, z / q, k, v
    out = _qwen35_norm(spec, tp, ab, autocast, pa)
    if mixer == "linear_attention":
        out += _gdn_mixer(spec, tp, ab, autocast, seq)
    else:
        out += _gated_attention_mixer(spec, tp, ab, autocast)
    out += _qwen35_norm(spec, tp, ab, autocast, pf)
    d = spec.dim
    out += (_ffn_elements(spec, moe, "none", tp, etp, ab) - d / tp - d) * ab
    return out


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
    decomposed_norm: bool = False,
    seq: int = 0,
) -> float:
    """Bytes one block of ``kind`` keeps from its forward to its backward, per microbatch of
    ``tokens`` tokens, under ``mode`` (``"none"``, ``"selective"``, ``"full"``; swap keeps
    what ``"none"`` does, on the host).

    ``decomposed_norm``: ``F.rms_norm`` is torch's composite (the CPU's;
    ``GpuCalibration.decomposed_norm``), which saves its input cast to fp32 (in place of the
    input) and the fp32 ``x * rstd`` (for the weight's multiply) beside the rstd: ``8 - b``
    more bytes per normalised element than the fused kernel, for an input of ``b`` bytes; for
    the block's two norms, Qwen3's q/k norms and MLA's latent norms, when they are saved.

    ``autocast``: the trainer without FSDP (fp32 parameters under ``torch.autocast``): the
    residual stream is fp32 (the embedding's output is, and ``fp32 + bf16`` adds are), so the
    block's input and its ffn-norm input are saved in 4 bytes, and each projection that reads
    a norm's output casts it to ``ab`` bytes itself and saves that copy (autocast caches the
    casts of parameters only): q, k and v three copies, SwiGLU's w1 and w3 two (NOTE [Saved
    activations]).

    ``seq``: the sequence length one rank runs (the whole sequence over ``cp``), which
    Qwen3.5's Gated DeltaNet needs (its convolutions' halo, its chunks: padding, the first
    chunk's state); 0 takes the long-sequence limit. Qwen3.5's norms are weightless
    ``F.rms_norm`` calls, the same on both kernels: ``decomposed_norm`` does not apply."""
    mixer, moe = kind
    d = spec.dim
    stream = 4 if autocast else ab
    if mode == "full":
        return tokens * d / tp * stream
    m = "selective" if mode == "selective" else "none"
    if m == "none" and spec.architecture == "qwen3_5":
        return tokens * _qwen35_saved(spec, kind, tp, etp, ab, autocast, seq)
    n = _mixer_elements(spec, mixer, m, tp, ab) + _ffn_elements(spec, moe, m, tp, etp, ab)
    extra = 0.0  # bytes per token beyond the elements of ``ab`` bytes
    if m == "selective":
        n -= d / tp  # the ffn norm's input is not saved: only the block's input is
        extra += (stream - ab) * d / tp
        if mixer == "linear_attention":
            extra += _gdn_matmul_outputs(spec, tp, ab, autocast, seq)
    else:
        extra += 2 * (stream - ab) * d / tp + 2 * _RSTD / tp  # the norms' inputs, rstd
        inner = _inner_norms(spec, mixer, tp)
        extra += _RSTD * sum(rows for rows, _ in inner)  # the mixer's norms' rstd
        if decomposed_norm:  # the block's two norms on the stream, the mixer's on activations
            extra += (DECOMPOSED_NORM - stream) * 2 * d / tp
            extra += (DECOMPOSED_NORM - ab) * sum(rows * width for rows, width in inner)
        if autocast:
            pa, pf = _projections(spec, mixer, moe)
            extra += (pa - 1 + pf - 1) * ab * d  # one cast copy per projection
    return tokens * (n * ab + extra)


#: bytes per normalised element torch's composite ``F.rms_norm`` saves beside its rstd: its
#: input cast to fp32 and the fp32 ``x * rstd`` (the fused kernel saves the input as it is)
DECOMPOSED_NORM = 8


def _inner_norms(spec: ModelSpec, mixer: str, tp: int) -> list[tuple[float, int]]:
    """The RMSNorms inside the token mixer, as ``(rows per token, width)``, each row with its
    fp32 rstd saved: Qwen3's q/k norms, one row per query and key/value head of the rank;
    MLA's query and key/value latent norms, whole on each tp rank."""
    if mixer == "attention" and spec.qk_norm:
        return [((spec.n_heads + spec.n_kv_heads) / tp, spec.head_dim)]
    if mixer == "mla":
        q = [(1.0, spec.q_lora_rank)] if spec.q_lora_rank else []
        return [(1.0, spec.kv_lora_rank), *q]
    return []


@lru_cache(maxsize=4096)
def backward_transient(
    spec: ModelSpec,
    kind: tuple[str, bool],
    tokens: int,
    tp: int,
    etp: int,
    ab: int,
    autocast: bool = False,
) -> float:
    """Bytes one block's backward holds beyond its saved set at its fullest, in the
    feed-forward's SwiGLU backward (``silu(a) * b``): the gradient of the block's output (the
    residual stream's dtype, sequence-sharded), w2's input gradient and the gradients of ``a``
    and ``b``, less the product itself (w2's weight gradient, the only reader, has run). A MoE
    block's routed experts do the same on their ``top_k`` rows per token."""
    _, moe = kind
    stream = 4 if autocast else ab
    width = spec.top_k * spec.expert_hidden / etp if moe else spec.ffn_hidden / tp
    return tokens * (spec.dim / tp * stream + 2 * width * ab)


def down_params(spec: ModelSpec, kind: tuple[str, bool]):
    """The feed-forward's output projection(s) of one block of ``kind`` (a third of its
    SwiGLU weights, routed experts and shared ones alike): the first weight gradients its
    backward makes."""
    from ._spec import LayerParams

    fp = spec.ffn_params(kind_layer(spec, kind))
    shared = spec.dim * spec.shared_hidden if kind[1] else 0
    return LayerParams(fp.tp // 3, shared, fp.experts // 3)


_NORM_STAT = 4  # fp32 rstd per token a fused RMSNorm writes (forward) and reads (backward)


def _zero_centred_norm(s: int) -> tuple[float, float]:
    """Bytes per normalised element one of Qwen3.5's zero-centred RMSNorms moves beyond a
    fused RMSNorm's ``2 s`` / ``3 s`` (NOTE [Qwen3.5 traffic]), forward and backward: ``rms_norm``
    of the fp32 input without a weight (read 4, write 4), the fp32 ``y * (1 + weight)`` (read 4,
    write 4), and on a stream of ``s < 4`` bytes the cast in and the cast back (``s + 4`` each);
    backward: the cast of the gradient in and of dx back, the scale's two products (``g (1 +
    w)``: read 4 write 4; ``g y`` read 8 write 4, summed into the weight's gradient: read 4) and
    the fused backward (read g and x, write dx: 12)."""
    casts = 2 * (s + 4) if s != 4 else 0
    return 16 - 2 * s + casts, 36 - 3 * s + casts


def _qwen35_features(spec: ModelSpec, mixer: str, tp: int, seq: int) -> dict[str, float]:
    """Per token, the sizes NOTE [Qwen3.5 traffic]'s coefficients multiply, for one rank's
    heads (``seq`` 0: a long sequence, the per-sequence terms vanish)."""
    per_seq = 1 / seq if seq else 0.0
    if mixer == "linear_attention":
        nk, nv = spec.linear_num_key_heads / tp, spec.linear_num_value_heads / tp
        dk, dv, c = spec.linear_key_head_dim, spec.linear_value_head_dim, GDN_CHUNK
        keys, values = nk * dk, nv * dv
        return {
            "keys": keys,
            "heads_keys": nv * dk,
            "unrepeated": keys if nv == nk else 0.0,
            "values": values,
            "heads": nv,
            "scores": nv * c,
            "state": nv * dk * dv / c,
            "state_seq": nv * dk * dv * per_seq,
            "keys_seq": keys * per_seq,
            "values_seq": values * per_seq,
            "heads_chunk": nv / c,
            "heads_seq": nv * per_seq,
            "values_chunk_seq": values * c * per_seq,
            "heads_keys_chunk_seq": nv * dk * c * per_seq,
        }
    h, kv, hd = spec.n_heads / tp, spec.n_kv_heads / tp, spec.head_dim
    r = spec.rope_dim
    return {
        "q": h * hd,
        "kv": kv * hd,
        "heads": h,
        "kv_heads": kv,
        "q_rope": h * r,
        "kv_rope": kv * r,
        "gate_copy": h * hd if h > 1 else 0.0,
        "no_pass": (h + kv) * hd if r == hd else 0.0,
    }


#: NOTE [Qwen3.5 traffic]: bytes per token the token mixers of hp-trainer's Qwen3.5 blocks move
#: beyond their input projections' norm, per feature of :func:`_qwen35_features`, for (float32,
#: bfloat16, bfloat16 under autocast), forward / backward. Counted: a ``TorchDispatchMode``
#: summed every element-wise aten op's input and output bytes over 38 shapes of the Gated
#: DeltaNet (more than one value head each) and 30 of the gated attention (heads, head sizes,
#: rotary shares, chunk and sequence lengths), and these integers reproduce every one
#: exactly; ``tests/unit/test_elementwise_measured.py`` re-counts two other shapes per mixer
#: and precision. The norms around the mixer are :func:`_zero_centred_norm`'s, op by op.
#: What the large terms are:
#:
#: - Gated DeltaNet: ``scores`` (the ``[chunk, chunk]`` matrices, one row per token and head:
#:   decay differences, the causal mask, exp, the products with the key and query scores, the
#:   unit diagonal, the two triangular solves; backward the same and the mask's and tril's
#:   gradients, 68 / 164 bytes in float32), the keys after the value heads' repeat
#:   (``heads_keys``: the repeat, the L2 norm, the decays and the write strengths, the solves'
#:   right-hand sides), the values (the short convolution's SiLU, the solve, the per-chunk
#:   corrections, the gated output norm) and the per-head scalars (decay, write strength,
#:   cumulative sums, norms' rstd); ``state`` is the ``[dk, dv]`` state's update once a chunk;
#: - gated attention: the zero-centred q / k norms, the output gate's sigmoid and product (and
#:   the gate's copy out of the fused query projection, none with one head), partial RoPE on
#:   ``q_rope`` / ``kv_rope`` (10 elements read + written per rotated element, as in NOTE
#:   [Element-wise traffic]) and the concatenation with the unrotated part.
#:
#: The chunk loop indexes each piece by one ``unbind`` and stacks the outputs once: indexing a
#: chunk at a time gave every index a backward that wrote a whole zero-filled gradient, which
#: grew with the square of the chunks (this table was what showed it). Sequences that are not a
#: whole number of chunks pad the last one, which is not counted. One value head per rank makes
#: some of the copies views (a few bytes per value element fewer than counted).
_QWEN35_TRAFFIC = {
    "linear_attention": (
        {
            "keys": (32, 16, 16),
            "heads_keys": (120, 136, 178),
            "unrepeated": (-16, -8, -8),
            "values": (120, 130, 128),
            "heads": (152, 160, 160),
            "scores": (68, 68, 70),
            "state": (20, 20, 30),
            "state_seq": (-16, -16, -14),
            "keys_seq": (24, 12, 12),
            "values_seq": (12, 6, 6),
            "heads_chunk": (16, 16, 16),
            "heads_seq": (-4, -4, -4),
            "values_chunk_seq": (0, 0, -6),
            "heads_keys_chunk_seq": (0, 0, -6),
        },
        {
            "keys": (88, 44, 44),
            "heads_keys": (340, 348, 390),
            "unrepeated": (0, -8, -8),
            "values": (204, 208, 224),
            "heads": (356, 354, 354),
            "scores": (164, 164, 178),
            "state": (48, 48, 66),
            "state_seq": (-68, -68, -86),
            "keys_seq": (48, 24, 24),
            "values_seq": (24, 12, 12),
            "heads_chunk": (40, 40, 40),
            "heads_seq": (-12, -12, -12),
            "values_chunk_seq": (-12, -12, -18),
            "heads_keys_chunk_seq": (0, 0, -6),
        },
    ),
    "gated_attention": (
        {
            "q": (44, 42, 42),
            "kv": (24, 32, 32),
            "heads": (4, 4, 4),
            "kv_heads": (4, 4, 4),
            "q_rope": (40, 20, 20),
            "kv_rope": (40, 20, 20),
            "gate_copy": (8, 4, 4),
        },
        {
            "q": (112, 86, 86),
            "kv": (60, 60, 60),
            "heads": (4, 4, 4),
            "kv_heads": (4, 4, 4),
            "q_rope": (40, 20, 20),
            "kv_rope": (40, 20, 20),
            "no_pass": (-8, -4, -4),
        },
    ),
}


def _qwen35_mixer(spec: ModelSpec, mixer: str, tp: int, ab: int, autocast: bool, seq: int):
    """Bytes per token a Qwen3.5 token mixer moves, forward and backward (NOTE [Qwen3.5
    traffic])."""
    col = 0 if ab == 4 else (2 if autocast else 1)
    feats = _qwen35_features(spec, mixer, tp, seq)
    fwd, bwd = _QWEN35_TRAFFIC[mixer]
    return (
        sum(feats[k] * c[col] for k, c in fwd.items()),
        sum(feats[k] * c[col] for k, c in bwd.items()),
    )


def block_elementwise(
    spec: ModelSpec,
    kind: tuple[str, bool],
    tp: int,
    etp: int,
    ab: int,
    autocast: bool = False,
    seq: int = 0,
) -> tuple[float, float]:
    """Bytes per token the memory-bound kernels of one block move (read + written), forward and
    backward (NOTE [Element-wise traffic], and NOTE [Qwen3.5 traffic] for Qwen3.5's mixers and
    norms; ``seq`` the sequence length, 0 for long ones). Parameter-sized traffic (weight
    casts, gradient accumulation) is ``CAST_BYTES`` / ``ACCUMULATE_BYTES`` per parameter."""
    mixer, moe = kind
    d, a = spec.dim, ab
    s = 4 if autocast else ab  # the residual stream's bytes
    pa, pf = _projections(spec, mixer, moe)
    dl = d / tp  # sequence-sharded under tensor parallelism
    # two fused RMSNorms: read x, write y (the stream's dtype), rstd; backward reads g, x, rstd
    # and writes dx
    fwd = 2 * (2 * s * d + _NORM_STAT) / tp
    bwd = 2 * (3 * s * d + _NORM_STAT) / tp
    if spec.architecture == "qwen3_5":  # zero-centred: unfused scale, fp32 inside
        zf, zb = _zero_centred_norm(s)
        fwd, bwd = fwd + 2 * zf * d / tp, bwd + 2 * zb * d / tp
    # residual adds x + branch (stream + bf16 -> stream); backward sums the residual gradient
    # with the one through the norm (stream)
    fwd += 2 * (2 * s + a) * dl
    bwd += 2 * 3 * s * dl
    # the gradients of a norm output read by several projections are summed (pa - 1 + pf - 1
    # adds of stream-dtype tensors)
    bwd += (pa - 1 + pf - 1) * 3 * s * d
    if autocast:
        # each projection casts its norm's fp32 output to bf16 (read 4, write 2); backward casts
        # its input gradient back (read 2, write 4) and each residual branch's fp32 gradient to
        # bf16 (the branch's output is bf16)
        fwd += (pa + pf) * (s + a) * d
        bwd += (pa + pf) * (s + a) * d + 2 * (s + a) * dl
    # the token mixer
    if mixer in _QWEN35_TRAFFIC:
        mf, mb = _qwen35_mixer(spec, mixer, tp, ab, autocast, seq)
        fwd, bwd = fwd + mf, bwd + mb
    elif mixer == "attention":
        # RoPE x * cos + cat(-x2, x1) * sin on q and k: neg (half), cat, two muls, add = 10
        # elements read + written per rotated element; backward: two muls, neg, the chunk's
        # cat, the sum of the two paths' gradients = 10 again
        roped = (spec.n_heads + spec.n_kv_heads) * spec.rope_dim / tp
        fwd += 10 * a * roped
        bwd += 10 * a * roped
    elif mixer == "mla":  # not derived op by op: RoPE-like traffic on the heads, backward 2x
        m = 4 * (spec.n_heads + spec.n_kv_heads) * spec.qk_dim / tp * a
        fwd, bwd = fwd + m, bwd + 2 * m
    # the feed-forward: SwiGLU silu(w1 x) * w3 x reads 2 writes 1 (silu 1 + 1); backward
    # silu_backward (grad, input -> grad) and two muls (3 each)
    if moe:
        k = spec.top_k
        m = (3 * spec.num_experts + 4 * k * d + 3 * k * spec.expert_hidden / etp + d) * a
        fwd, bwd = fwd + m, bwd + 2 * m
        if spec.shared_hidden:
            fwd += 5 * a * spec.shared_hidden
            bwd += 9 * a * spec.shared_hidden
    else:
        fwd += 5 * a * spec.ffn_hidden / tp
        bwd += 9 * a * spec.ffn_hidden / tp
    return fwd, bwd


def head_elementwise(spec: ModelSpec, tp: int, ab: int, autocast: bool = False):
    """Bytes per token the memory-bound kernels of the head move, forward and backward: the
    final norm, autocast's cast of its output, ``F.cross_entropy(logits.float())`` (the cast,
    log_softmax, nll reading the target's entry; backward: nll's gradient written whole,
    log_softmax's backward, the cast back to bf16) over the rank's ``vocab / tp`` logits
    (NOTE [Element-wise traffic])."""
    d, a, v = spec.dim, ab, spec.vocab_size / tp
    s = 4 if autocast else ab
    target = 8  # int64 target read by nll_loss forward and backward
    fwd = (2 * s * d + _NORM_STAT) / tp + (a + 4) * v + 8 * v + 4 + target
    bwd = 4 * v + target + 12 * v + (4 + a) * v + (3 * s * d + _NORM_STAT) / tp
    if spec.architecture == "qwen3_5":  # its final norm is zero-centred too
        zf, zb = _zero_centred_norm(s)
        fwd, bwd = fwd + zf * d / tp, bwd + zb * d / tp
    if autocast:
        fwd += (s + a) * d
        bwd += (s + a) * d
    return fwd, bwd


# NOTE [Host ops]
# Where the device is the host's own cores (CPU ranks) every aten op's dispatch, the autograd
# engine's work per node and the model's Python add to the step; the planner prices them as
# ops x the calibration's ``host_us_per_op`` (measured by ``hp-plan calibrate`` on hp-trainer's
# own model, on all ranks at once). The counts are the aten ops a ``TorchDispatchMode`` sees in
# one ``LLMTrainer.dry_step`` of hp-trainer's models on the CPU (fp32, torch 2.13) as rank 0 of
# a fake process group of 4 under FSDP, in three parts: forward (autograd's engine not
# running), backward (running), and once per step (gradient clipping, AdamW, ``zero_grad``);
# per block from the difference between 1 and 2 blocks (``tests/unit/test_host_ops.py``
# recounts every one). Per microbatch, forward / backward:
# - a Llama block (attention, RoPE, SwiGLU, two norms) under FSDP: 104 / 199, of which FSDP's
#   hooks (views, copies, splits of the packed parameters and gradients) are 34 / 68;
# - Qwen3's q / k norms add 20 / 48; a MoE feed-forward (router, top-k, permutation, grouped
#   GEMMs, combine) instead of SwiGLU adds 36 / 41, whatever the number of experts;
# - Qwen3.5's gated attention block 140 / 263; its Gated DeltaNet block 256 / 460 plus 29 / 39
#   per 64-token chunk of the delta rule (the recurrence runs chunk by chunk);
# - the rest (embedding, final norm, output, loss): 49 / 51, 3 / 3 fewer with tied embeddings,
#   one more forward op for Qwen3.5's zero-centred final norm; FSDP's root group is 15 / 17.
# Per step: 4 per parameter tensor (clipping's norm and scale, AdamW): a Llama block 36, q / k
# norms 8 more, a MoE feed-forward 8 more than SwiGLU, a gated attention block 44, a Gated
# DeltaNet block 72; the rest 38, 4 fewer with tied embeddings, 3 fewer without FSDP.
# Full recomputation runs the forward's ops again in backward (torch's checkpoint: within 5%),
# selective too (its policy decides what is kept, every op is dispatched again). Under a
# pipeline FSDP's hooks run once a step (UNSHARD, RESHARD), not per microbatch.
# On real gloo ranks a block's backward has 2 more (its reduce-scatter's copy) than on the fake
# group. Not counted yet: MLA (taken as attention), shared experts, DTensor's dispatch under TP,
# the CP ring's steps, expert-parallel dispatch, a pipeline's schedule, DeepSeek's MTP blocks'
# per-step ops; the rest is put on the last stage.
_OPS_BLOCK = (104, 199)
_OPS_QK_NORM = (20, 48)
_OPS_MOE = (36, 41)
_OPS_GATED_ATTENTION = (140, 263)
_OPS_GDN = (256, 460)
_OPS_GDN_CHUNK = (29, 39)
FSDP_OPS = _OPS_FSDP = (34, 68)  # what FSDP's hooks add to a block
_OPS_REST = (49, 51)
_OPS_REST_TIED = (3, 3)  # what tied embeddings take away from the rest
REST_FSDP_OPS = _OPS_REST_FSDP = (15, 17)  # what FSDP's root group adds to the rest
# once per step
_STEP_BLOCK = 36
_STEP_QK_NORM = 8
_STEP_MOE = 8
_STEP_GATED_ATTENTION = 44
_STEP_GDN = 72
_STEP_REST = 38
_STEP_REST_TIED = 4
_STEP_REST_FSDP = 3


def block_ops(
    spec: ModelSpec, kind: tuple[str, bool], seq: int, fsdp: bool = True
) -> tuple[int, int]:
    """Aten ops one block dispatches per microbatch, forward and backward (NOTE [Host ops]);
    ``seq`` is the sequence one rank runs (the delta rule's chunks), ``fsdp`` whether the
    block is an FSDP group."""
    mixer, moe = kind
    if mixer == "gated_attention":
        f, b = _OPS_GATED_ATTENTION
    elif mixer == "linear_attention":
        chunks = -(-seq // GDN_CHUNK)
        f = _OPS_GDN[0] + chunks * _OPS_GDN_CHUNK[0]
        b = _OPS_GDN[1] + chunks * _OPS_GDN_CHUNK[1]
    else:
        f, b = _OPS_BLOCK
        if spec.qk_norm:
            f, b = f + _OPS_QK_NORM[0], b + _OPS_QK_NORM[1]
    if moe:
        f, b = f + _OPS_MOE[0], b + _OPS_MOE[1]
    if not fsdp:
        f, b = f - _OPS_FSDP[0], b - _OPS_FSDP[1]
    return f, b


def block_step_ops(spec: ModelSpec, kind: tuple[str, bool]) -> int:
    """Aten ops of one block's parameters once per step: clipping and AdamW (NOTE [Host
    ops])."""
    mixer, moe = kind
    if mixer == "gated_attention":
        n = _STEP_GATED_ATTENTION
    elif mixer == "linear_attention":
        n = _STEP_GDN
    else:
        n = _STEP_BLOCK + (_STEP_QK_NORM if spec.qk_norm else 0)
    return n + (_STEP_MOE if moe else 0)


def rest_ops(spec: ModelSpec, fsdp: bool = True) -> tuple[int, int]:
    """Aten ops per microbatch outside the blocks (embedding, head, loss), forward and
    backward (NOTE [Host ops]); ``fsdp`` whether the model is sharded."""
    f, b = _OPS_REST
    if spec.tie_word_embeddings:
        f, b = f - _OPS_REST_TIED[0], b - _OPS_REST_TIED[1]
    if spec.architecture == "qwen3_5":
        f += 1
    if not fsdp:
        f, b = f - _OPS_REST_FSDP[0], b - _OPS_REST_FSDP[1]
    return f, b


def rest_step_ops(spec: ModelSpec, fsdp: bool = True) -> int:
    """Aten ops once per step outside the blocks' parameters: the rest's parameters' clipping
    and AdamW, the norm's reduction, ``zero_grad`` (NOTE [Host ops])."""
    n = _STEP_REST
    if spec.tie_word_embeddings:
        n -= _STEP_REST_TIED
    if not fsdp:
        n -= _STEP_REST_FSDP
    return n


def embedding_elementwise(spec: ModelSpec, tp: int, ab: int, autocast: bool = False) -> float:
    """Bytes per token of the embedding's backward (an index-add of the stream-dtype gradient
    rows, reading the int64 token ids); its forward is a lookup (counted with the GEMMs)."""
    return (4 if autocast else ab) * spec.dim / tp + 8


#: bytes per matmul weight element per micro-step under autocast: the fp32 -> bf16 cast in the
#: forward (read 4, write 2; again when a block is recomputed) and its gradient's cast back in
#: the backward (read 2, write 4)
CAST_BYTES = 6
#: bytes per fp32 gradient element of each micro-step after the first (``grad += new``: read
#: 2 x 4, write 4); the first assigns, ``zero_grad(set_to_none=True)`` moves nothing
ACCUMULATE_BYTES = 12


@dataclass(frozen=True)
class LayerWork:
    """One block's forward on one rank for one microbatch.

    ``matmul``, ``attention``, ``grouped`` are FLOPs (dense GEMMs, the attention core, the
    experts' grouped GEMMs); ``elementwise`` / ``elementwise_backward`` bytes moved by the
    memory-bound kernels of the forward / backward (NOTE [Element-wise traffic]); ``tp_gathers``
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
    elementwise_backward: float
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
    spec: ModelSpec,
    kind: tuple[str, bool],
    tokens: int,
    seq: int,
    tp: int,
    etp: int,
    ab: int,
    autocast: bool = False,
    local: int = 0,
) -> LayerWork:
    """The forward of one block of ``kind`` (see :class:`LayerWork`); ``autocast`` as in
    :func:`saved_bytes` (it changes the element-wise traffic only); ``local`` the part of the
    sequence one context-parallel rank runs (default ``seq``), which the per-sequence and
    per-chunk traffic follows."""
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
    # memory-bound kernels (NOTE [Element-wise traffic]): bytes per token, forward / backward
    elem_f, elem_b = block_elementwise(spec, kind, tp, etp, ab, autocast, local or seq)
    moe_elem = 0.0
    if moe:
        k = spec.top_k
        moe_elem = (3 * spec.num_experts + 4 * k * d + 3 * k * spec.expert_hidden / etp + d) * ab
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
        elementwise=t * elem_f,
        elementwise_backward=t * elem_b,
        tp_gathers=gathers,
        tp_scatters=scatters,
        tp_bytes=t * d * ab,
        tp_grad_allreduce=grad_ar,
        cp_bytes=kv_bytes,
        cp_features=h * spec.v_dim / tp if mixer != "linear_attention" else 0.0,
        a2a_bytes=t * spec.top_k * d * ab if moe else 0.0,
        moe_grouped=grouped,
        moe_elementwise=t * moe_elem,
    )
