"""The output projection and the loss fused over token chunks (models.linear_cross_entropy)
against F.cross_entropy on the whole logits: values and gradients, fp64 (exact to rounding)
and fp32, chunk sizes that do and do not divide the tokens, ignored targets, autocast; the
model's fused path and the trainer's ``training.fused_loss`` give the unfused losses."""

import pytest
import torch
import torch.nn.functional as F

from hp_trainer import ConfigError, LLMTrainer, load_config
from hp_trainer.models import Transformer, get_config, linear_cross_entropy


def _case(dtype, n=37, dim=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::5] = -100  # ignored
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_equals_cross_entropy_on_the_whole_logits(chunk, dtype, tol):
    h, w, t = _case(dtype)
    ref = F.cross_entropy(h @ w.t(), t)
    gh, gw = torch.autograd.grad(ref * 3.0, (h, w))
    got = linear_cross_entropy(h, w, t, chunk_size=chunk)
    fh, fw = torch.autograd.grad(got * 3.0, (h, w))
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(fh, gh, rtol=tol, atol=tol)
    torch.testing.assert_close(fw, gw, rtol=tol, atol=tol)


def test_leading_dims_and_autocast():
    h, w, t = _case(torch.float32, n=24)
    h3, t3 = h.detach().reshape(2, 12, -1).requires_grad_(), t.reshape(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h3, w).flatten(0, 1).float(), t3.flatten())
        got = linear_cross_entropy(h3, w, t3, chunk_size=5)
    (gh,) = torch.autograd.grad(ref, h3)
    (fh,) = torch.autograd.grad(got, h3)
    assert fh.dtype == torch.float32  # back through the cast to h's dtype
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fh, gh, rtol=5e-2, atol=5e-3)


def test_padded_last_chunk_of_the_compiled_path(monkeypatch):
    """CUDA pads the last chunk to the chunk size (one compiled shape): the same result."""
    from hp_trainer.models import _loss

    monkeypatch.setattr(_loss, "_chunk_fn", lambda dev: lambda *a: _loss._loss_and_grad(*a))
    h, w, t = _case(torch.float64)
    ref = F.cross_entropy(h @ w.t(), t)
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = linear_cross_entropy(h, w, t, chunk_size=16)  # 37 = 16 + 16 + 5
    fh, fw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close((got, fh, fw), (ref, gh, gw), rtol=1e-12, atol=1e-12)


def test_no_grad_all_ignored_and_int32_targets():
    h, w, t = _case(torch.float64)
    with torch.no_grad():  # the loss alone: no gradient buffers
        torch.testing.assert_close(
            linear_cross_entropy(h, w, t.int(), chunk_size=8), F.cross_entropy(h @ w.t(), t)
        )
    ignored = torch.full_like(t, -100)
    assert torch.isnan(F.cross_entropy(h @ w.t(), ignored))  # as torch does: NaN
    assert torch.isnan(linear_cross_entropy(h, w, ignored))


def test_fp32_master_weight_gets_an_fp32_gradient_under_autocast():
    h, w, t = _case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, chunk_size=8)
    (gw,) = torch.autograd.grad(loss, (w,))
    assert gw.dtype == torch.float32


def test_bad_arguments_are_named():
    h, w, t = _case(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match=r"weight must be \[vocab, dim\]"):
        linear_cross_entropy(h, w.t(), t)
    with pytest.raises(ValueError, match="one target per token"):
        linear_cross_entropy(h, w, t[:-1])


def test_model_fused_path_equals_the_logits_path():
    torch.manual_seed(0)
    model = Transformer(get_config("llama3-tiny", max_seq_len=32))
    x = torch.randint(0, model.config.vocab_size, (2, 32))
    y = torch.randint(0, model.config.vocab_size, (2, 32))
    ref = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = model(x, targets=y)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


QUIET = ["--metrics.tensorboard", "false", "--metrics.plot", "false"]


def _cfg(tmp_path, name, *extra):
    args = ["--training.seq_len", "32", "--training.global_batch_size", "4", *QUIET]
    args += ["--training.steps", "4", "--checkpoint.enable", "false"]
    return load_config(None, [*args, "--job.dump_folder", str(tmp_path / name), *extra])


def test_trainer_fused_loss_gives_the_same_losses(tmp_path):
    plain = LLMTrainer(_cfg(tmp_path, "plain")).train()
    fused = LLMTrainer(_cfg(tmp_path, "fused", "--training.fused_loss", "true")).train()
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree=2"),
        (["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree=2"),
        (["--model.name", "deepseek-v3-tiny"], "model.mtp_layers"),
    ],
)
def test_fused_loss_refuses_what_it_cannot_serve(tmp_path, extra, named):
    from hp_trainer import preflight

    with pytest.raises(ConfigError, match=named):
        preflight(_cfg(tmp_path, "x", "--training.fused_loss", "true", *extra), 2)
