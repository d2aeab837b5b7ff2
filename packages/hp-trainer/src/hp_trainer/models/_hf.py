"""HuggingFace checkpoints: name maps both ways, ``from_pretrained`` and ``save_pretrained``.

Weights are read with hp_dcp straight from the safetensors files, by byte range, into whatever
sharding the model already has; sharded models are written through an hp_dcp checkpoint and
exported from it one tensor at a time.
"""

from __future__ import annotations

import json
import os
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

# (our name, HuggingFace name): tables read both ways. {i} is a block index, {x} one of the
# letters or words in braces after it, {p} "weight" or "bias", {rest} any tail.
_COMMON = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.feed_forward.w1.{p}", "model.layers.{i}.mlp.gate_proj.{p}"),
    ("layers.{i}.feed_forward.w3.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
    ("layers.{i}.feed_forward.w2.{p}", "model.layers.{i}.mlp.down_proj.{p}"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.linear_attention.{rest}", "model.layers.{i}.linear_attn.{rest}"),
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    # routed experts: ours one [E, ...] tensor, theirs one per expert ({e}: the expert)
    ("layers.{i}.moe.experts.w1.{e}", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"),
    ("layers.{i}.moe.experts.w3.{e}", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
    ("layers.{i}.moe.experts.w2.{e}", "model.layers.{i}.mlp.experts.{e}.down_proj.weight"),
]
_ATTENTION = [
    ("layers.{i}.attention.w{x:qkvo}.{p}", "model.layers.{i}.self_attn.{x}_proj.{p}"),
    ("layers.{i}.attention.{x:qk}_norm.weight", "model.layers.{i}.self_attn.{x}_norm.weight"),
]
_MLA = [  # DeepSeek's multi-head latent attention
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wq_a.{p}", "model.layers.{i}.self_attn.q_a_proj.{p}"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("layers.{i}.attention.wq_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight"),
    ("layers.{i}.attention.wkv_a.{p}", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.{p}"),
    ("layers.{i}.attention.kv_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    ("layers.{i}.attention.wkv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"),
    ("layers.{i}.attention.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.moe.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    (
        "layers.{i}.moe.shared_experts.w1.weight",
        "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    ),
    (
        "layers.{i}.moe.shared_experts.w3.weight",
        "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    ),
    (
        "layers.{i}.moe.shared_experts.w2.weight",
        "model.layers.{i}.mlp.shared_experts.down_proj.weight",
    ),
]
_QWEN_SHARED = [  # Qwen3.5-MoE's gated shared expert
    (
        "layers.{i}.moe.shared_experts.w1.weight",
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    ),
    (
        "layers.{i}.moe.shared_experts.w3.weight",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    ),
    (
        "layers.{i}.moe.shared_experts.w2.weight",
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    ),
    ("layers.{i}.moe.shared_expert_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight"),
]
_FIELDS = {"i": r"\d+", "e": r"\d+", "p": "weight|bias", "rest": ".+"}


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


def _rules(names):
    return (
        [(_pattern(ours, (ours, hf)), hf) for ours, hf in names],
        [(_pattern(hf, (ours, hf)), ours) for ours, hf in names],
    )


_TABLES = {
    "dense": _rules(_COMMON + _ATTENTION),
    "deepseek_v3": _rules(_COMMON + _MLA),
    "qwen3_5_moe": _rules(_COMMON + _ATTENTION + _QWEN_SHARED),
}


def _apply(rules, name: str, what: str) -> str:
    for pat, target in rules:
        m = pat.fullmatch(name)
        if m:
            return _fill(target, m.groupdict())
    raise ConfigError(f"{what} {name!r} has no HuggingFace counterpart")


def _table(cfg: TransformerConfig | None) -> str:
    if cfg is None:
        return "dense"
    if cfg.architecture == "deepseek_v3":
        return "deepseek_v3"
    if cfg.architecture == "qwen3_5" and cfg.moe is not None:
        return "qwen3_5_moe"
    return "dense"


_MTP_OURS = re.compile(r"mtp\.(\d+)\.(.+)")
_MTP_PARTS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


def hf_name(name: str, cfg: TransformerConfig | None = None) -> str:
    """Our parameter name -> the HuggingFace name (of ``cfg``'s family; dense Llama/Qwen3/Qwen3.5
    by default). DeepSeek-V3's MTP module ``k`` is HuggingFace's block ``n_layers + k``; a routed
    expert ``e`` of ``layers.i.moe.experts.w1`` is ``layers.i.moe.experts.w1.{e}``."""
    m = _MTP_OURS.fullmatch(name)
    if m and cfg is not None:
        block = f"model.layers.{cfg.n_layers + int(m.group(1))}"
        rest = m.group(2)
        if rest in _MTP_PARTS:
            return f"{block}.{_MTP_PARTS[rest]}"
        if rest.startswith("block."):
            inner = hf_name(f"layers.0.{rest[len('block.') :]}", cfg)
            return inner.replace("model.layers.0.", f"{block}.", 1)
    return _apply(_TABLES[_table(cfg)][0], name, "parameter")


def our_name(name: str, cfg: TransformerConfig | None = None) -> str:
    """A HuggingFace parameter name -> ours (inverse of :func:`hf_name`)."""
    if cfg is not None and cfg.mtp_layers:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and int(m.group(1)) >= cfg.n_layers:
            k, rest = int(m.group(1)) - cfg.n_layers, m.group(2)
            for ours, theirs in _MTP_PARTS.items():
                if rest == theirs:
                    return f"mtp.{k}.{ours}"
            inner = our_name(f"model.layers.0.{rest}", cfg)
            return inner.replace("layers.0.", f"mtp.{k}.block.", 1)
    return _apply(_TABLES[_table(cfg)][1], name, "HuggingFace tensor")


def _experts(sd: dict) -> list[str]:
    """The routed-expert tensors (``[E, ...]``, one HuggingFace tensor per expert) of ``sd``."""
    return [k for k in sd if re.fullmatch(r".*\.moe\.experts\.w[123]", k)]


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


_EXPERT_BIAS = re.compile(r".*\.moe\.expert_bias")


def _without_hf_bias(sd: dict, cfg: TransformerConfig) -> tuple[dict, list[str]]:
    """``sd`` without the expert-bias buffers when ``cfg``'s HuggingFace family has none
    (only DeepSeek-V3 stores its ``e_score_correction_bias``; a Qwen MoE trained with
    auxiliary-loss-free balancing carries one we add), and their names."""
    if cfg.architecture == "deepseek_v3":
        return sd, []
    dropped = [k for k in sd if _EXPERT_BIAS.fullmatch(k)]
    return {k: v for k, v in sd.items() if k not in dropped}, dropped


def _hf_targets(sd: dict, cfg: TransformerConfig, device) -> tuple[dict, dict, dict]:
    """``(target, staging, groups)``: HuggingFace name -> the tensor to load it into. A routed
    expert's tensor is a view of its row of ours (loaded in place); a Gated DeltaNet's fused
    tensor lands in ``staging`` and is split into our ``groups`` parts afterwards. An expert
    bias the family does not store is left out (it starts at zero, as the model built it)."""
    sd, _ = _without_hf_bias(sd, cfg)
    groups = _fused_groups(sd)
    parts = {p for names in groups.values() for p in names}
    experts = set(_experts(sd))
    target, staging = {}, {}
    for k, v in sd.items():
        if k in parts:
            continue
        if k in experts:  # one HuggingFace tensor per expert: a view of each row
            for e in range(v.shape[0]):
                target[hf_name(f"{k}.{e}", cfg)] = v[e]
            continue
        target[hf_name(k, cfg)] = v
    for fused, names in groups.items():
        first = sd[names[0]]
        rows = sum(sd[n].shape[0] for n in names)
        staging[fused] = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=device)
        target[hf_name(fused, cfg)] = staging[fused]
    return target, staging, groups


def from_pretrained(
    path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_seq_len: int | None = None,
    config: TransformerConfig | None = None,
) -> Transformer:
    """Build our model from a local HuggingFace folder (``config.json`` + safetensors) of a
    Llama, Qwen3, Qwen3-MoE, Qwen3.5(-MoE) or DeepSeek-V3 checkpoint. The model is created on
    the meta device, materialised on ``device`` (default CPU) and filled from the files by byte
    range, every tensor straight into its place (routed experts one row at a time); ``dtype``
    casts it. DeepSeek-V3's multi-token prediction modules are read when the folder has them
    (transformers saves none: they keep their initialisation then). ``config``: build this
    configuration instead of the folder's (the same shapes; other training settings, such as
    the MoE balancing, may differ)."""
    from ..errors import check_instance

    check_instance(path, (str, os.PathLike), "path", "from_pretrained", "give the folder's path")
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"from_pretrained: {str(path)!r} has no config.json")
    cfg = config or TransformerConfig.from_hf(
        json.loads(cfg_file.read_text()), max_seq_len=max_seq_len
    )
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(device)  # what the checkpoint lacks (MTP modules) starts initialised
    sd = _weights(model)
    target, staging, groups = _hf_targets(sd, cfg, device)
    if cfg.mtp_layers:
        stored = set(hp_dcp.open_checkpoint(path).metadata.tensors)
        mtp = {k for k in target if our_name(k, cfg).startswith("mtp.")}
        target = {k: v for k, v in target.items() if k not in mtp or k in stored}
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


def _per_expert(sd: dict) -> dict:
    """``sd`` with each routed-expert tensor replaced by one entry per expert (``name.e``);
    DTensors are gathered whole first (collective: every rank gets them)."""
    out = dict(sd)
    for k in _experts(sd):
        full = _full(out.pop(k))
        for e in range(full.shape[0]):
            out[f"{k}.{e}"] = full[e]
    return out


def save_pretrained(model: Transformer, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and ``model-*.safetensors`` shards + index that
    ``transformers.AutoModelForCausalLM.from_pretrained`` reads (routed experts one tensor per
    expert, as HuggingFace stores them; DeepSeek-V3's MTP modules as blocks after the main
    ones). A sharded model (DTensor parameters) is saved collectively through an hp_dcp
    checkpoint and exported by rank 0. Raises :class:`ConfigError`, before any collective, for
    a configuration transformers cannot express, and for a Qwen MoE whose expert bias (ours,
    from auxiliary-loss-free balancing; Qwen has no such tensor) is not zero: transformers
    would route differently."""
    path = Path(path)
    cfg = model.config
    hf_config = cfg.to_hf()
    sd, biases = _without_hf_bias(_weights(model), cfg)
    moved = [k for k in biases if _full(model.get_buffer(k)).abs().max() > 0]
    if moved:
        raise ConfigError(
            f"save_pretrained: {', '.join(moved)} {'is' if len(moved) == 1 else 'are'} not "
            f"zero, and "
            f"transformers' {cfg._hf_family()} has no expert bias: the exported model would "
            "route differently: train it without moe.load_balance_coeff"
        )
    sharded = any(isinstance(v, DTensor) for v in sd.values())
    sd = _per_expert(_joined(sd))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def name_map(name):
        return hf_name(name, cfg)

    if sharded:
        tmp = path / ".hp_dcp_checkpoint"
        hp_dcp.save(sd, checkpoint_id=tmp)
        if rank == 0:
            hp_dcp.export_hf(tmp, path, name_map=name_map, max_shard_bytes=max_shard_bytes)
            shutil.rmtree(tmp)
    elif rank == 0:
        hp_dcp.save_hf(sd, path, name_map=name_map, max_shard_bytes=max_shard_bytes)
    if rank == 0:
        (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
