"""Model configurations: one dataclass for the dense decoder family (Llama 3, Qwen3), the
published sizes by name, tiny ones for tests, and conversion from/to HuggingFace ``config.json``.
Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["CONFIGS", "TransformerConfig", "get_config"]


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

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.dim // self.n_heads

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
        if self.hd % 2:
            problems.append(f"head dimension {self.hd} must be even for rotary embeddings")
        if self.architecture not in ("llama", "qwen3", "qwen3_5"):
            problems.append(
                f"architecture={self.architecture!r}: use 'llama', 'qwen3' or 'qwen3_5'"
            )
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

    def replace(self, **changes) -> TransformerConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count."""
        hd, d = self.hd, self.dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads) + d
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * self.ffn_hidden + (2 * self.ffn_hidden + d if self.mlp_bias else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
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
            layers = sum(gated if t == "full_attention" else linear for t in self.layer_types)
            return layers + self.n_layers * (mlp + 2 * d) + d + (emb if embeddings else 0)
        layer = attn + mlp + 2 * d
        return self.n_layers * layer + d + (emb if embeddings else 0)

    # -- HuggingFace config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, *, max_seq_len: int | None = None) -> TransformerConfig:
        """From a HuggingFace ``config.json`` dict of a supported ``model_type``."""
        mt = hf.get("model_type")
        if mt in ("qwen3_5", "qwen3_5_text"):
            return cls._from_hf_qwen3_5(hf.get("text_config", hf), max_seq_len)
        if mt not in ("llama", "qwen3"):
            raise ConfigError(
                f"config.json model_type={mt!r} is not supported: use a 'llama' or 'qwen3' "
                "checkpoint"
            )
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
            elif kind != "llama3":
                raise ConfigError(
                    f"config.json rope scaling {kind!r} is not supported (only 'llama3')"
                )
        heads = hf["num_attention_heads"]
        return cls(
            architecture=mt,
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
            qk_norm=mt == "qwen3",
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
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
        return cls(
            architecture="qwen3_5",
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=n,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim"),
            ffn_hidden=hf["intermediate_size"],
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
        """A HuggingFace ``config.json`` dict (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``)."""
        if self.architecture == "qwen3_5":
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
        return out


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


def get_config(name: str, **overrides) -> TransformerConfig:
    """A named configuration, optionally with fields overridden."""
    if name not in CONFIGS:
        raise ConfigError(f"model name {name!r} is unknown: use one of {sorted(CONFIGS)}")
    return CONFIGS[name].replace(**overrides) if overrides else CONFIGS[name]
