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


# HuggingFace keeps a Gated DeltaNet's q/k/v projections (and their convolutions) in one tensor
# each, stacked along dim 0; we keep them apart so that tensor parallelism splits heads with
# plain row shards.
_FUSED = {
    "in_proj_qkv.weight": ("in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight"),
    "conv1d.weight": ("conv_q.weight", "conv_k.weight", "conv_v.weight"),
}
_LINEAR_ATTN = re.compile(r"(layers\.\d+\.linear_attention\.)(.+)")


def _fused_groups(names) -> dict[str, list[str]]:
    """``{our fused name: [our part names]}`` for the Gated DeltaNet tensors among ``names``."""
    part_of = {part: fused for fused, parts in _FUSED.items() for part in parts}
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _LINEAR_ATTN.fullmatch(name)
        if m and m.group(2) in part_of:
            fused = m.group(1) + part_of[m.group(2)]
            groups.setdefault(fused, [m.group(1) + p for p in _FUSED[part_of[m.group(2)]]])
    return groups


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _joined(sd: dict) -> dict:
    """``sd`` with each fused group's parts replaced by their concatenation (collective for
    DTensor parts: every rank gets the whole tensor)."""
    out = dict(sd)
    for fused, parts in _fused_groups(sd).items():
        out[fused] = torch.cat([_full(out.pop(p)) for p in parts], dim=0)
    return out


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
    sd = _weights(model)
    groups = _fused_groups(sd)
    parts = {p for names in groups.values() for p in names}
    target = {hf_name(k): v for k, v in sd.items() if k not in parts}
    staging = {}  # fused HuggingFace tensors land here, then are split into our parts
    for fused, names in groups.items():
        first = sd[names[0]]
        rows = sum(sd[n].shape[0] for n in names)
        staging[fused] = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=device)
        target[hf_name(fused)] = staging[fused]
    hp_dcp.load(target, checkpoint_id=path)
    with torch.no_grad():
        for fused, names in groups.items():
            pieces = staging[fused].split([sd[n].shape[0] for n in names], dim=0)
            for n, piece in zip(names, pieces):
                sd[n].copy_(piece)
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
    sd = _joined(sd)
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
