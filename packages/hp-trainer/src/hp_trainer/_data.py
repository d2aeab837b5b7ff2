"""Training data: a corpus as one token tensor, a byte-level tokenizer (or a local HuggingFace
one), and batches drawn deterministically from ``(seed, step)`` so that every parallel layout and
every resumed run sees exactly the same global batch at a given step."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import torch

from .errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "TokenData", "load_corpus", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files needed."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(spec: str):
    """``"byte"`` or a local HuggingFace tokenizer folder."""
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).exists():
        raise ConfigError(f"data.tokenizer={spec!r}: use 'byte' or a local tokenizer folder")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(spec))


class HFTokenizer:
    """A HuggingFace tokenizer behind the two methods the trainer uses; ``vocab_size`` counts
    added tokens too."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_corpus(path: str = "") -> str:
    """The text of a ``.txt`` file, of a ``.jsonl`` file's ``"text"`` fields (joined by blank
    lines), or the embedded corpus (the King James Bible, 4.4 MB) when ``path`` is empty."""
    if not path:
        data = resources.files("hp_trainer.data").joinpath("kjv.txt.gz").read_bytes()
        return gzip.decompress(data).decode("utf-8")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path={path!r}: no such file")
    if p.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                try:
                    texts.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(
                        f'data.path={path!r} line {i + 1}: expected {{"text": ...}}'
                    ) from None
        return "\n\n".join(texts)
    return p.read_text()


class TokenData:
    """Windows of ``seq_len + 1`` tokens from one long token tensor. ``global_batch(step)``
    depends only on the seed and the step; a data-parallel rank takes its slice of it."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch_size: int, seed: int = 0):
        if tokens.numel() < seq_len + 2:
            raise ConfigError(
                f"the corpus has {tokens.numel()} tokens, fewer than training.seq_len + 2 = "
                f"{seq_len + 2}"
            )
        self.tokens = tokens.long()
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, ``[global_batch_size, seq_len]`` each."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, self.tokens.numel() - self.seq_len - 1, (self.global_batch_size,), generator=g
        )
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        win = self.tokens[idx]
        return win[:, :-1], win[:, 1:]

    def local_batches(self, step: int, dp_rank: int, dp: int, micro_batches: int):
        """This rank's micro-batches of ``step``: the global batch split over data-parallel
        ranks, then into ``micro_batches`` pieces (gradient accumulation)."""
        x, y = self.global_batch(step)
        per_rank = self.global_batch_size // dp
        x, y = (
            x[dp_rank * per_rank : (dp_rank + 1) * per_rank],
            y[dp_rank * per_rank : (dp_rank + 1) * per_rank],
        )
        return list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
