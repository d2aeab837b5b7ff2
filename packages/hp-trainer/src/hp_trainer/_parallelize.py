"""``parallelize_llama``: tensor (+ sequence) parallelism, then FSDP/HSDP, applied from outside
to the single-device :class:`~hp_trainer.models.Transformer` (Llama 3 and Qwen3 share its module
structure)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

import hp_dtensor as hp

from ._parallel_dims import ParallelDims
from .errors import ConfigError

__all__ = ["ParallelizeConfig", "apply_activation_checkpoint", "dp_mesh", "parallelize_llama"]


@dataclass(frozen=True)
class ParallelizeConfig:
    """How to parallelize: ``sequence_parallel`` shards norms' activations along the sequence
    between TP regions (less activation memory, same math); ``param_dtype``/``reduce_dtype`` are
    FSDP's mixed precision; ``reshard_after_forward`` as in ``fully_shard``."""

    sequence_parallel: bool = True
    activation_checkpoint: str = "none"  # "none", "full" or "selective" (per block)
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True


def dp_mesh(mesh, parallel_dims: ParallelDims):
    """The mesh FSDP shards over: ``(dp_replicate, dp_shard[_cp])`` for HSDP, the (flattened)
    shard dimension otherwise; None when there is no data parallelism."""
    names = mesh.mesh_dim_names or ()
    shard = (
        "dp_shard_cp"
        if parallel_dims.cp > 1 and parallel_dims.dp_shard > 1
        else ("cp" if parallel_dims.cp > 1 else "dp_shard")
    )
    if parallel_dims.dp_replicate > 1:
        return (
            mesh["dp_replicate", shard]
            if (shard in names or shard == "dp_shard_cp")
            else mesh["dp_replicate"]
        )
    if shard in names or shard == "dp_shard_cp":
        return mesh[shard]
    return None


def _tp_plan(model: nn.Module, tp_mesh, sp: bool, qk_norm: bool) -> None:
    from hp_dtensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = hp.Shard(1) if sp else hp.Replicate()
    top = {}  # a pipeline stage may lack the embedding, the final norm or the output
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=hp.Replicate(), output_layouts=seq)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=hp.Replicate())
    if sp and model.norm is not None:
        top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(hp.Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(hp.Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if qk_norm:  # per-head norms see only this rank's heads: their grads are all-reduced
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    """Run each block's forward under hp_offload's checkpoint (``mode`` "full" or "selective").
    The block's forward is wrapped in place rather than the block in a wrapper module, so
    parameter names, and with them checkpoints and HuggingFace names, do not change."""
    from hp_offload import CheckpointPolicy, checkpoint

    policy = CheckpointPolicy(mode=mode)
    for block in model.layers.values():
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, policy=policy, **kwargs)

        block.forward = forward


def parallelize_llama(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    mesh=None,
    config: ParallelizeConfig | None = None,
) -> nn.Module:
    """Parallelize a Llama 3 / Qwen3 :class:`Transformer` in place, in this order:

    1. tensor parallelism over ``tp`` (attention heads and the feed-forward width split;
       with ``sequence_parallel`` the norms run on sequence shards);
    2. activation checkpointing per block (``config.activation_checkpoint``);
    3. FSDP over ``dp_shard`` (HSDP with ``dp_replicate``): each block is one ``fully_shard``
       group, then the root.

    ``mesh`` defaults to ``parallel_dims.build_mesh()`` on the model's device type. Check the
    model against the degrees first (``parallel_dims.check_model``). Returns the model.
    """
    from hp_fsdp import MixedPrecisionPolicy, fully_shard

    config = config or ParallelizeConfig()
    cfg = model.config
    parallel_dims.check_model(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        n_layers=cfg.n_layers,
        ffn_hidden=cfg.ffn_hidden,
    )
    if parallel_dims.world_size == 1 and mesh is None:  # one process: only checkpointing applies
        if config.activation_checkpoint != "none":
            apply_activation_checkpoint(model, config.activation_checkpoint)
        return model
    if mesh is None:
        mesh = parallel_dims.build_mesh(next(model.parameters()).device.type)
    if parallel_dims.tp > 1 and cfg.architecture == "qwen3_5":
        raise ConfigError(
            "parallelism.tensor_parallel_degree > 1 is not supported for qwen3_5 yet (Gated "
            "DeltaNet heads are not split): use FSDP/HSDP or pipeline parallelism"
        )
    if parallel_dims.tp > 1:
        _tp_plan(model, mesh["tp"], config.sequence_parallel, cfg.qk_norm)
        model.tie_weights()  # embedding (Shard(0) on vocab) and output (Shard(0)) agree
    if config.activation_checkpoint != "none":
        apply_activation_checkpoint(model, config.activation_checkpoint)
    fsdp_mesh = dp_mesh(mesh, parallel_dims)
    if fsdp_mesh is not None:
        mp = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
        for block in model.layers.values():
            fully_shard(
                block,
                mesh=fsdp_mesh,
                mp_policy=mp,
                reshard_after_forward=config.reshard_after_forward,
            )
        fully_shard(
            model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=config.reshard_after_forward
        )
    return model
