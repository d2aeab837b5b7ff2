"""Model configurations: one dataclass for the dense decoder family (Llama 3, Qwen3), the
published sizes by name, tiny ones for tests, and conversion from/to HuggingFace ``config.json``.
Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["CONFIGS", "MoEConfig", "TransformerConfig", "get_config"]


ARCHITECTURES = ("llama", "qwen3", "qwen3_5", "deepseek_v3")


def _meta():
    import torch

    return torch.device("meta")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts feed-forward layers of a decoder (``hp_moe.MoE``).

    ``layers`` lists the blocks whose feed-forward is a MoE (the others stay dense); the rest
    are ``hp_moe.MoE``'s arguments: ``hidden_dim`` is each routed expert's width
    (``moe_intermediate_size``), ``shared_hidden_dim`` the shared experts' (None:
    ``hidden_dim * num_shared_experts``)."""

    num_experts: int
    top_k: int
    hidden_dim: int
    layers: tuple[int, ...]
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_expert_gate: bool = False
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    load_balance_coeff: float | None = None
    aux_loss_coeff: float = 0.0
    aux_loss_type: str = "sequence"
    capacity_factor: float | None = None

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer``'s feed-forward is a MoE."""
        return layer in self.layers

    def layer_kwargs(self) -> dict:
        """``hp_moe.MoE`` keyword arguments after ``dim``."""
        return dict(
            hidden_dim=self.hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.num_shared_experts,
            shared_hidden_dim=self.shared_hidden_dim,
            shared_expert_gate=self.shared_expert_gate,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            num_expert_groups=self.num_expert_groups,
            num_limited_groups=self.num_limited_groups,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_coeff=self.aux_loss_coeff,
            aux_loss_type=self.aux_loss_type,
            capacity_factor=self.capacity_factor,
        )

    def num_params(self, dim: int, *, active: bool = False) -> int:
        """Parameters of one MoE layer (``active``: those one token uses)."""
        experts = self.top_k if active else self.num_experts
        shared = self.shared_hidden_dim
        if shared is None:
            shared = self.hidden_dim * self.num_shared_experts
        n = experts * 3 * dim * self.hidden_dim + 3 * dim * shared + self.num_experts * dim
        return n + (dim if self.shared_expert_gate else 0)

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TransformerConfig:
    """A dense decoder-only transformer (pre-norm, RoPE, grouped-query attention, SwiGLU).

    ``qk_norm`` adds Qwen3's per-head RMSNorm on queries and keys; ``rope_scaling`` holds Llama
    3.1's frequency scaling (``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}``) or None.
    """

    architecture: str = "llama"  # "llama" or "qwen3"
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # default dim // n_heads
    ffn_hidden: int = 160
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_seq_len: int = 2048  # length of the precomputed rotary tables
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    # Qwen3.5 (architecture "qwen3_5"): hybrid blocks, partial rotary, gated attention
    layer_types: tuple[str, ...] | None = None  # "linear_attention" / "full_attention" per block
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # mixture-of-experts feed-forward layers (Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3)
    moe: MoEConfig | None = None
    # DeepSeek-V3 (architecture "deepseek_v3"): multi-head latent attention, decoupled RoPE
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # multi-token prediction (DeepSeek-V3): modules after the main stack, and the loss weight
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Dimensions of a head that are rotated (DeepSeek-V3: its decoupled RoPE part)."""
        if self.architecture == "deepseek_v3":
            return self.qk_rope_head_dim
        return int(self.hd * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be at least 1")
        if self.n_heads % max(self.n_kv_heads, 1):
            problems.append(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.dim % max(self.n_heads, 1):
            problems.append(
                f"dim={self.dim} is not a multiple of n_heads={self.n_heads}: set head_dim"
            )
        if self.rope_dim % 2:
            problems.append(f"rotary dimension {self.rope_dim} must be even")
        if self.architecture not in ARCHITECTURES:
            problems.append(
                f"architecture={self.architecture!r}: use one of {', '.join(ARCHITECTURES)}"
            )
        if self.architecture == "deepseek_v3":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    problems.append(f"{name}={getattr(self, name)}: deepseek_v3 needs it >= 1")
            if self.q_lora_rank is not None and self.q_lora_rank < 1:
                problems.append(f"q_lora_rank={self.q_lora_rank}: give None or a positive rank")
        if self.mtp_layers and self.architecture != "deepseek_v3":
            problems.append("mtp_layers: multi-token prediction is DeepSeek-V3's (deepseek_v3)")
        if self.moe is not None:
            bad = [i for i in self.moe.layers if not 0 <= i < self.n_layers]
            if bad:
                problems.append(f"moe.layers {bad} are not blocks of a {self.n_layers}-layer model")
            try:
                from hp_moe import MoE  # its own checks: top_k, groups, score_func, ...

                with _meta():
                    MoE(
                        8,
                        8,
                        **{k: v for k, v in self.moe.layer_kwargs().items() if k != "hidden_dim"},
                    )
            except ValueError as e:
                problems.append(f"moe: {e}")
        if self.architecture == "qwen3_5":
            if self.layer_types is None or len(self.layer_types) != self.n_layers:
                problems.append("qwen3_5 needs layer_types: one entry per layer")
            elif set(self.layer_types) - {"linear_attention", "full_attention"}:
                problems.append(f"layer_types: unknown entries {set(self.layer_types)}")
            if self.linear_num_key_heads < 1 or self.linear_num_value_heads % max(
                self.linear_num_key_heads, 1
            ):
                problems.append(
                    f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                    f"linear_num_key_heads={self.linear_num_key_heads} (>= 1)"
                )
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def replace(self, **changes) -> TransformerConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def num_params(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Parameter count (``active``: those one token uses, for MoE models)."""
        hd, d = self.hd, self.dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads) + d
        if self.qk_norm:
            attn += 2 * hd
        if self.architecture == "deepseek_v3":
            attn = self._mla_params()
        mlp = 3 * d * self.ffn_hidden + (2 * self.ffn_hidden + d if self.mlp_bias else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)

        def ffn(i: int) -> int:
            if self.moe is not None and self.moe.is_moe(i):
                return self.moe.num_params(d, active=active)
            return mlp

        if self.architecture == "qwen3_5":
            gated = attn + d * hd * self.n_heads  # the query projection also yields the gate
            nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
            key, value = nk * self.linear_key_head_dim, nv * self.linear_value_head_dim
            linear = (
                d * (2 * key + 2 * value + 2 * nv)  # q, k, v, z, b, a projections
                + (2 * key + value) * self.linear_conv_kernel  # depthwise convolutions
                + 2 * nv  # A_log, dt_bias
                + self.linear_value_head_dim  # gated norm
                + value * d  # output projection
            )
            mixers = [gated if t == "full_attention" else linear for t in self.layer_types]
        else:
            mixers = [attn] * self.n_layers
        layers = sum(m + ffn(i) + 2 * d for i, m in enumerate(mixers))
        # multi-token prediction: per module two norms, the 2d -> d projection, a block (a MoE
        # block when the main model has MoE layers), the shared head's norm
        last = self.n_layers - 1
        mtp = self.mtp_layers * (3 * d + 2 * d * d + attn + ffn(last) + 2 * d)
        return layers + mtp + d + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) as torchtitan counts them: 6 x the
        parameters one token uses, without the input embedding (the output projection computes
        even when tied, once more per multi-token prediction depth), plus 6 x heads x (query/key
        + value head dims) x ``seq_len`` for the scores and values of each full-attention block
        (MTP's too; Qwen3.5's linear-attention blocks count by their parameters)."""
        n = self.num_params(embeddings=False, active=True)
        n += (1 + self.mtp_layers) * self.vocab_size * self.dim
        types = self.layer_types or ("full_attention",) * self.n_layers
        full = sum(t == "full_attention" for t in types) + self.mtp_layers
        if self.architecture == "deepseek_v3":
            qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk = v = self.hd
        return 6 * n + 6 * full * self.n_heads * (qk + v) * seq_len

    def _mla_params(self) -> int:
        d, h = self.dim, self.n_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
        else:
            q = d * h * qk
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    # -- HuggingFace config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, *, max_seq_len: int | None = None) -> TransformerConfig:
        """From a HuggingFace ``config.json`` dict of a supported ``model_type``."""
        mt = hf.get("model_type")
        if mt in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
            return cls._from_hf_qwen3_5(hf.get("text_config", hf), max_seq_len)
        if mt == "deepseek_v3":
            return cls._from_hf_deepseek_v3(hf, max_seq_len)
        if mt not in ("llama", "qwen3", "qwen3_moe"):
            raise ConfigError(
                f"config.json model_type={mt!r} is not supported: use a llama, qwen3, "
                "qwen3_moe, qwen3_5(_moe) or deepseek_v3 checkpoint"
            )
        theta, scaling = _hf_rope(hf, ("llama3",))
        heads = hf["num_attention_heads"]
        moe = None
        if mt == "qwen3_moe":
            n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
            only = set(hf.get("mlp_only_layers") or ())
            moe = MoEConfig(
                num_experts=hf.get("num_experts") or hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"],
                hidden_dim=hf["moe_intermediate_size"],
                layers=tuple(i for i in range(n) if i not in only and (i + 1) % step == 0),
                score_func="softmax",
                route_norm=hf.get("norm_topk_prob", False),
            )
        return cls(
            architecture="qwen3" if mt == "qwen3_moe" else mt,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim"),
            ffn_hidden=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=max_seq_len or min(hf.get("max_position_embeddings", 2048), 8192),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            moe=moe,
        )

    @classmethod
    def _from_hf_deepseek_v3(cls, hf: dict, max_seq_len: int | None) -> TransformerConfig:
        theta, scaling = _hf_rope(hf, ("yarn",))
        n, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
        freq = hf.get("moe_layer_freq", 1)
        groups = hf.get("n_group") or 1
        moe = MoEConfig(
            num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            hidden_dim=hf["moe_intermediate_size"],
            layers=tuple(i for i in range(k, n) if i % freq == 0),
            num_shared_experts=hf.get("n_shared_experts") or 0,
            score_func=hf.get("scoring_func", "sigmoid"),
            route_norm=hf.get("norm_topk_prob", False),
            route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            num_expert_groups=groups if groups > 1 else None,
            num_limited_groups=hf.get("topk_group") if groups > 1 else None,
            load_balance_coeff=1e-3,  # the correction bias is the expert bias (DeepSeek's 0.001)
        )
        heads = hf["num_attention_heads"]
        return cls(
            architecture="deepseek_v3",
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=n,
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            ffn_hidden=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=max_seq_len or min(hf.get("max_position_embeddings", 2048), 8192),
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            moe=moe,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
            mtp_layers=hf.get("num_nextn_predict_layers", 0),
        )

    @classmethod
    def _from_hf_qwen3_5(cls, hf: dict, max_seq_len: int | None) -> TransformerConfig:
        rope = dict(hf.get("rope_parameters") or {})
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "full_attention"
            if (i + 1) % hf.get("full_attention_interval", 4) == 0
            else "linear_attention"
            for i in range(n)
        ]
        moe = None
        if "num_experts" in hf or "num_local_experts" in hf:  # Qwen3.5-MoE: all MoE blocks
            moe = MoEConfig(
                num_experts=hf.get("num_experts") or hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"],
                hidden_dim=hf["moe_intermediate_size"],
                layers=tuple(range(n)),
                num_shared_experts=1,
                shared_hidden_dim=hf["shared_expert_intermediate_size"],
                shared_expert_gate=True,
                score_func="softmax",
                route_norm=True,
            )
        return cls(
            architecture="qwen3_5",
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=n,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim"),
            ffn_hidden=hf.get("intermediate_size") or hf["moe_intermediate_size"],
            moe=moe,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_seq_len=max_seq_len or min(hf.get("max_position_embeddings", 2048), 8192),
            qk_norm=True,
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            layer_types=tuple(types),
            partial_rotary_factor=rope.get(
                "partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)
            ),
            linear_num_key_heads=hf["linear_num_key_heads"],
            linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"],
            linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        )

    def to_hf(self) -> dict:
        """A HuggingFace ``config.json`` dict that transformers builds the same model from.
        Raises :class:`ConfigError` naming each MoE setting the HuggingFace family cannot
        express (transformers would build a different model); the balancing settings
        (auxiliary loss, the expert bias's update rate, capacity) are training-only and are not
        exported."""
        problems = self._hf_inexpressible()
        if problems:
            raise ConfigError(
                f"to_hf: transformers' {self._hf_family()} cannot express " + "; ".join(problems)
            )
        if self.architecture == "deepseek_v3":
            return self._to_hf_deepseek_v3()
        if self.architecture == "qwen3_5" and self.moe is not None:
            out = self._to_hf_qwen3_5()
            out.pop("intermediate_size")
            out.update(
                architectures=["Qwen3_5MoeForCausalLM"],
                model_type="qwen3_5_moe_text",
                num_experts=self.moe.num_experts,
                num_experts_per_tok=self.moe.top_k,
                moe_intermediate_size=self.moe.hidden_dim,
                shared_expert_intermediate_size=self.moe.shared_hidden_dim,
            )
            return out
        if self.architecture == "qwen3_5":
            return self._to_hf_qwen3_5()
        return self._to_hf_dense()

    def _hf_family(self) -> str:
        if self.architecture == "deepseek_v3":
            return "DeepseekV3"
        if self.moe is None:
            return {"llama": "Llama", "qwen3": "Qwen3", "qwen3_5": "Qwen3_5"}[self.architecture]
        return {"qwen3": "Qwen3Moe", "qwen3_5": "Qwen3_5Moe"}.get(self.architecture, "Llama")

    def _hf_inexpressible(self) -> list[str]:
        """The MoE settings of this configuration its HuggingFace family has no field for."""
        moe = self.moe
        if moe is None:
            if self.architecture == "deepseek_v3":
                return ["a DeepSeek-V3 without MoE layers"]
            return []
        if self.architecture == "llama":
            return ["a Llama with MoE layers (use qwen3 or deepseek_v3)"]
        out = []
        shared = moe.shared_hidden_dim
        if self.architecture == "deepseek_v3":
            if moe.score_func != "sigmoid":
                out.append(f"score_func={moe.score_func!r} (DeepSeek-V3 routes with sigmoid)")
            if shared is not None and shared != moe.hidden_dim * moe.num_shared_experts:
                out.append(
                    f"shared_hidden_dim={shared} (its shared experts are "
                    "n_shared_experts x moe_intermediate_size wide)"
                )
            if moe.shared_expert_gate:
                out.append("shared_expert_gate=True (its shared experts have no gate)")
            return out
        if moe.score_func != "softmax":
            out.append(f"score_func={moe.score_func!r} (Qwen routes with softmax)")
        if moe.route_scale != 1.0:
            out.append(f"route_scale={moe.route_scale} (Qwen does not scale the gates)")
        if moe.num_expert_groups:
            out.append(f"num_expert_groups={moe.num_expert_groups} (no group-limited routing)")
        if self.architecture == "qwen3":
            if moe.num_shared_experts:
                out.append(f"num_shared_experts={moe.num_shared_experts} (Qwen3-MoE has none)")
            return out
        # Qwen3.5-MoE: every block a MoE with one gated shared expert, normalised gates
        if moe.num_shared_experts != 1 or not moe.shared_expert_gate:
            out.append(
                f"num_shared_experts={moe.num_shared_experts}, shared_expert_gate="
                f"{moe.shared_expert_gate} (Qwen3.5-MoE has one gated shared expert)"
            )
        if not moe.route_norm:
            out.append("route_norm=False (Qwen3.5-MoE always normalises the top-k gates)")
        if tuple(moe.layers) != tuple(range(self.n_layers)):
            out.append(f"MoE layers {list(moe.layers)} (Qwen3.5-MoE has a MoE in every block)")
        return out

    def _to_hf_qwen3_5(self) -> dict:
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.hd,
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "max_position_embeddings": self.max_seq_len,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    def _to_hf_dense(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.architecture]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_type": "llama3", "rope_theta": self.rope_theta}
        out = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.hd,
            "intermediate_size": self.ffn_hidden,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_seq_len,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.moe is not None:  # Qwen3-MoE
            out.update(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                num_experts=self.moe.num_experts,
                num_experts_per_tok=self.moe.top_k,
                moe_intermediate_size=self.moe.hidden_dim,
                norm_topk_prob=self.moe.route_norm,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(self.n_layers) if not self.moe.is_moe(i)],
            )
        return out

    def _to_hf_deepseek_v3(self) -> dict:
        moe = self.moe
        dense = [i for i in range(self.n_layers) if not moe.is_moe(i)]
        first_k = len(dense)
        if dense != list(range(first_k)):
            raise ConfigError(
                "to_hf: deepseek_v3 in HuggingFace format keeps its dense layers first "
                f"(first_k_dense_replace); this model has dense layers {dense}: make "
                "moe.layers a suffix of the blocks"
            )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_type": "yarn", "rope_theta": self.rope_theta}
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden,
            "moe_intermediate_size": moe.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "n_shared_experts": moe.num_shared_experts,
            "n_routed_experts": moe.num_experts,
            "routed_scaling_factor": moe.route_scale,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "n_group": moe.num_expert_groups or 1,
            "topk_group": moe.num_limited_groups or 1,
            "num_experts_per_tok": moe.top_k,
            "first_k_dense_replace": first_k,
            "norm_topk_prob": moe.route_norm,
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            # YaRN's extended context (transformers checks it against factor x original)
            "max_position_embeddings": (
                int(
                    self.rope_scaling["factor"]
                    * self.rope_scaling["original_max_position_embeddings"]
                )
                if self.rope_scaling
                else self.max_seq_len
            ),
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.mtp_layers,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }


def _hf_rope(hf: dict, kinds: tuple[str, ...]) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from a config.json (old ``rope_scaling`` or transformers 5's
    ``rope_parameters``); scaling None for plain RoPE, else one of ``kinds``."""
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind not in kinds:
            raise ConfigError(
                f"config.json rope scaling {kind!r} is not supported here (only {kinds})"
            )
        else:
            scaling["rope_type"] = kind
            scaling.pop("type", None)
    return theta, scaling


_L31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_L32 = {**_L31, "factor": 32.0}


def _llama(dim, layers, heads, kv, ffn, scaling=_L31, tie=False, vocab=128256):
    return TransformerConfig(
        "llama",
        vocab,
        dim,
        layers,
        heads,
        kv,
        None,
        ffn,
        1e-5,
        500000.0,
        scaling,
        8192,
        tie_word_embeddings=tie,
    )


def _qwen3(dim, layers, heads, ffn, tie):
    return TransformerConfig(
        "qwen3",
        151936,
        dim,
        layers,
        heads,
        8,
        128,
        ffn,
        1e-6,
        1000000.0,
        None,
        8192,
        qk_norm=True,
        tie_word_embeddings=tie,
    )


def _qwen3_5(dim, layers, heads, kv_heads, ffn, linear_heads, tie):
    """Qwen3.5 dense text model: Gated DeltaNet blocks with gated full attention every fourth,
    head_dim 256, a quarter of each head rotated, vocabulary 248320."""
    return TransformerConfig(
        "qwen3_5",
        248320,
        dim,
        layers,
        heads,
        kv_heads,
        256,
        ffn,
        1e-6,
        10000000.0,
        None,
        8192,
        qk_norm=True,
        tie_word_embeddings=tie,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (layers // 4),
        partial_rotary_factor=0.25,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )


def _qwen3_moe(dim, layers, heads, ffn, moe_hidden):
    """Qwen3-MoE: Qwen3 attention (``heads`` query heads of 128 and 4 key/value heads, as
    published) with every block's feed-forward a MoE of 128 experts, top-8, normalised gates."""
    return _qwen3(dim, layers, heads, ffn, False).replace(
        n_kv_heads=4,
        moe=MoEConfig(
            num_experts=128,
            top_k=8,
            hidden_dim=moe_hidden,
            layers=tuple(range(layers)),
            route_norm=True,
        ),
    )


_YARN_V3 = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek(
    vocab, dim, layers, heads, ffn, moe: MoEConfig, q_lora, kv_lora, nope, rope, v, yarn, mtp
):
    return TransformerConfig(
        "deepseek_v3",
        vocab,
        dim,
        layers,
        heads,
        heads,
        nope + rope,
        ffn,
        1e-6,
        10000.0,
        yarn,
        8192,
        moe=moe,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=True,
        mtp_layers=mtp,
    )


def _deepseek_moe(layers, first_dense, experts, top_k, hidden, shared, **kw) -> MoEConfig:
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        hidden_dim=hidden,
        layers=tuple(range(first_dense, layers)),
        num_shared_experts=shared,
        **kw,
    )


_V3_ROUTING = dict(
    score_func="sigmoid",
    route_norm=True,
    route_scale=2.5,
    num_expert_groups=8,
    num_limited_groups=4,
    load_balance_coeff=1e-3,
)

#: Published configurations (HuggingFace ``config.json`` values) and tiny ones for tests/demos.
CONFIGS: dict[str, TransformerConfig] = {
    "llama3-8b": _llama(4096, 32, 32, 8, 14336),
    "llama3-70b": _llama(8192, 80, 64, 8, 28672),
    "llama3-405b": _llama(16384, 126, 128, 8, 53248),
    "llama3.2-1b": _llama(2048, 16, 32, 8, 8192, _L32, tie=True),
    "llama3.2-3b": _llama(3072, 28, 24, 8, 8192, _L32, tie=True),
    "llama3-tiny": TransformerConfig(
        "llama",
        256,
        64,
        2,
        4,
        2,
        None,
        160,
        1e-5,
        500000.0,
        _L31 | {"original_max_position_embeddings": 64},
        256,
    ),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
    # Qwen3.5-0.8B(-Base) text model: 24 blocks of width 1024 (8 query / 2 key-value heads of
    # 256, feed-forward 3584, tied embeddings), Gated DeltaNet with 16 heads of 128
    "qwen3.5-0.8b": _qwen3_5(1024, 24, 8, 2, 3584, (16, 16), True),
    # Qwen3.5-9B: transformers' Qwen3_5TextConfig defaults, documented there as this model's
    "qwen3.5-9b": _qwen3_5(4096, 32, 16, 4, 12288, (16, 32), False),
    # Qwen3-30B-A3B and Qwen3-235B-A22B: 128 experts, top-8, every block a MoE
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 6144, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 12288, 1536),
    # DeepSeek-V3 (671B, 37B active): MLA with q/kv low-rank projections, 3 dense blocks then
    # 58 MoE blocks of 256 routed experts (top-8 of 4 of 8 groups) and one shared, one MTP module
    "deepseek-v3-671b": _deepseek(
        129280,
        7168,
        61,
        128,
        18432,
        _deepseek_moe(61, 3, 256, 8, 2048, 1, **_V3_ROUTING),
        1536,
        512,
        128,
        64,
        128,
        _YARN_V3,
        1,
    ),
    # DeepSeek-V2-Lite (16B, 2.4B active): no query compression, softmax routing over 64
    # experts (top-6) and 2 shared, the first block dense
    "deepseek-v2-lite": _deepseek(
        102400,
        2048,
        27,
        16,
        10944,
        _deepseek_moe(27, 1, 64, 6, 1408, 2, score_func="softmax"),
        None,
        512,
        128,
        64,
        128,
        {**_YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707},
        0,
    ),
    # about 1B active parameters for one GPU: DeepSeek-V3's shape scaled down
    "deepseek-v3-1b": _deepseek(
        129280,
        1536,
        16,
        16,
        6144,
        _deepseek_moe(16, 1, 64, 6, 640, 2, **{**_V3_ROUTING, "route_scale": 1.0}),
        768,
        256,
        64,
        32,
        64,
        _YARN_V3,
        1,
    ),
    # Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults, documented as this model's
    "qwen3.5-35b-a3b": _qwen3_5(2048, 40, 16, 2, 512, (16, 32), False).replace(
        moe=MoEConfig(
            num_experts=256,
            top_k=8,
            hidden_dim=512,
            layers=tuple(range(40)),
            num_shared_experts=1,
            shared_hidden_dim=512,
            shared_expert_gate=True,
            route_norm=True,
        )
    ),
    "qwen3-tiny": TransformerConfig(
        "qwen3",
        256,
        64,
        2,
        4,
        2,
        32,
        160,
        1e-6,
        1000000.0,
        None,
        256,
        qk_norm=True,
        tie_word_embeddings=True,
    ),
    "qwen3.5-tiny": TransformerConfig(
        "qwen3_5",
        256,
        64,
        4,
        4,
        2,
        16,
        160,
        1e-6,
        10000000.0,
        None,
        256,
        qk_norm=True,
        tie_word_embeddings=True,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}
_TINY_MOE = MoEConfig(num_experts=8, top_k=2, hidden_dim=32, layers=(0, 1), route_norm=True)
CONFIGS["qwen3-moe-tiny"] = CONFIGS["qwen3-tiny"].replace(tie_word_embeddings=False, moe=_TINY_MOE)
CONFIGS["qwen3.5-moe-tiny"] = CONFIGS["qwen3.5-tiny"].replace(
    tie_word_embeddings=False,
    moe=_TINY_MOE.replace(
        layers=(0, 1, 2, 3), num_shared_experts=1, shared_hidden_dim=48, shared_expert_gate=True
    ),
)
CONFIGS["deepseek-v3-tiny"] = _deepseek(
    256,
    64,
    3,
    4,
    160,
    _deepseek_moe(
        3, 1, 8, 2, 32, 1, **{**_V3_ROUTING, "num_expert_groups": 4, "num_limited_groups": 2}
    ),
    24,
    16,
    16,
    8,
    16,
    {**_YARN_V3, "original_max_position_embeddings": 64},
    1,
).replace(max_seq_len=256)


def get_config(name: str, **overrides) -> TransformerConfig:
    """A named configuration, optionally with fields overridden."""
    if name not in CONFIGS:
        raise ConfigError(f"model name {name!r} is unknown: use one of {sorted(CONFIGS)}")
    return CONFIGS[name].replace(**overrides) if overrides else CONFIGS[name]
