"""Model specifications: the numbers the cost models need, read from hp-trainer's model registry
(``hp_trainer.models.CONFIGS``) and split the way the trainer's parallel styles split them.

A :class:`ModelSpec` is a frozen value of plain numbers; nothing here imports torch. Only
:func:`model_spec` reaches hp-trainer (imported on call), through its public
``hp_trainer.models.get_config`` / ``CONFIGS``.

Parameter counts are exact: ``ModelSpec.num_params()`` equals the parameter count of
``hp_trainer.models.Transformer`` built from the same configuration (the tests build tiny and
published ones on the meta device and compare). Each block's parameters are split three ways,
as ``hp_trainer.parallelize_llama`` places them (NOTE [Parameter classes]).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import PlanError, PlanTypeError, UnknownModelError, nearest

__all__ = ["LayerParams", "ModelSpec", "known_models", "model_spec"]

# NOTE [Parameter classes]
# ``tp``: split over the tensor-parallel ranks (column / row parallel projections, the
#   embedding's and output's vocabulary rows, MLA's head projections, Gated DeltaNet's head
#   vectors and convolutions); then sharded by FSDP over dp_shard x cp.
# ``replicated``: whole on every tensor-parallel rank (norm scales, per-head q/k norms, a row
#   projection's bias, MLA's latent down-projections and their norms, a MoE's router, its shared
#   experts and their gate: the MoE runs on the whole sequence on each tp rank); FSDP shards them
#   over dp_shard x cp.
# ``experts``: a MoE's routed experts (``GroupedExperts``), split over ep x etp and sharded by
#   FSDP over the experts' data-parallel ranks (see ``_memory.expert_shards``).


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one block by how the trainer places them (NOTE [Parameter classes])."""

    tp: int
    replicated: int
    experts: int

    @property
    def total(self) -> int:
        """All parameters of the block."""
        return self.tp + self.replicated + self.experts

    def __add__(self, other: LayerParams) -> LayerParams:
        return LayerParams(
            self.tp + other.tp, self.replicated + other.replicated, self.experts + other.experts
        )


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shape, as the planner needs it (the fields of
    ``hp_trainer.models.TransformerConfig`` that size parameters, FLOPs and activations).

    ``architecture`` is ``"llama"``, ``"qwen3"``, ``"qwen3_5"`` or ``"deepseek_v3"``.
    ``moe_layers`` lists the blocks whose feed-forward is a mixture of ``num_experts`` experts
    of width ``expert_hidden`` (``top_k`` per token) plus shared experts of total width
    ``shared_hidden``. The MLA fields (``kv_lora_rank``, ...) are DeepSeek-V3's, the
    ``linear_*`` fields Qwen3.5's Gated DeltaNet's; ``mtp_layers`` counts DeepSeek-V3's
    multi-token prediction modules; ``partial_rotary_factor`` is the share of a head RoPE
    rotates (Qwen3.5's gated attention: a quarter).

    Example::

        spec = model_spec("llama3-70b")
        spec.num_params()          # 70553706496, as hp_trainer counts it
        spec.layer_params(0).tp    # the block's tensor-parallel parameters
    """

    name: str
    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    shared_hidden: int = 0
    shared_expert_gate: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    mtp_layers: int = 0
    partial_rotary_factor: float = 1.0

    # -- structure ----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        """Whether some block's feed-forward is a MoE."""
        return bool(self.moe_layers)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether block ``layer``'s feed-forward is a MoE."""
        return layer in self.moe_layers

    def mixer(self, layer: int) -> str:
        """Block ``layer``'s token mixer: ``"attention"`` (Llama/Qwen3 GQA), ``"mla"``
        (DeepSeek-V3), ``"gated_attention"`` or ``"linear_attention"`` (Qwen3.5)."""
        if self.architecture == "deepseek_v3":
            return "mla"
        if self.architecture == "qwen3_5":
            kind = self.layer_types[layer]
            return "gated_attention" if kind == "full_attention" else "linear_attention"
        return "attention"

    @property
    def qk_dim(self) -> int:
        """Query/key width of one head (DeepSeek: its non-rotated plus rotated parts)."""
        if self.architecture == "deepseek_v3":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        """Rotated dimensions of a head: the first ``partial_rotary_factor`` of it (Qwen3.5),
        DeepSeek-V3's decoupled RoPE part."""
        if self.architecture == "deepseek_v3":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def v_dim(self) -> int:
        """Value width of one head."""
        return self.v_head_dim if self.architecture == "deepseek_v3" else self.head_dim

    # -- parameters ---------------------------------------------------------------------------
    def mixer_params(self, layer: int) -> LayerParams:
        """The token mixer's parameters of block ``layer`` (its two norms included)."""
        d, h, kv, hd = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        norms = 2 * d  # attention_norm, ffn_norm (zero-centred in Qwen3.5: same size)
        kind = self.mixer(layer)
        if kind == "mla":
            qk = self.qk_dim
            bias = self.attention_bias
            if self.q_lora_rank:
                ql = self.q_lora_rank
                split = ql * h * qk  # wq_b
                repl = d * ql + (ql if bias else 0) + ql  # wq_a (+ bias), q_norm
            else:
                split, repl = d * h * qk, 0  # wq
            lat = self.kv_lora_rank + self.qk_rope_head_dim
            repl += d * lat + (lat if bias else 0) + self.kv_lora_rank  # wkv_a, kv_norm
            split += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)  # wkv_b
            split += h * self.v_head_dim * d  # wo
            repl += d if bias else 0  # wo's bias
            return LayerParams(split, repl + norms, 0)
        if kind == "linear_attention":
            nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
            key, value = nk * self.linear_key_head_dim, nv * self.linear_value_head_dim
            split = d * (2 * key + 2 * value + 2 * nv)  # q, k, v, z, b, a projections
            split += (2 * key + value) * self.linear_conv_kernel  # depthwise convolutions
            split += 2 * nv  # A_log, dt_bias (head vectors)
            split += value * d  # out_proj
            repl = self.linear_value_head_dim  # the gated output norm
            return LayerParams(split, repl + norms, 0)
        q_rows = 2 * h if kind == "gated_attention" else h  # Qwen3.5: query and gate rows
        split = d * hd * (q_rows + 2 * kv) + h * hd * d
        repl = 0
        if self.attention_bias:
            split += hd * (q_rows + 2 * kv)
            repl += d
        if self.qk_norm:
            repl += 2 * hd
        return LayerParams(split, repl + norms, 0)

    def ffn_params(self, layer: int) -> LayerParams:
        """The feed-forward's parameters of block ``layer`` (dense SwiGLU or MoE)."""
        d = self.dim
        if self.layer_is_moe(layer):
            repl = self.num_experts * d  # router
            repl += 3 * d * self.shared_hidden  # shared experts
            repl += d if self.shared_expert_gate else 0
            return LayerParams(0, repl, 3 * d * self.expert_hidden * self.num_experts)
        f = self.ffn_hidden
        split = 3 * d * f + (2 * f if self.mlp_bias else 0)
        return LayerParams(split, d if self.mlp_bias else 0, 0)

    def layer_params(self, layer: int) -> LayerParams:
        """All parameters of block ``layer``."""
        return self.mixer_params(layer) + self.ffn_params(layer)

    def embedding_params(self) -> int:
        """The token embedding (vocabulary rows split over tp)."""
        return self.vocab_size * self.dim

    def head_params(self) -> LayerParams:
        """The final norm and the output projection (nothing more when tied to the
        embedding)."""
        out = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return LayerParams(out, self.dim, 0)

    def mtp_params(self) -> LayerParams:
        """DeepSeek-V3's multi-token prediction modules: per depth two input norms, the
        ``2 d -> d`` projection, one block like the last one, and an output norm (the head is
        the main model's)."""
        if not self.mtp_layers:
            return LayerParams(0, 0, 0)
        d = self.dim
        block = self.layer_params(self.n_layers - 1)
        per = LayerParams(block.tp, block.replicated + 3 * d + 2 * d * d, block.experts)
        return LayerParams(
            per.tp * self.mtp_layers,
            per.replicated * self.mtp_layers,
            per.experts * self.mtp_layers,
        )

    def num_params(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Parameter count, as ``hp_trainer``'s ``TransformerConfig.num_params`` counts it
        (``embeddings=False`` leaves out the embedding and the untied output projection;
        ``active``: the routed experts a token uses, ``top_k`` of ``num_experts``)."""
        total = 0
        for i in range(self.n_layers):
            total += self._counted(self.layer_params(i), active)
        total += self._counted(self.mtp_params(), active)
        head = self.head_params()
        total += head.replicated  # final norm
        if embeddings:
            total += self.embedding_params() + head.tp
        return total

    def _counted(self, p: LayerParams, active: bool) -> int:
        experts = p.experts
        if active and experts:
            experts = experts // self.num_experts * self.top_k
        return p.tp + p.replicated + experts

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token by hp-trainer's (torchtitan's) convention, the one its MFU
        uses: 6 x the parameters a token uses without the embeddings, plus the output
        projection once per prediction depth, plus 6 x heads x (qk + v head dims) x
        ``seq_len`` per full-attention block (MTP's included)."""
        n = self.num_params(embeddings=False, active=True)
        n += (1 + self.mtp_layers) * self.vocab_size * self.dim
        full = sum(self.mixer(i) != "linear_attention" for i in range(self.n_layers))
        full += self.mtp_layers
        return 6.0 * n + 6.0 * full * self.n_heads * (self.qk_dim + self.v_dim) * seq_len


def known_models() -> list[str]:
    """The model names of hp-trainer's registry (``hp_trainer.models.CONFIGS``), sorted."""
    from hp_trainer.models import CONFIGS

    return sorted(CONFIGS)


def model_spec(name: str, *, mtp_layers: int | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``hp_trainer.models.CONFIGS[name]`` (``mtp_layers``
    overrides DeepSeek-V3's multi-token prediction depth, as hp-train's ``model.mtp_layers``
    does). Raises :class:`UnknownModelError` naming the nearest known name."""
    if not isinstance(name, str):
        raise PlanTypeError(f"model_spec: name={name!r} is a {type(name).__name__}: give a str")
    from hp_trainer.models import CONFIGS

    if name not in CONFIGS:
        hint = nearest(name, CONFIGS)
        did = f"did you mean {hint!r}? " if hint else ""
        raise UnknownModelError(
            f"--model {name!r} is not a model of hp-trainer's registry: {did}"
            f"known models: {', '.join(sorted(CONFIGS))}"
        )
    cfg = CONFIGS[name]
    if mtp_layers is not None and mtp_layers != cfg.mtp_layers:
        from hp_trainer import ConfigError

        try:
            cfg = cfg.replace(mtp_layers=mtp_layers)
        except ConfigError as e:
            raise PlanError(
                f"--mtp-layers {mtp_layers} with --model {name!r}: only deepseek_v3 models "
                f"have multi-token prediction layers: drop --mtp-layers ({e})"
            ) from None
    return spec_from_config(cfg, name=name)


def spec_from_config(cfg, *, name: str) -> ModelSpec:
    """A :class:`ModelSpec` from an ``hp_trainer.models.TransformerConfig`` (read by
    attribute; nothing is imported)."""
    moe = cfg.moe
    kw = {}
    if moe is not None:
        shared = moe.shared_hidden_dim
        if shared is None:
            shared = moe.hidden_dim * moe.num_shared_experts
        kw = dict(
            moe_layers=tuple(sorted(moe.layers)),
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            expert_hidden=moe.hidden_dim,
            shared_hidden=shared,
            shared_expert_gate=moe.shared_expert_gate,
        )
    copied = {
        f.name: getattr(cfg, f.name)
        for f in fields(ModelSpec)
        if f.name not in ("name", "head_dim") and f.name not in kw and hasattr(cfg, f.name)
    }
    if copied.get("layer_types") is not None:
        copied["layer_types"] = tuple(copied["layer_types"])
    return ModelSpec(name=name, head_dim=cfg.hd, **copied, **kw)
