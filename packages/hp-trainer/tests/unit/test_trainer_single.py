"""LLMTrainer in one process: the loss falls on the embedded corpus, and a run stopped at a
checkpoint and resumed gives the same losses as one that never stopped."""

import json

import pytest
import torch

from hp_trainer import Callback, LLMTrainer, LoggingCallback, load_config

FAST = ["--training.seq_len", "32", "--training.global_batch_size", "4", "--metrics.log_freq", "2"]


def _cfg(tmp_path, name, steps, extra=()):
    return load_config(
        None,
        [
            *FAST,
            "--job.dump_folder",
            str(tmp_path / name),
            "--training.steps",
            str(steps),
            "--checkpoint.interval",
            "3",
            *extra,
        ],
    )


class _Killed(Exception):
    pass


class _KillAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise _Killed


def test_resume_gives_the_same_losses(tmp_path):
    straight = LLMTrainer(_cfg(tmp_path, "a", 6)).train()
    with pytest.raises(_Killed):  # dies at step 5, after the checkpoint of step 3
        LLMTrainer(_cfg(tmp_path, "b", 6), callbacks=[_KillAt(5)]).train()
    resumed = LLMTrainer(_cfg(tmp_path, "b", 6))
    assert resumed.step == 3
    assert resumed.train() == straight  # bitwise: same data, RNG, optimizer and LR state


def test_loss_falls_and_outputs_are_written(tmp_path):
    cfg = _cfg(
        tmp_path,
        "c",
        30,
        [
            "--training.lr",
            "1e-2",
            "--activation_checkpoint.mode",
            "full",
            "--training.local_batch_size",
            "2",
        ],
    )
    log = LoggingCallback(log_freq=10)
    trainer = LLMTrainer(cfg, callbacks=[log])
    assert trainer.micro_batches == 2
    losses = trainer.train()
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # bytes: from ~5.5 towards ~3
    lines = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 31))
    assert (tmp_path / "c" / "loss.png").stat().st_size > 1000
    assert any((tmp_path / "c" / "tb").iterdir())
    ckpts = sorted(p.name for p in (tmp_path / "c" / "checkpoint").iterdir())
    assert ckpts == ["step-27", "step-30"]  # keep_latest_k = 2


def test_accumulation_equals_one_big_batch(tmp_path):
    one = LLMTrainer(_cfg(tmp_path, "d", 3, ["--checkpoint.enable", "false"])).train()
    acc = LLMTrainer(
        _cfg(tmp_path, "e", 3, ["--checkpoint.enable", "false", "--training.local_batch_size", "1"])
    ).train()
    torch.testing.assert_close(acc, one, rtol=1e-5, atol=0)


def test_local_hf_tokenizer_and_jsonl_data(tmp_path):
    """A tokenizer folder written by transformers (a small BPE trained here) and a JSONL file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hp_trainer._data import load_corpus, load_tokenizer

    text = load_corpus("")[:100_000]
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]").save_pretrained(
        tmp_path / "tok"
    )
    lines = [json.dumps({"text": t}) for t in text.split("\n")[:2000]]
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert (
        tok.vocab_size == 200
        and tok.decode(tok.encode("In the beginning God")) == "In the beginning God"
    )
    cfg = _cfg(
        tmp_path,
        "f",
        3,
        ["--data.tokenizer", str(tmp_path / "tok"), "--data.path", str(tmp_path / "data.jsonl")],
    )
    trainer = LLMTrainer(cfg)
    assert int(trainer.data.tokens.max()) < 200
    assert len(trainer.train()) == 3


def test_mtp_loss_metric_is_each_steps_own(tmp_path):
    """DeepSeek-V3's multi-token prediction loss in the metrics: per step (not a running
    sum), the mean over the step's microbatches, equal to the model's own on the same data
    (learning rate 0 and the expert bias held fixed keep the model as it was)."""
    extra = ["--model.name", "deepseek-v3-tiny", "--training.lr", "0", "--checkpoint.enable"]
    extra += ["false", "--moe.load_balance_coeff", "0", "--training.local_batch_size", "2"]
    seen = []

    class Record(Callback):
        def on_step_end(self, trainer, step, metrics):
            seen.append(metrics["mtp_loss"])

    trainer = LLMTrainer(_cfg(tmp_path, "m", 3, extra), callbacks=[Record()])
    trainer.train()
    model = trainer.model
    for step, got in enumerate(seen, start=1):
        model.mtp_loss.zero_()
        for x, _ in trainer.data.local_batches(step, 0, 1, 2):
            model(x)
        assert got == pytest.approx(model.mtp_loss.item() / 2, rel=1e-5)
        assert got > 0


@pytest.mark.parametrize("extra", [(), ("--training.local_batch_size", "2")])
def test_dry_step_does_the_tensor_work_of_train_step(tmp_path, extra):
    """dry_step (what hp-plan dry-run runs under fake tensors) is train_step's forward,
    backward, clipping and optimizer step with nothing read back: the same parameters after
    two steps, and the same step count and learning rate."""
    off = ["--checkpoint.enable", "false", *extra]
    a = LLMTrainer(_cfg(tmp_path, "a", 4, off))
    b = LLMTrainer(_cfg(tmp_path, "b", 4, off))
    for _ in range(2):
        a.train_step()
        b.dry_step()
    assert a.step == b.step == 2
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
        assert q.grad is None  # released, as train_step does
    assert any(
        (p != p0).any()
        for p, p0 in zip(
            a.model.parameters(),
            LLMTrainer(_cfg(tmp_path, "c", 4, off)).model.parameters(),
            strict=True,
        )
    )  # it did train
