"""HuggingFace checkpoints: name maps both ways, ``from_pretrained`` and ``save_pretrained``.

Weights are read with hp_dcp straight from the safetensors files, by byte range, into whatever
sharding the model already has; sharded models are written through an hp_dcp checkpoint and
exported from it one tensor at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import hp_dcp
from hp_dtensor import DTensor

from ..errors import ConfigError
from ._config import TransformerConfig
from ._transformer import Transformer

__all__ = ["from_pretrained", "hf_name", "our_name", "save_pretrained"]

# (our name, HuggingFace name): one table read both ways. {i} is a block index, {x} one of the
# letters or words in braces after it, {p} "weight" or "bias", {rest} any tail.
_NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.w{x:qkvo}.{p}", "model.layers.{i}.self_attn.{x}_proj.{p}"),
    ("layers.{i}.attention.{x:qk}_norm.weight", "model.layers.{i}.self_attn.{x}_norm.weight"),
    ("layers.{i}.feed_forward.w1.{p}", "model.layers.{i}.mlp.gate_proj.{p}"),
    ("layers.{i}.feed_forward.w3.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
    ("layers.{i}.feed_forward.w2.{p}", "model.layers.{i}.mlp.down_proj.{p}"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.linear_attention.{rest}", "model.layers.{i}.linear_attn.{rest}"),
]
_FIELDS = {"i": r"\d+", "p": "weight|bias", "rest": ".+"}


_FIELD = re.compile(r"\{(\w+)(?::(\w+))?\}")


def _pattern(template: str, pair: tuple[str, str]) -> re.Pattern:
    """``template`` as a regex; a field's choices may be written in either template of the pair."""
    fields = dict(_FIELDS)
    for m in _FIELD.finditer(" ".join(pair)):
        if m.group(2):
            fields[m.group(1)] = f"[{m.group(2)}]"
    out, pos = [], 0
    for m in _FIELD.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>{fields[m.group(1)]})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _fill(template: str, fields: dict) -> str:
    return _FIELD.sub(lambda m: fields[m.group(1)], template)


_TO_HF = [(_pattern(ours, (ours, hf)), hf) for ours, hf in _NAMES]
_FROM_HF = [(_pattern(hf, (ours, hf)), ours) for ours, hf in _NAMES]


def _apply(rules, name: str, what: str) -> str:
    for pat, target in rules:
        m = pat.fullmatch(name)
        if m:
            return _fill(target, m.groupdict())
    raise ConfigError(f"{what} {name!r} has no HuggingFace counterpart")


def hf_name(name: str) -> str:
    """Our parameter name -> the HuggingFace Llama/Qwen3 name."""
    return _apply(_TO_HF, name, "parameter")


def our_name(name: str) -> str:
    """A HuggingFace Llama/Qwen3 parameter name -> ours."""
    return _apply(_FROM_HF, name, "HuggingFace tensor")


def _weights(model: Transformer) -> dict:
    """The model's state dict without the output weight when it is tied to the embedding."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("output.weight", None)
    return sd


def from_pretrained(
    path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_seq_len: int | None = None,
) -> Transformer:
    """Build our model from a local HuggingFace folder (``config.json`` + safetensors) of a
    Llama or Qwen3 checkpoint. The model is created on the meta device, materialised on
    ``device`` (default CPU) and filled from the files by byte range; ``dtype`` casts it."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"from_pretrained: {str(path)!r} has no config.json")
    cfg = TransformerConfig.from_hf(json.loads(cfg_file.read_text()), max_seq_len=max_seq_len)
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_buffers(device)
    target = {hf_name(k): v for k, v in _weights(model).items()}
    hp_dcp.load(target, checkpoint_id=path)
    if dtype is not None:
        model.to(dtype)
        model.init_buffers(device)  # rotary tables stay float32, as in transformers
    return model


def save_pretrained(model: Transformer, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and ``model-*.safetensors`` shards + index that
    ``transformers.AutoModelForCausalLM.from_pretrained`` reads. A sharded model (DTensor
    parameters) is saved collectively through an hp_dcp checkpoint and exported by rank 0."""
    path = Path(path)
    sd = _weights(model)
    sharded = any(isinstance(v, DTensor) for v in sd.values())
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if sharded:
        tmp = path / ".hp_dcp_checkpoint"
        hp_dcp.save(sd, checkpoint_id=tmp)
        if rank == 0:
            hp_dcp.export_hf(tmp, path, name_map=hf_name, max_shard_bytes=max_shard_bytes)
            shutil.rmtree(tmp)
    elif rank == 0:
        hp_dcp.save_hf(sd, path, name_map=hf_name, max_shard_bytes=max_shard_bytes)
    if rank == 0:
        (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
