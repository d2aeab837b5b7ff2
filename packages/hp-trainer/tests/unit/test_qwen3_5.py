"""Qwen3.5 (dense hybrid): the chunked Gated DeltaNet equals a token-by-token recurrence (outputs
and gradients), and the whole model equals transformers' Qwen3_5ForCausalLM (fp32, 1e-5) both
ways, over one and several chunks."""

import pytest
import torch

from hp_trainer.models import Transformer, from_pretrained, get_config
from hp_trainer.models._qwen3_5 import chunk_gated_delta_rule


def _recurrent(q, k, v, g, beta):
    """S_t = a_t S_{t-1} + beta_t k_t (v_t - (a_t S_{t-1})^T k_t)^T ; o_t = S_t^T q_t / sqrt(dk)."""
    b, s, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum(
            "bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred)
        )
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * dk**-0.5, state))
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("s,chunk", [(5, 4), (16, 4), (37, 8)])
def test_chunked_equals_recurrence(s, chunk):
    g_ = torch.Generator().manual_seed(s)
    b, h, dk, dv = 2, 3, 8, 5
    q = torch.nn.functional.normalize(
        torch.randn(b, s, h, dk, generator=g_, dtype=torch.float64), dim=-1
    )
    k = torch.nn.functional.normalize(
        torch.randn(b, s, h, dk, generator=g_, dtype=torch.float64), dim=-1
    )
    v = torch.randn(b, s, h, dv, generator=g_, dtype=torch.float64)
    g = -torch.rand(b, s, h, generator=g_, dtype=torch.float64)
    beta = torch.rand(b, s, h, generator=g_, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    ref = _recurrent(*inputs)
    got = chunk_gated_delta_rule(*inputs, chunk=chunk).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    g_got = torch.autograd.grad((got * w).sum(), inputs)
    for a, e in zip(g_got, g_ref):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


def _hf(tied):
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 0 / 1 and dt_bias at 1: perturb so the test sees them
        for n, p in model.named_parameters():
            if "norm" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_both_ways(tmp_path, tied):
    import transformers

    hf = _hf(tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert ours.config.architecture == "qwen3_5"
    assert ours.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    for s in (40, 130):  # one chunk (padded) and three
        ids = torch.randint(0, 97, (2, s), generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            expected = hf(ids).logits
            torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_tiny_config_trains():
    torch.manual_seed(0)
    m = Transformer(get_config("qwen3.5-tiny", max_seq_len=32))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = (torch.arange(33)[None, :] * torch.tensor([[1], [2], [3]])) % 256
    losses = []
    for step in range(15):
        loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if (
            step == 0
        ):  # every parameter (decay, convolution, gates, both block kinds) gets a gradient
            missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.any()]
            assert missing == []
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize(
    "name, billions", [("qwen3.5-0.8b", (0.70, 0.80)), ("qwen3.5-9b", (8.5, 9.5))]
)
def test_published_config_matches_transformers_structure(name, billions):
    """A published config written as a HuggingFace config builds, in transformers, a model with
    the same parameter shapes as ours (the fused q/k/v and convolution counted as their parts)."""
    import transformers

    from hp_trainer.models._hf import _joined, hf_name

    cfg = get_config(name)
    hf_cfg = transformers.Qwen3_5TextConfig(
        **{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        theirs = transformers.Qwen3_5ForCausalLM(hf_cfg)
        ours = Transformer(cfg)
    shapes = {n: tuple(p.shape) for n, p in theirs.state_dict().items()}
    sd = _joined({k: v for k, v in ours.state_dict().items() if k != "output.weight"})
    mine = {hf_name(n): tuple(p.shape) for n, p in sd.items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    else:
        mine[hf_name("output.weight")] = tuple(ours.output.weight.shape)
    assert mine == shapes
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())  # used for MFU
    low, high = billions  # the text model (the published name counts the vision tower too)
    assert low * 1e9 < cfg.num_params() < high * 1e9


def test_delta_rule_state_maps_compose():
    """The rule from a given initial state, and a stretch's state map M S + N: cutting a
    sequence anywhere and passing the state across the cut gives the uncut outputs (float64),
    which is what context parallelism relies on."""
    from hp_trainer.models._qwen3_5 import chunk_gated_delta_rule, gated_delta_rule_transition

    g0 = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 100, 3, 8, 6
    q, k = (
        torch.nn.functional.normalize(
            torch.randn(b, s, h, dk, generator=g0, dtype=torch.float64), dim=-1
        )
        for _ in range(2)
    )
    v = torch.randn(b, s, h, dv, generator=g0, dtype=torch.float64)
    g = -torch.rand(b, s, h, generator=g0, dtype=torch.float64)
    beta = torch.rand(b, s, h, generator=g0, dtype=torch.float64)
    start = torch.randn(b, h, dk, dv, generator=g0, dtype=torch.float64)
    whole = chunk_gated_delta_rule(q, k, v, g, beta, chunk=16, initial_state=start)
    cuts = [0, 7, 37, 64, 100]  # inside chunks, on a chunk boundary, shorter than a chunk
    state, outs = start, []
    for lo, hi in zip(cuts, cuts[1:]):
        part = (t[:, lo:hi] for t in (q, k, v, g, beta))
        outs.append(chunk_gated_delta_rule(*part, chunk=16, initial_state=state))
        m, n = gated_delta_rule_transition(*(t[:, lo:hi] for t in (k, v, g, beta)), chunk=16)
        state = m @ state + n
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-12, atol=1e-12)
