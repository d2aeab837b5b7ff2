"""The MoE families against transformers with tiny random weights: Qwen3-MoE, DeepSeek-V3
(with and without query compression, group-limited sigmoid routing with its correction bias,
YaRN, interleaved RoPE) and Qwen3.5-MoE give transformers' logits (fp32) after from_pretrained
of a folder transformers saved, and a folder we save loads back in transformers; DeepSeek-V3's
multi-token prediction equals its definition; published sizes."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from hp_trainer.errors import ConfigError
from hp_trainer.models import CONFIGS, Transformer, from_pretrained, get_config, hf_name, our_name

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 97


def _perturb(model, seed):
    """Random weights everywhere (transformers initialises norms to one, biases to zero and
    leaves expert tensors to its init): every tensor's mapping is then seen by the test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.05 * torch.rand(b.shape, generator=g))
    return model


def _roundtrip(tmp_path, hf, arch, moe_layers, seq=24, tol=TOL):
    hf.eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert ours.config.architecture == arch
    assert ours.config.moe is not None and ours.config.moe.layers == moe_layers
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 1e-5, rel
    torch.testing.assert_close(got, expected, **tol)
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, **TOL)
    return ours, ids


def test_qwen3_moe(tmp_path):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = _perturb(transformers.Qwen3MoeForCausalLM(cfg), 0)
    ours, ids = _roundtrip(tmp_path, hf, "qwen3", (0, 2))
    assert hasattr(ours.layers["1"], "feed_forward") and hasattr(ours.layers["0"], "moe")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and saved["mlp_only_layers"] == [1]
    # auxiliary-loss-free balancing on a Qwen checkpoint: our expert bias (Qwen stores none)
    # starts at zero and exports while it is; once it moved, the export is refused
    moe = ours.config.moe.replace(load_balance_coeff=1e-3)
    biased = from_pretrained(tmp_path / "hf", config=ours.config.replace(moe=moe)).eval()
    assert biased.layers["0"].moe.expert_bias.abs().sum() == 0
    with torch.no_grad():
        torch.testing.assert_close(biased(ids), ours(ids), rtol=0, atol=0)
    biased.save_pretrained(tmp_path / "biased")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "biased").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, biased(ids), **TOL)
    biased.layers["2"].moe.expert_bias[0] = 0.1
    with pytest.raises(ConfigError, match="layers.2.moe.expert_bias is not zero"):
        biased.save_pretrained(tmp_path / "moved")
    assert not (tmp_path / "moved").exists()  # refused before writing anything


def test_to_hf_refuses_what_transformers_cannot_express():
    cases = [
        (get_config("deepseek-v2-lite"), "DeepseekV3 cannot express score_func='softmax'"),
        (
            get_config("deepseek-v3-tiny").replace(
                moe=get_config("deepseek-v3-tiny").moe.replace(shared_expert_gate=True)
            ),
            "shared_expert_gate=True",
        ),
        (
            get_config("qwen3-moe-tiny").replace(
                moe=get_config("qwen3-moe-tiny").moe.replace(num_shared_experts=1)
            ),
            "Qwen3Moe cannot express num_shared_experts=1",
        ),
        (
            get_config("qwen3-moe-tiny").replace(
                moe=get_config("qwen3-moe-tiny").moe.replace(route_scale=2.0)
            ),
            "route_scale=2.0",
        ),
        (
            get_config("qwen3.5-moe-tiny").replace(
                moe=get_config("qwen3.5-moe-tiny").moe.replace(route_norm=False, layers=(0, 1))
            ),
            r"route_norm=False .*; MoE layers \[0, 1\]",
        ),
    ]
    for cfg, match in cases:
        with pytest.raises(ConfigError, match=match):
            cfg.to_hf()
    for name in ("deepseek-v3-tiny", "qwen3-moe-tiny", "qwen3.5-moe-tiny", "deepseek-v3-671b"):
        get_config(name).to_hf()  # the shipped ones are expressible


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_deepseek_v3(tmp_path, q_lora_rank):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=10,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    )
    torch.manual_seed(0)
    hf = _perturb(transformers.DeepseekV3ForCausalLM(cfg), 1)
    ours, ids = _roundtrip(tmp_path, hf, "deepseek_v3", (1, 2), seq=40)  # beyond 16: YaRN
    assert ours.config.rope_interleave  # MTP modules: none in the folder, kept initialised
    assert (q_lora_rank is None) == hasattr(ours.layers["0"].attention, "wq")


def test_qwen3_5_moe(tmp_path):
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    hf = _perturb(transformers.Qwen3_5MoeForCausalLM(cfg), 2)
    # the Gated DeltaNet's output leaves our rule row-major and transformers' column-major (its
    # zeros_like of the triangular solve's output), so the fp32 norms after it round
    # differently: 1.7e-5 apart at most (logits up to 3.3; with our rule's output laid out as
    # transformers' it was 6.9e-6); against our model run in fp64 our fp32 logits are 2.0e-5
    # off, transformers' 3.7e-5
    ours, ids = _roundtrip(tmp_path, hf, "qwen3_5", (0, 1, 2, 3), tol=dict(rtol=1e-5, atol=5e-5))
    assert ours.layers["0"].moe.shared_expert_gate is not None


def _mtp_by_hand(model, tokens):
    """DeepSeek-V3 report, section 2.2, written out: h^0 the main stack's last hidden states
    after its final norm (Megatron-Core's and vLLM's input to the MTP module); h^k_i =
    norm_k(TRM_k(M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)])) over the positions that
    have a later token; loss = weight / D * sum_k CE(OutHead(h^k_i), t_{i+k+1})."""
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, model.rope_cos, model.rope_sin)
    prev = model.norm(h)
    logits = model.output(prev)
    t = tokens.shape[1]
    total = 0.0
    for k, m in enumerate(model.mtp, start=1):
        emb = model.tok_embeddings(tokens[:, k:])
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(prev[:, : t - k])], -1))
        prev = m.norm(m.block(x, model.rope_cos, model.rope_sin))
        pred = model.output(prev)[:, :-1]
        total = total + F.cross_entropy(pred.reshape(-1, VOCAB), tokens[:, k + 1 :].reshape(-1))
    return logits, model.config.mtp_loss_weight / len(model.mtp) * total


@pytest.mark.parametrize("depths", [1, 2])
def test_multi_token_prediction_equals_its_definition(depths):
    cfg = get_config("deepseek-v3-tiny", vocab_size=VOCAB, mtp_layers=depths, mtp_loss_weight=0.3)
    torch.manual_seed(3)
    model = Transformer(cfg).train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    logits = model(tokens)
    main = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    main.backward()  # the MTP loss's gradient comes attached to the logits
    ref_logits, mtp = _mtp_by_hand(ref, tokens)
    ref_main = F.cross_entropy(ref_logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    (ref_main + mtp).backward()
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(model.mtp_loss, mtp.detach(), **TOL)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)
    assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():  # evaluation: no MTP
        torch.testing.assert_close(model(tokens), ref_logits.detach(), **TOL)


def test_mtp_names_follow_the_main_blocks():
    cfg = get_config("deepseek-v3-tiny")
    sd = Transformer(cfg).state_dict()
    for name in sd:
        key = f"{name}.3" if ".experts.w" in name else name
        assert our_name(hf_name(key, cfg), cfg) == key
    assert hf_name("mtp.0.eh_proj.weight", cfg) == "model.layers.3.eh_proj.weight"
    assert hf_name("mtp.0.norm.weight", cfg) == "model.layers.3.shared_head.norm.weight"
    assert hf_name("mtp.0.block.moe.experts.w2.5", cfg) == (
        "model.layers.3.mlp.experts.5.down_proj.weight"
    )


def test_published_moe_sizes():
    # total parameters of the published checkpoints (billions)
    expected = {
        "qwen3-30b-a3b": 30.5,
        "qwen3-235b-a22b": 235.1,
        "qwen3.5-35b-a3b": 35.0,
        "deepseek-v2-lite": 15.7,
    }
    for name, billions in expected.items():
        got = CONFIGS[name].num_params() / 1e9
        assert abs(got - billions) / billions < 0.01, (name, got)
    # DeepSeek-V3: 671B in the main model, 685B with its MTP module as published on the Hub
    v3 = CONFIGS["deepseek-v3-671b"]
    assert abs(v3.replace(mtp_layers=0).num_params() / 1e9 - 671) / 671 < 0.01
    assert abs(v3.num_params() / 1e9 - 685) / 685 < 0.01
    active = {"qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22.0}
    for name, billions in active.items():
        got = CONFIGS[name].num_params(active=True) / 1e9
        assert abs(got - billions) / billions < 0.02, (name, got)
    assert 0.8 < CONFIGS["deepseek-v3-1b"].num_params(active=True) / 1e9 < 1.2


def test_buffers_after_to_empty_and_a_dtype_cast():
    """Built on the meta device (as from_pretrained does), init_weights leaves no garbage in
    the MTP loss sum and the MoE statistics; after a bf16 cast the sums stay float32."""
    with torch.device("meta"):
        model = Transformer(get_config("deepseek-v3-tiny"))
    model.to_empty(device="cpu")
    model.mtp_loss.fill_(123.0)
    model.layers["1"].moe.tokens_per_expert.fill_(7.0)
    model.init_weights(torch.device("cpu"))
    assert model.mtp_loss.item() == 0 and model.layers["1"].moe.tokens_per_expert.sum() == 0
    model.to(torch.bfloat16)
    model.init_buffers(torch.device("cpu"))
    assert model.mtp_loss.dtype == torch.float32
    assert model.layers["1"].moe.tokens_per_expert.dtype == torch.float32
