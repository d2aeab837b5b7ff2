"""MoE equals transformers' DeepseekV3MoE and Qwen3MoeSparseMoeBlock, forward and backward."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moe_helpers import hf_grads, load_from_hf  # noqa: E402

from hp_moe import MoE  # noqa: E402

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-5, atol=1e-5)
H, INTER, E, K = 32, 16, 8, 3


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _compare(ours, hf, x):
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    out = ours(x1)
    ref = hf(x2)
    torch.testing.assert_close(out, ref, **TOL)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    grads = hf_grads(hf)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], **TOL, msg=name)
    assert set(grads) == {n for n, _ in ours.named_parameters()}


@pytest.mark.parametrize(
    "n_group,topk_group,norm,scale,shared,bias",
    [
        (4, 2, True, 2.5, 1, True),  # DeepSeek-V3: sigmoid, groups, norm, scale, shared, bias
        (1, 1, False, 1.0, 0, False),  # plain sigmoid top-k
        (2, 1, True, 1.0, 2, True),  # one group of four kept
        (4, 4, False, 0.5, 1, False),  # every group kept: the same as no limit
    ],
)
def test_deepseek_v3_moe(n_group, topk_group, norm, scale, shared, bias):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=INTER,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=max(shared, 1),
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    hf = DeepseekV3MoE(cfg)
    _init(hf, 0)
    if not shared:
        hf.shared_experts = None
        hf.forward = _no_shared_forward(hf)
    if bias:
        with torch.no_grad():  # positive scores + bias: the masked groups stay out of the top-k
            hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, E))
    groups = dict(num_expert_groups=n_group, num_limited_groups=topk_group) if n_group > 1 else {}
    ours = MoE(
        H,
        INTER,
        E,
        K,
        num_shared_experts=shared,
        score_func="sigmoid",
        route_norm=norm,
        route_scale=scale,
        load_balance_coeff=1e-3 if bias else None,
        **groups,
    )
    load_from_hf(ours, hf, bias_name="e_score_correction_bias" if bias else None)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    _compare(ours, hf, x)


def _no_shared_forward(hf):
    def forward(hidden_states):
        shape = hidden_states.shape
        _, w, idx = hf.gate(hidden_states)
        flat = hidden_states.view(-1, shape[-1])
        return hf.experts(flat, idx, w).view(*shape)

    return forward


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_sparse_block(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm,
    )
    hf = Qwen3MoeSparseMoeBlock(cfg)
    _init(hf, 2)
    ours = MoE(H, INTER, E, K, score_func="softmax", route_norm=norm)
    load_from_hf(ours, hf)
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(3))
    _compare(ours, hf, x)


def test_qwen3_5_moe_sparse_block_with_gated_shared_expert():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=24,
        num_experts=E,
        num_experts_per_tok=K,
    )
    hf = Qwen3_5MoeSparseMoeBlock(cfg)
    _init(hf, 4)
    ours = MoE(
        H,
        INTER,
        E,
        K,
        num_shared_experts=1,
        shared_hidden_dim=24,
        shared_expert_gate=True,
        score_func="softmax",
        route_norm=True,
    )
    hf.shared_experts = hf.shared_expert  # the same weights under the helper's name
    load_from_hf(ours, hf)
    with torch.no_grad():
        ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(5))
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, ref = ours(x1), hf(x2)
    torch.testing.assert_close(out, ref, **TOL)
    up = torch.randn_like(out)
    out.backward(up)
    ref.backward(up)
    torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    torch.testing.assert_close(
        ours.shared_expert_gate.weight.grad, hf.shared_expert_gate.weight.grad, **TOL
    )
    grads = hf_grads(hf)
    for name, p in ours.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], **TOL, msg=name)
