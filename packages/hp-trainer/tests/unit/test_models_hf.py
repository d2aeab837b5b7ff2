"""Our Llama 3 and Qwen3 against HuggingFace transformers with the same tiny random weights:
logits within 1e-5 (fp32), loading their checkpoint and writing one they load."""

import json

import pytest
import torch

from hp_trainer.errors import ConfigError
from hp_trainer.models import (
    CONFIGS,
    Transformer,
    TransformerConfig,
    from_pretrained,
    get_config,
    hf_name,
    our_name,
)

LLAMA = dict(
    model_type="llama",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
QWEN3 = dict(
    model_type="qwen3",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # not hidden_size / heads, as in the published Qwen3 models
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def _hf_model(kind, **over):
    import transformers

    cfg = dict(LLAMA if kind == "llama" else QWEN3, **over)
    mt = cfg.pop("model_type")
    conf_cls = transformers.LlamaConfig if mt == "llama" else transformers.Qwen3Config
    model_cls = transformers.LlamaForCausalLM if mt == "llama" else transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = model_cls(conf_cls(**cfg)).eval()
    with torch.no_grad():  # HF initialises norms to one: perturb them so the test sees them
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_both_ways(tmp_path, kind, tied):
    import transformers

    hf = _hf_model(kind, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert ours.config.architecture == kind and ours.config.tie_word_embeddings == tied
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
    # and back: our save_pretrained loads in transformers
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, rtol=1e-5, atol=1e-5)
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["tie_word_embeddings"] == tied


def test_bf16_from_pretrained_keeps_fp32_rotary_tables(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path / "hf")
    m = from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert m.tok_embeddings.weight.dtype == torch.bfloat16 and m.rope_cos.dtype == torch.float32
    assert m(torch.randint(0, 97, (1, 8))).dtype == torch.bfloat16


def test_name_maps_are_inverse():
    for name in Transformer(get_config("qwen3-tiny")).state_dict():
        assert our_name(hf_name(name)) == name
    with pytest.raises(ConfigError, match="'lm_head.bias' has no"):
        our_name("lm_head.bias")


def test_published_sizes():
    # parameter counts of the published checkpoints (billions, as named)
    expected = {
        "llama3-8b": 8.03,
        "llama3-70b": 70.6,
        "llama3-405b": 405.9,
        "llama3.2-1b": 1.24,
        "llama3.2-3b": 3.21,
        "qwen3-0.6b": 0.596,
        "qwen3-1.7b": 1.72,
        "qwen3-4b": 4.02,
        "qwen3-8b": 8.19,
        "qwen3-14b": 14.77,
        "qwen3-32b": 32.76,
    }
    for name, billions in expected.items():
        got = CONFIGS[name].num_params() / 1e9
        assert abs(got - billions) / billions < 0.01, (name, got)


def test_config_errors():
    with pytest.raises(ConfigError, match="n_heads=6 is not a multiple of n_kv_heads=4"):
        TransformerConfig(n_heads=6, n_kv_heads=4, dim=48)
    with pytest.raises(ConfigError, match="model name 'llama9' is unknown"):
        get_config("llama9")
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        TransformerConfig.from_hf({"model_type": "gpt2"})
    m = Transformer(get_config("llama3-tiny", max_seq_len=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's max_seq_len=8"):
        m(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name", ["llama3-tiny", "qwen3-tiny"])
def test_flops_per_token_is_torchtitans(name):
    """Dense models: torchtitan's own count (6 x matmul parameters + the attention term) on
    the same module; tied embeddings count once, as the output projection."""
    utils = pytest.importorskip("torchtitan.models.utils")
    cfg = get_config(name)
    model = Transformer(cfg)
    _, expected = utils.get_dense_model_nparams_and_flops(
        model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dims=2 * cfg.hd,
        seq_len=128,
        enable_weight_tying=cfg.tie_word_embeddings,
    )
    assert cfg.flops_per_token(128) == expected


def test_moe_flops_per_token_counts_active_experts_and_mtp():
    cfg = get_config("deepseek-v3-tiny")
    d, v, h = cfg.dim, cfg.vocab_size, cfg.n_heads
    qk, vd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    active = cfg.num_params(embeddings=False, active=True)
    # the MTP depth runs the output head and one more full-attention block
    expected = 6 * (active + 2 * v * d) + 6 * (cfg.n_layers + 1) * h * (qk + vd) * 64
    assert cfg.flops_per_token(64) == expected
    experts = cfg.moe
    full = cfg.replace(moe=experts.replace(top_k=4))
    assert full.flops_per_token(64) > cfg.flops_per_token(64)  # only the chosen experts count
