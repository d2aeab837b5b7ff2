"""NOTE [Element-wise traffic] against torch: the bytes every non-GEMM, non-attention aten op
of hp-trainer's real Llama (blocks, head, ``F.cross_entropy(logits.float())``, as
``LLMTrainer.train_step`` calls it) reads and writes, forward and backward, under bf16 autocast
without FSDP (the one-process trainer), counted on the CPU by a ``TorchDispatchMode`` that sums
each op's input and output bytes. Views and other metadata ops move nothing and are skipped;
matmuls, attention and the embedding's lookup are not element-wise work.

Differences over blocks (1 -> 3) and over tokens (one sequence -> three, same length) leave one
block's bytes per token; the part of a block that does not grow with tokens is its weights'
casts (and the per-position rotary tables); one layer's bytes per token less a block's are the
head's and the embedding backward's; a second micro-step adds its own traffic plus the
gradient accumulation.

Qwen3.5's blocks (NOTE [Qwen3.5 traffic]: the Gated DeltaNet and the gated attention, each with
zero-centred norms) are checked the same way in float32, bfloat16 and bfloat16 under autocast,
at shapes other than the ones the table was counted at, forward and backward apart.

Two deliberate departures from torch's CPU eager ops, both toward what CUDA runs:
- CUDA's ``F.rms_norm`` is one fused kernel (``_fused_rms_norm``: reads x and the weight, writes
  y and an fp32 rstd; its backward reads the gradient, x, rstd and the weight, writes dx and
  the weight's gradient); the CPU decomposes it. The norms are swapped for a custom op doing
  that (one op to the dispatch mode, as the fused kernel is one kernel), as
  ``test_saved_measured.py`` does for the saved set.
- ``nll_loss`` takes the whole log-probabilities but its kernels read only the target's entry
  per row (forward) and take only the shape (backward, which writes its output whole): their
  ``self`` argument is counted as one element per row, and not at all.

``copy_``, ``fill_`` and ``zero_`` write their destination without reading it: it is counted
once, as their output.
"""

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hp_trainer")

import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from hp_autoparallel import _layers as L  # noqa: E402
from hp_autoparallel import spec_from_config  # noqa: E402

DIM, HEADS, KV, FFN, VOCAB, SEQ = 256, 2, 1, 704, 512, 64


@torch.library.custom_op("hp_autoparallel_test::fused_rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return ((x.float() * rstd) * w.float()).to(x.dtype), rstd


@torch.library.custom_op("hp_autoparallel_test::fused_rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.float() * rstd
    gw = g.float() * w.float()
    dx = rstd * (gw - n * (gw * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), (g.float() * n).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)


@torch.library.custom_op("hp_autoparallel_test::fused_rms_norm_plain", mutates_args=())
def _rms_norm_plain(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd).to(x.dtype), rstd


@torch.library.custom_op("hp_autoparallel_test::fused_rms_norm_plain_backward", mutates_args=())
def _rms_norm_plain_backward(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    n = x.float() * rstd
    dx = rstd * (g.float() - n * (g.float() * n).mean(-1, keepdim=True))
    return dx.to(x.dtype)


def _setup_plain(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.set_materialize_grads(False)


def _backward_plain(ctx, g, _grstd):
    x, rstd = ctx.saved_tensors
    return _rms_norm_plain_backward(g, x, rstd), None


_rms_norm_plain.register_autograd(_backward_plain, setup_context=_setup_plain)


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` without a weight (how Qwen3.5's norms call it) as one fused op."""
    assert weight is None
    return _rms_norm_plain(x, 1e-6 if eps is None else eps)[0]


def _setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, output[1], w)
    ctx.set_materialize_grads(False)  # rstd's gradient is never used (no zero-filled tensor)


def _backward(ctx, g, _grstd):
    x, rstd, w = ctx.saved_tensors
    return (*_rms_norm_backward(g, x, rstd, w), None)


_rms_norm.register_autograd(_backward, setup_context=_setup)

#: ops that move no data (views, metadata) or are no element-wise work (GEMMs, attention, the
#: embedding's lookup); the ones seen here and their relatives
_FREE = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "expand", "slice",
    "select", "detach", "alias", "as_strided", "permute", "unsqueeze", "squeeze", "split",
    "split_with_sizes", "chunk", "unbind", "lift_fresh", "empty", "empty_like", "new_empty",
    "empty_strided", "new_empty_strided",
}  # fmt: skip
_NOT_ELEMENTWISE = ("mm", "addmm", "bmm", "matmul", "embedding")  # the lookup (its backward counts)
_ATTENTION = ("scaled_dot_product", "_scaled_dot_product", "_flash_attention", "_efficient")


#: in-place ops that overwrite their first argument without reading it
_WRITE_ONLY = ("copy_", "fill_", "zero_")


def _nbytes(t):
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Traffic(TorchDispatchMode):
    """Bytes read + written by each aten op, by op name."""

    def __init__(self):
        super().__init__()
        self.by_op = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE or name in _NOT_ELEMENTWISE or name.startswith(_ATTENTION):
            return out
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        n = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in tree_flatten(out)[0])
        if name in _WRITE_ONLY:  # the destination is written, not read
            n -= _nbytes(args[0])
        elif name == "nll_loss_forward":  # reads one log-probability per row
            n += ins[0].shape[0] * ins[0].element_size() - _nbytes(ins[0])
        elif name == "nll_loss_backward":  # (grad, self, target, weight?, total_weight)
            n -= _nbytes(ins[1])
        self.by_op[name] += n
        return out


def _config(n_layers):
    from hp_trainer.models import TransformerConfig

    return TransformerConfig(
        architecture="llama",
        vocab_size=VOCAB,
        dim=DIM,
        n_layers=n_layers,
        n_heads=HEADS,
        n_kv_heads=KV,
        ffn_hidden=FFN,
        max_seq_len=SEQ,
    )


def _step_bytes(n_layers, batch, micro_steps=1):
    """Element-wise bytes of ``micro_steps`` forward + loss + backward passes after
    ``zero_grad(set_to_none=True)``, as LLMTrainer.train_step runs them."""
    from hp_trainer import ParallelDims
    from hp_trainer._parallelize import ParallelizeConfig, parallelize_llama
    from hp_trainer.models import RMSNorm, Transformer

    torch.manual_seed(0)
    model = Transformer(_config(n_layers))
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x, m=m: _rms_norm(x, m.weight, m.eps)[0]
    parallelize_llama(
        model,
        parallel_dims=ParallelDims(world_size=1),
        config=ParallelizeConfig(activation_checkpoint="none", param_dtype=torch.bfloat16),
    )
    x = torch.randint(0, VOCAB, (batch, SEQ))
    y = torch.randint(0, VOCAB, (batch, SEQ))

    def micro_step():
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()

    micro_step()  # warm-up (lazy state outside the measured passes)
    model.zero_grad(set_to_none=True)
    mode = _Traffic()
    with mode:
        for _ in range(micro_steps):
            micro_step()
    return sum(mode.by_op.values()), model


@pytest.fixture(scope="module")
def measured():
    return {(n, b): _step_bytes(n, b)[0] for n in (1, 3) for b in (1, 3)}


@pytest.fixture(scope="module")
def spec():
    return spec_from_config(_config(2), name="tiny-elementwise")


def _per_block(measured, batch):
    return (measured[(3, batch)] - measured[(1, batch)]) / 2


def test_block_bytes_per_token_match_torch(measured, spec):
    per_token = (_per_block(measured, 3) - _per_block(measured, 1)) / (2 * SEQ)
    fwd, bwd = L.block_elementwise(spec, L.kind_of(spec, 0), 1, 1, 2, True)
    assert per_token == pytest.approx(fwd + bwd)
    d, r, f = DIM, (HEADS + KV) * DIM // HEADS, FFN  # the closed form of the NOTE
    assert fwd + bwd == 192 * d + 40 * r + 28 * f + 16


def test_block_bytes_per_weight_match_torch(measured, spec):
    per_token = (_per_block(measured, 3) - _per_block(measured, 1)) / (2 * SEQ)
    fixed = _per_block(measured, 1) - per_token * SEQ
    weights = L.work(spec, L.kind_of(spec, 0), 1, SEQ, 1, 1, 2, True).matmul / 2
    hd = DIM // HEADS
    # the rotary tables (per position, not per token): cos and sin cast to bf16 (read 4, write
    # 2) and read by the four muls of the forward and four of the backward; the norms' weights
    rotary = 2 * SEQ * hd * 6 + 8 * SEQ * hd * 2
    norms = 2 * DIM * 4 * 3  # read forward, read and its gradient written backward
    assert fixed == pytest.approx(2 * L.CAST_BYTES * weights + rotary + norms)


def test_head_bytes_per_token_match_torch(measured, spec):
    per_token_block = (_per_block(measured, 3) - _per_block(measured, 1)) / (2 * SEQ)
    per_token_one = (measured[(1, 3)] - measured[(1, 1)]) / (2 * SEQ)
    fwd, bwd = L.head_elementwise(spec, 1, 2, True)
    embedding = L.embedding_elementwise(spec, 1, 2, True)
    assert per_token_one - per_token_block == pytest.approx(fwd + bwd + embedding)


def test_gradient_accumulation_bytes_match_torch():
    one, model = _step_bytes(1, 1)
    two, _ = _step_bytes(1, 1, micro_steps=2)
    params = sum(p.numel() for p in model.parameters())
    assert two - 2 * one == pytest.approx(L.ACCUMULATE_BYTES * params)


#: Qwen3.5 block shapes none of NOTE [Qwen3.5 traffic]'s counts used: the Gated DeltaNet's
#: heads, head sizes and sequence (its chunk is the model's 64), the gated attention's heads,
#: head size, partial rotary share and sequence
_QWEN35_SHAPES = [
    ("linear_attention", dict(dim=64, ffn_hidden=128, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=24), 192),
    ("linear_attention", dict(dim=48, ffn_hidden=96, linear_num_key_heads=3,
        linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=16), 128),
    ("full_attention", dict(dim=64, ffn_hidden=128, n_heads=6, n_kv_heads=2, head_dim=24,
        partial_rotary_factor=0.25), 96),
    ("full_attention", dict(dim=48, ffn_hidden=96, n_heads=2, n_kv_heads=2, head_dim=16,
        partial_rotary_factor=1.0), 160),
]  # fmt: skip


def _qwen35_block_bytes(kind, fields, seq, precision):
    """One Qwen3.5 block's element-wise bytes per token, forward and backward, from the
    differences over blocks (1 -> 3) and sequences (2 -> 4)."""
    from hp_trainer import ParallelDims
    from hp_trainer._parallelize import ParallelizeConfig, parallelize_llama
    from hp_trainer.models import CONFIGS, Transformer

    def config(n):
        return CONFIGS["qwen3.5-tiny"].replace(
            n_layers=n, layer_types=(kind,) * n, max_seq_len=seq, **fields
        )

    def measure(n, batch):
        torch.manual_seed(0)
        model = Transformer(config(n))
        if precision == "autocast":
            parallelize_llama(
                model,
                parallel_dims=ParallelDims(world_size=1),
                config=ParallelizeConfig(activation_checkpoint="none", param_dtype=torch.bfloat16),
            )
        elif precision == "bf16":
            model.to(torch.bfloat16)
        vocab = model.config.vocab_size
        x, y = (torch.randint(0, vocab, (batch, seq)) for _ in range(2))

        def loss():
            return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

        loss().backward()  # warm-up
        model.zero_grad(set_to_none=True)
        fwd, bwd = _Traffic(), _Traffic()
        with fwd:
            out = loss()
        with bwd:
            out.backward()
        return sum(fwd.by_op.values()), sum(bwd.by_op.values())

    m = {(n, b): measure(n, b) for n in (1, 3) for b in (2, 4)}
    per_token = [
        ((m[3, 4][i] - m[1, 4][i]) - (m[3, 2][i] - m[1, 2][i])) / (2 * 2 * seq) for i in (0, 1)
    ]
    return per_token, spec_from_config(config(2), name="qwen35-elementwise")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("kind, fields, seq", _QWEN35_SHAPES)
def test_qwen35_block_bytes_per_token_match_torch(monkeypatch, kind, fields, seq, precision):
    monkeypatch.setattr(F, "rms_norm", _fused_rms_norm)
    (fwd, bwd), spec = _qwen35_block_bytes(kind, fields, seq, precision)
    ab, autocast = {"fp32": (4, False), "bf16": (2, False), "autocast": (2, True)}[precision]
    pf, pb = L.block_elementwise(spec, L.kind_of(spec, 0), 1, 1, ab, autocast, seq)
    assert (fwd, bwd) == (pytest.approx(pf), pytest.approx(pb))
