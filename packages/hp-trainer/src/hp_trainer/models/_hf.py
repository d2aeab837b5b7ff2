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

_TO_HF = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (
        r"layers\.(\d+)\.attention\.w([qkvo])\.(weight|bias)",
        r"model.layers.\1.self_attn.\2_proj.\3",
    ),
    (r"layers\.(\d+)\.attention\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.(weight|bias)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"layers\.(\d+)\.feed_forward\.w3\.(weight|bias)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"layers\.(\d+)\.feed_forward\.w2\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.linear_attention\.(.+)", r"model.layers.\1.linear_attn.\2"),
]
_FROM_HF = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (
        r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)",
        r"layers.\1.attention.w\2.\3",
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight",
        r"layers.\1.attention.\2_norm.weight",
    ),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", r"layers.\1.feed_forward.w1.\2"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", r"layers.\1.feed_forward.w3.\2"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", r"layers.\1.feed_forward.w2.\2"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.linear_attn\.(.+)", r"layers.\1.linear_attention.\2"),
]


def _apply(rules, name: str, what: str) -> str:
    for pat, rep in rules:
        m = re.fullmatch(pat, name)
        if m:
            return m.expand(rep)
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
