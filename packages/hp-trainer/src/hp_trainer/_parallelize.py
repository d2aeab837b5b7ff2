"""``parallelize_llama``: tensor (+ sequence) parallelism, then FSDP/HSDP, applied from outside
to the single-device :class:`~hp_trainer.models.Transformer` (Llama 3 and Qwen3 share its module
structure)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import hp_dtensor as hp

from ._parallel_dims import ParallelDims
from .config import ACTIVATION_ACTIONS, COMPILE_MODES, CUDA_GRAPH_MODES
from .errors import ConfigError, TrainerTypeError, check_instance

__all__ = [
    "ParallelizeConfig",
    "apply_activation_checkpoint",
    "apply_autocast",
    "apply_compile",
    "apply_context_parallel",
    "check_parallelize_config",
    "dp_mesh",
    "head_local",
    "parallelize_llama",
    "resolve_activation_plan",
]


@dataclass(frozen=True)
class ParallelizeConfig:
    """How to parallelize: ``sequence_parallel`` shards norms' activations along the sequence
    between TP regions (less activation memory, same math); ``param_dtype``/``reduce_dtype`` are
    FSDP's mixed precision; ``reshard_after_forward`` as in ``fully_shard`` for the blocks (the
    root keeps its parameters after forward unless it is False); ``cp_*`` and ``seq_len`` for
    context parallelism; ``compile`` runs each block's forward through ``torch.compile``.
    Where FSDP does not apply (one process, or no data parallelism), ``param_dtype`` is
    honoured with ``torch.autocast`` over the model's forward (fp32 parameters, optimizer
    state and gradients; matmuls in ``param_dtype``), as torchtitan does."""

    sequence_parallel: bool = True
    activation_checkpoint: str = "none"  # "none", "full", "selective" or "swap" (per block)
    #: per-module overrides of ``activation_checkpoint`` ({pattern: action}, hp_offload's
    #: patterns); see :func:`apply_activation_checkpoint`
    activation_plan: dict | None = None
    #: FSDP keeps sharded parameters, gradients and optimizer states on the CPU
    cpu_offload: bool = False
    #: tensor parallelism with the sequence-parallel collectives fused into the matmuls
    #: (hp-kernels' MC2; needs ``sequence_parallel``)
    async_tp: bool = False
    #: set by ``pipeline_llama`` for a stage: the activation plan was checked on the whole
    #: model, and a stage holds only some of the modules it names
    _stage: bool = False

    def __post_init__(self) -> None:
        fn = "ParallelizeConfig"
        for arg in ("sequence_parallel", "cp_load_balance", "compile", "cpu_offload", "async_tp"):
            check_instance(getattr(self, arg), bool, arg, fn, "give True or False")
        raf = self.reshard_after_forward
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
            raise TrainerTypeError(
                f"{fn}: reshard_after_forward={raf!r}: give True, False or a group size >= 1"
            )
        if self.activation_checkpoint not in ACTIVATION_ACTIONS:
            raise ConfigError(
                f"{fn}: activation_checkpoint={self.activation_checkpoint!r}: use one of "
                f"{list(ACTIVATION_ACTIONS)}"
            )
        if self.activation_plan is not None:
            check_instance(
                self.activation_plan,
                dict,
                "activation_plan",
                fn,
                "give {pattern: action}, e.g. {'layers.0-3': 'swap'}",
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"{fn}: compile_mode={self.compile_mode!r}: use one of {list(COMPILE_MODES)}"
            )
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(
                f"{fn}: compile_mode={self.compile_mode!r} without compile=True would be "
                "ignored: set compile=True, or leave compile_mode 'default'"
            )
        if self.cp_method not in ("ring", "allgather", "ulysses"):
            raise ConfigError(
                f"{fn}: cp_method={self.cp_method!r}: use 'ring', 'allgather' or 'ulysses'"
            )
        for arg in ("param_dtype", "reduce_dtype"):
            v = getattr(self, arg)
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise TrainerTypeError(
                    f"{fn}: {arg}={v!r}: give a floating torch.dtype (e.g. torch.bfloat16) or None"
                )
        if self.seq_len is not None:
            check_instance(self.seq_len, int, "seq_len", fn, "give the sequence length")
            if self.seq_len < 1:
                raise ConfigError(f"{fn}: seq_len={self.seq_len}: must be at least 1")

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    #: context parallelism over ``cp``: the attention method, head-tail load balancing, and the
    #: length of the training sequences (the rotary tables are sharded to it; None: the
    #: model's max_seq_len)
    cp_method: str = "ring"
    cp_load_balance: bool = True
    seq_len: int | None = None
    compile: bool = False
    #: ``torch.compile``'s mode for the blocks (``config.COMPILE_MODES``); the CUDA-graph modes
    #: on one process without activation checkpointing only
    compile_mode: str = "default"


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


def _async_tp_kernels():
    """hp-kernels' MC2 as the fused collective matmuls of async TP."""
    from hp_dtensor.parallel import CollectiveMatmul
    from hp_kernels import mc2

    return CollectiveMatmul(mc2.all_gather_matmul, mc2.matmul_reduce_scatter, name="hp_kernels")


def _tp_plan(model: nn.Module, tp_mesh, sp: bool, qk_norm: bool, async_tp: bool = False) -> None:
    from hp_dtensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = hp.Shard(1) if sp else hp.Replicate()
    # async TP: the linears that meet the sequence-sharded activations directly (the output
    # head's gather, every row-parallel projection's reduce-scatter) fuse that collective
    # into their matmul (hp-kernels' MC2); the q/k/v and w1/w3 inputs are gathered once per
    # module and shared, as without it
    fused = {"collective_matmul": _async_tp_kernels()} if async_tp else {}
    top = {}  # a pipeline stage may lack the embedding, the final norm or the output
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=hp.Replicate(), output_layouts=seq)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=hp.Replicate(), **fused)
    if sp and model.norm is not None:
        top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in _blocks(model):
        if getattr(block, "moe", None) is not None:
            # the MoE takes the whole sequence on every tp rank (gathered under sequence
            # parallelism) and gives back this rank's part: its experts are split over tp by
            # ExpertTensorParallel / TensorParallel, or run whole on each rank (etp = 1)
            plan = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(seq,),
                    desired_input_layouts=(hp.Replicate(),),
                    use_local_input=True,
                    output_layouts=(hp.Replicate(),),
                    desired_output_layouts=(seq,),
                    use_local_output=True,
                )
            }
        else:
            plan = {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(hp.Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq, **fused),
            }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        enter = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(hp.Replicate(), None, None)
        )
        if getattr(block, "linear_attention", None) is not None:
            # Gated DeltaNet: every projection splits by heads (rows), the output projection by
            # its input columns; the per-head vectors and convolution channels run on this
            # rank's slice, the shared output norm on this rank's heads (partial gradients)
            gdn = block.linear_attention
            plan["linear_attention"] = enter
            for name in ("q", "k", "v", "z", "b", "a"):
                plan[f"linear_attention.in_proj_{name}"] = ColwiseParallel()
            plan["linear_attention.out_proj"] = RowwiseParallel(output_layouts=seq, **fused)
            parallelize_module(block, tp_mesh, plan)
            head_local(gdn, tp_mesh, shard={"A_log": 0, "dt_bias": 0})
            for conv in (gdn.conv_q, gdn.conv_k, gdn.conv_v):
                head_local(conv, tp_mesh, shard={"weight": 0})
            head_local(gdn.norm, tp_mesh, replicate=("weight",))
            continue
        if hasattr(block.attention, "wkv_b"):  # DeepSeek's MLA: heads split, latents whole
            plan["attention.wo"] = RowwiseParallel(output_layouts=seq, **fused)
            parallelize_module(block, tp_mesh, plan)
            _mla_tensor_parallel(block.attention, tp_mesh, seq)
            continue
        plan.update(
            {
                "attention": enter,
                "attention.wq": ColwiseParallel(),  # Qwen3.5: each head's query and gate rows
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=seq, **fused),
            }
        )
        if qk_norm:  # per-head norms see only this rank's heads: their grads are all-reduced
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def _mla_tensor_parallel(att: nn.Module, tp_mesh, seq) -> None:
    """Tensor parallelism for DeepSeek's MLA. The query and key/value up-projections
    (``wq``/``wq_b``, ``wkv_b``) split by heads and ``wo`` by its input columns, as in
    attention; the down-projections to the latents (``wq_a``, ``wkv_a``) and the latent norms
    run whole on every rank. The rotated key ``k_pe`` comes straight out of ``wkv_a`` and is
    shared by all heads, so on each rank its gradient is only this rank's heads' part: the
    region from the attention's input to ``wo`` therefore runs on plain local tensors whose
    gradients are partial over ``tp`` (Megatron's "copy to the tensor-parallel region"), and
    the input's and the replicated weights' gradients are summed over ``tp`` on the way out.
    Splitting the latent projections would cost more communication than they take to compute.
    """
    names = [n for n in ("wq", "wq_b", "wkv_b") if hasattr(att, n)]
    for n in names:
        head_local(getattr(att, n), tp_mesh, shard={"weight": 0})
    for n in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
        if hasattr(att, n):
            m = getattr(att, n)
            head_local(
                m, tp_mesh, replicate=tuple(k for k, v in m._parameters.items() if v is not None)
            )

    def enter(module, args):
        x, *rest = args
        if not isinstance(x, hp.DTensor):
            x = hp.DTensor.from_local(x, tp_mesh, [seq], run_check=False)
        x = x.redistribute(tp_mesh, [hp.Replicate()])
        return (x.to_local(grad_placements=[hp.Partial()]), *rest)

    att.register_forward_pre_hook(enter)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the main stack's, then DeepSeek's MTP modules' blocks."""
    blocks = list(model.layers.values())
    if getattr(model, "mtp", None) is not None:
        blocks += [m.block for m in model.mtp]
    return blocks


class _CPBinding:
    """A module's context-parallel setup (the cp mesh, the sequence length, load balancing):
    configuration, shared (not copied) by a deep copy of the module."""

    def __init__(self, mesh, seq_len: int, load_balance: bool) -> None:
        self.mesh, self.seq_len, self.load_balance = mesh, seq_len, load_balance

    def __deepcopy__(self, memo):
        return self


def apply_context_parallel(
    model: nn.Module, cp_mesh, *, seq_len: int, method: str = "ring", load_balance: bool = True
) -> None:
    """Context parallelism over ``cp_mesh`` for sequences of ``seq_len`` tokens: each block's
    attention runs its ``scaled_dot_product_attention`` as
    ``hp_dtensor.parallel.context_parallel_attention`` (``ContextParallel``, ``method``); Qwen3.5's
    Gated DeltaNet blocks get convolution halos from the previous chunk's rank and the delta
    rule's state passed between ranks (``_cp_delta_rule``: the state maps are all-gathered
    whatever ``method``); and the rotary tables become this rank's positions, laid out as
    ``context_parallel_shard`` lays out the tokens (the model code, which reads the first ``s``
    rows of its tables, is unchanged; a forward pre-hook checks that each batch is this long
    and re-shards tables that ``init_buffers`` rebuilt). Inputs and targets must then be
    ``context_parallel_shard``-ed along the sequence too. Applying it twice is refused."""
    from hp_dtensor.parallel import ContextParallel, parallelize_module

    from .models import Transformer

    if getattr(model, "_hp_cp", None) is not None:
        raise ValueError("apply_context_parallel: the model is context-parallel already")
    binding = _CPBinding(cp_mesh, seq_len, load_balance)
    style = ContextParallel(method=method, load_balance=load_balance)
    for block in _blocks(model):
        gdn = getattr(block, "linear_attention", None)
        if gdn is not None:  # Qwen3.5's Gated DeltaNet: halos and state passing
            for conv in (gdn.conv_q, gdn.conv_k, gdn.conv_v):
                conv._hp_cp = binding
                conv.register_forward_pre_hook(_halo_in)
                conv.register_forward_hook(_halo_out)
            gdn.delta_rule = functools.partial(_cp_delta_rule, cp=binding)
            continue
        parallelize_module(block.attention, cp_mesh, style)
    for m in model.modules():
        if isinstance(m, Transformer):
            m._hp_cp = binding
            _shard_rotary(m, binding)
            m.register_forward_pre_hook(_check_cp_length)


def _shard_rotary(model: nn.Module, b: _CPBinding) -> None:
    """The model's rotary tables: this rank's positions of a ``b.seq_len``-long sequence."""
    from hp_dtensor.parallel import context_parallel_shard

    for name in ("rope_cos", "rope_sin"):
        table = getattr(model, name)[:, : b.seq_len]
        setattr(model, name, context_parallel_shard(table, b.mesh, 1, load_balance=b.load_balance))


def _check_cp_length(model: nn.Module, args) -> None:
    b = model._hp_cp
    local = b.seq_len // b.mesh.size()
    if model.rope_cos.shape[1] != local:  # rebuilt whole (init_buffers after to_empty)
        model.init_buffers()
        _shard_rotary(model, b)
    s = args[0].shape[1]
    if s != local:
        raise ValueError(
            f"context parallelism was set up for sequences of {b.seq_len} tokens ({local} per "
            f"rank); this batch has {s} per rank: give ParallelizeConfig(seq_len=) the "
            "training sequence length, or shard sequences of that length"
        )


def _gather_pieces(t: torch.Tensor, mesh) -> torch.Tensor:
    """Every rank's ``t`` stacked (``[cp, *t.shape]``), differentiably: each rank uses the
    others' pieces its own way, so a piece's gradient is the sum of the ranks' (the gather's
    adjoint reduce-scatters it)."""
    d = hp.DTensor.from_local(t.unsqueeze(0), mesh, [hp.Shard(0)], run_check=False)
    return d.redistribute(mesh, [hp.Replicate()]).to_local(grad_placements=[hp.Partial()])


def _with_grad_of(out: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """``out``, made to depend (with zero weight) on ``gathered``: a rank whose result does not
    use the others' pieces (the first chunk's rank) still takes part in their gradient's
    reduce-scatter, which every rank of the mesh must call."""
    for t in gathered:
        out = out + 0.0 * t.sum()
    return out


def _segments(seq: int, mesh, load_balance: bool) -> tuple[tuple[int, ...], int, list[int]]:
    """This rank's global chunk ids, their local length, and for each global chunk its index
    among every rank's local chunks stacked (rank 0's first)."""
    from hp_dtensor.parallel import _cp_plan as plan

    cp, rank = mesh.size(), mesh.get_local_rank()
    ids = plan.local_chunks(cp, rank, load_balance)
    return ids, seq // len(ids), plan.natural_order(cp, load_balance)


def _halo_in(conv: nn.Module, args):
    """Before a causal depthwise convolution (``ShortConv``) under context parallelism: each
    local chunk prefixed with the last ``kernel - 1`` inputs of the chunk before it in the
    whole sequence (all-gathered: a few tokens per chunk; zeros before the first), so one
    call over ``[halo, chunk, halo, chunk]`` computes every chunk as the whole sequence
    would."""
    (x,) = args
    b = conv._hp_cp
    halo = conv.weight.shape[-1] - 1
    ids, length, order = _segments(x.shape[1], b.mesh, b.load_balance)
    if halo == 0:
        return None
    if length < halo:
        raise ValueError(
            f"context parallelism: chunks of {length} tokens are shorter than the "
            f"convolution's {halo}-token halo: use longer sequences or a lower degree"
        )
    tails = torch.stack([x[:, (i + 1) * length - halo : (i + 1) * length] for i in range(len(ids))])
    every = _gather_pieces(tails, b.mesh).flatten(0, 1)
    pieces = []
    for i, ch in enumerate(ids):
        prev = every[order[ch - 1]] if ch > 0 else torch.zeros_like(every[0])
        pieces += [
            _with_grad_of(prev, every) if ch == 0 else prev,
            x[:, i * length : (i + 1) * length],
        ]
    return (torch.cat(pieces, 1),)


def _halo_out(conv: nn.Module, args, y: torch.Tensor) -> torch.Tensor:
    """After the convolution: the halos' outputs dropped."""
    halo = conv.weight.shape[-1] - 1
    if halo == 0:
        return y
    from hp_dtensor.parallel import _cp_plan as plan

    b = conv._hp_cp
    n = len(plan.local_chunks(b.mesh.size(), b.mesh.get_local_rank(), b.load_balance))
    length = y.shape[1] // n - halo
    return torch.cat(
        [y[:, i * (length + halo) + halo : (i + 1) * (length + halo)] for i in range(n)], 1
    )


def _cp_delta_rule(q, k, v, g, beta, *, chunk: int, cp: _CPBinding):
    """The gated delta rule under context parallelism. The recurrence is affine in its state,
    so each rank first computes, from a zero state, the state map ``S -> M S + N`` of each of
    its chunks; the maps are all-gathered and composed in sequence order, which gives every
    chunk its true initial state; then each chunk runs from it. The chunk-level pieces (the
    triangular solves) are computed once for both passes, and a rank's chunks run side by side
    (stacked along the batch). Differentiable end to end (a chunk's map gets the gradients of
    every later chunk's initial state)."""
    from .models._qwen3_5 import _chunked, delta_rule_outputs, delta_rule_transition

    mesh = cp.mesh
    ids, length, order = _segments(q.shape[1], mesh, cp.load_balance)
    n, bsz = len(ids), q.shape[0]

    def stacked(t):  # [b, n * length, ...] -> [n * b, length, ...]
        return torch.cat([t[:, i * length : (i + 1) * length] for i in range(n)], 0)

    parts = _chunked(*(stacked(t) for t in (q, k, v, g, beta)), chunk)
    m, nn_ = delta_rule_transition(parts)  # [n * b, h, dk, dk], [n * b, h, dk, dv]
    ms = _gather_pieces(m.unflatten(0, (n, bsz)), mesh).flatten(0, 1)
    ns = _gather_pieces(nn_.unflatten(0, (n, bsz)), mesh).flatten(0, 1)
    state = torch.zeros_like(ns[0])
    starts = {}
    for ch in range(max(ids) + 1):  # the whole sequence's chunks in order, up to ours
        starts[ch] = state
        state = ms[order[ch]] @ state + ns[order[ch]]
    init = torch.cat([starts[ch] for ch in ids], 0)
    out = delta_rule_outputs(parts, init, length, v.dtype)  # [n * b, length, h, dv]
    out = torch.cat(out.split(bsz, 0), 1)
    return _with_grad_of(out, ms, ns)


def _expert_parallel(model: nn.Module, parallel_dims: ParallelDims, mesh, expert_mesh) -> list:
    """Experts over ``ep`` (``ExpertParallel``), their hidden width over ``tp`` when ``etp > 1``
    (``ExpertTensorParallel`` / ``TensorParallel``). Returns the MoE layers."""
    from hp_dtensor.parallel import parallelize_module
    from hp_moe import ExpertParallel, ExpertTensorParallel, TensorParallel

    pd = parallel_dims
    moes = [b.moe for b in _blocks(model) if getattr(b, "moe", None) is not None]
    for moe in moes:
        if pd.ep > 1 and pd.etp > 1:
            parallelize_module(moe, expert_mesh["ep", "tp"], {"experts": ExpertTensorParallel()})
        elif pd.ep > 1:
            parallelize_module(moe, expert_mesh["ep"], {"experts": ExpertParallel()})
        elif pd.etp > 1:
            parallelize_module(moe, mesh["tp"], {"experts": TensorParallel()})
    return moes


def _scale_grads(params, factor: float) -> None:
    """Multiply these parameters' gradients by ``factor`` as they are accumulated."""
    for p in params:
        p.register_hook(lambda g, f=factor: g * f)


def _compute_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module``'s forward on copies of its own parameters cast to ``dtype`` (FSDP's
    ``param_dtype`` for parameters it does not manage); the gradients reach the originals in
    their own dtype."""
    inner = module.forward

    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        for n, p in saved.items():
            if p is not None and p.dtype != dtype:
                module._parameters[n] = p.to(dtype)
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def head_local(
    module: nn.Module,
    tp_mesh,
    *,
    shard: dict[str, int] | None = None,
    replicate: tuple[str, ...] = (),
) -> nn.Module:
    """Tensor parallelism for a module whose work splits by heads but is not a Linear: its own
    parameters named in ``shard`` become DTensors split along the given dim over ``tp_mesh``,
    those in ``replicate`` whole DTensors, and its forward (given this rank's heads as plain
    tensors) runs on their local pieces. Gradients of the replicated ones are partial on each
    rank and are all-reduced by the DTensor backward. The model code is unchanged: it reads
    head counts from the tensors."""
    shard = dict(shard or {})
    for name, placement in [
        *((n, hp.Shard(d)) for n, d in shard.items()),
        *((n, hp.Replicate()) for n in replicate),
    ]:
        p = module._parameters[name]
        dt = hp.distribute_tensor(p.data, tp_mesh, [placement])
        module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
    inner = module.forward
    names = (*shard, *replicate)

    def forward(*args, **kwargs):
        saved = {n: module._parameters[n] for n in names}
        for n, p in saved.items():  # read now: FSDP may have swapped the parameter in
            if isinstance(p, hp.DTensor):
                local = p.to_local() if n in shard else p.to_local(grad_placements=[hp.Partial()])
                module._parameters[n] = local
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward
    return module


def resolve_activation_plan(
    model: nn.Module, plan: dict[str, str], *, partial: bool = False
) -> dict[str, str]:
    """Module name -> action for ``plan`` ({pattern: action}, hp_offload's patterns) on
    ``model``. Raises :class:`ConfigError` naming ``activation_checkpoint.plan`` for an unknown
    action, patterns that overlap or nest, or (unless ``partial``: a pipeline stage holds only
    some of the blocks) a pattern that matches nothing."""
    from hp_offload import CheckpointPolicy, OffloadError, OffloadPlan, SwapPolicy

    rules, by_id = {}, {}
    for pattern, action in plan.items():
        if action not in ACTIVATION_ACTIONS:
            raise ConfigError(
                f"activation_checkpoint.plan: {pattern!r}={action!r}: use one of "
                f"{list(ACTIVATION_ACTIONS)}"
            )
        # one distinct object per entry, to map hp_offload's resolution back to the action
        obj = SwapPolicy() if action == "swap" else CheckpointPolicy()
        rules[pattern], by_id[id(obj)] = obj, action
    if partial:  # keep the patterns that match something here
        kept = {}
        for pattern, obj in rules.items():
            try:
                OffloadPlan({pattern: obj}).resolve(model)
            except OffloadError:
                continue
            kept[pattern] = obj
        rules = kept
    if not rules:
        return {}
    try:
        resolved = OffloadPlan(rules).resolve(model)
    except OffloadError as e:
        raise ConfigError(f"activation_checkpoint.plan: {e}") from None
    return {name: by_id[id(obj)] for name, obj in resolved.items()}


def apply_activation_checkpoint(
    model: nn.Module, mode: str, plan: dict[str, str] | None = None, *, partial: bool = False
) -> Any:
    """Activation memory per block, wrapping forwards in place (not the modules in wrappers),
    so parameter names, and with them checkpoints and HuggingFace names, do not change.

    ``mode`` applies to every transformer block: ``"none"``, ``"full"`` or ``"selective"``
    (hp_offload's checkpoint), or ``"swap"`` (the block's saved activations go to host memory
    and come back, prefetched, in backward). ``plan`` maps module-name patterns (hp_offload's
    ``OffloadPlan`` syntax: ``"layers.0-7"``, ``"layers.*.attention"``) to one of those four
    actions; a block that a plan entry matches, contains or lies inside takes the plan's action
    instead of ``mode`` (``partial``: patterns may match nothing in ``model``, a pipeline
    stage). Returns the ``hp_offload.SwapManager`` the swapped regions share (its
    ``step()`` belongs after each step's backward), or None when nothing swaps."""
    from hp_offload import CheckpointPolicy, SwapManager, checkpoint, swap

    actions = resolve_activation_plan(model, plan, partial=partial) if plan else {}
    if mode != "none":
        names = {id(m): n for n, m in model.named_modules()}
        for block in _blocks(model):
            name = names[id(block)]
            if not any(
                n == name or n.startswith(name + ".") or name.startswith(n + ".") for n in actions
            ):
                actions[name] = mode
    manager = SwapManager() if "swap" in actions.values() else None
    for name, action in actions.items():
        if action == "none":
            continue
        module = model.get_submodule(name)
        inner = module.forward
        if action == "swap":

            def forward(*args, _inner=inner, **kwargs):
                return swap(_inner, *args, manager=manager, **kwargs)

        else:
            policy = CheckpointPolicy(mode=action)

            def forward(*args, _inner=inner, _policy=policy, **kwargs):
                return checkpoint(_inner, *args, policy=_policy, **kwargs)

        module.forward = forward
    return manager


def _activation_memory(model: nn.Module, config: ParallelizeConfig) -> None:
    """``apply_activation_checkpoint`` as ``config`` says; the swap manager is the model's
    (``model.swap_manager``), so two models in one process never share one."""
    manager = apply_activation_checkpoint(
        model, config.activation_checkpoint, config.activation_plan, partial=config._stage
    )
    if manager is not None:
        model.swap_manager = manager


def apply_compile(model: nn.Module, mode: str = "default") -> None:
    """Compile each transformer block's forward with ``torch.compile`` (torchtitan compiles per
    block: one block's graph serves every block of the same shapes). The block's own forward is
    replaced, not the module wrapped, so parameter names do not change; FSDP's hooks and
    activation checkpointing stay outside the compiled region (checkpointing re-runs the
    compiled forward).

    MoE layers without expert parallelism or an auxiliary loss are compiled with their block:
    every tensor's shape is then fixed by the batch (the grouped GEMMs read the per-expert
    counts on the device), so the router, the permutation's gathers, the SwiGLU and the combine
    fuse with the block's other kernels. Whether a forward is a recomputation (a MoE layer
    records its statistics on the forward only) is read before the compiled call
    (``hp_moe.hoist_recompute_check``), not in the graph. Where torch has no grouped GEMM for
    the operands the loop of matmuls is a graph break (its row bounds are read on the host;
    never traced, so the routing does not recompile it). A MoE layer stays eager (a graph break
    around it) when its experts are split over an expert-parallel mesh (its all-to-alls size
    their buffers from the routing and run collectives; ``check_parallelize_config`` refuses
    compile with ep > 1 today) or when it has an auxiliary loss: the loss reads whether a
    recomputation is non-reentrant, which split the recomputed graph from the first one
    (checkpointing then found other tensors saved), and the "global" loss's weights read a
    buffer the step updates in place, which a compiled backward would read after the update.

    A MoE layer is traced only where its experts' grouped GEMM is (bf16 operands:
    ``GroupedExperts.takes_grouped_mm``), decided per call on the dtype the experts compute in
    (FSDP's bf16 weights, or autocast's dtype over fp32 parameters): elsewhere (fp32) the
    whole layer runs eagerly. With the loop of matmuls as a graph break inside the traced
    layer, fp32 on an H200 (torch 2.11) gave the forward's values and lost most of the
    gradient through the layer (5% of eager's norm), where the CPU agreed to 1e-6.

    ``mode`` is ``torch.compile``'s (``config.COMPILE_MODES``)."""
    from hp_moe import LocalDispatcher, MoE, hoist_recompute_check

    for block in _blocks(model):
        for m in block.modules():
            if not isinstance(m, MoE):
                continue
            eager = torch.compiler.disable(m.forward)
            if not isinstance(m.experts.dispatcher, LocalDispatcher) or m.aux_loss_coeff > 0:
                m.forward = eager
            else:
                m.forward = _traced_where_grouped(m, m.forward, eager)
        block.forward = hoist_recompute_check(torch.compile(block.forward, mode=mode), block)


def _traced_where_grouped(moe, traced, eager):
    """``moe``'s forward: ``traced`` when its experts take the grouped GEMM for this input
    (``GroupedExperts.takes_grouped_mm``: the dtype they compute in, autocast's included, and
    the shapes; no graph break inside the layer, and a static check the compiled graph guards
    on), else ``eager`` (run outside the graph)."""

    def forward(x, *args, **kwargs):
        if moe.experts.takes_grouped_mm(x):
            return traced(x, *args, **kwargs)
        return eager(x, *args, **kwargs)

    return forward


def apply_autocast(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under ``torch.autocast(dtype)`` on its device type: mixed
    precision without FSDP (parameters, gradients and optimizer state stay in fp32; autocast's
    op lists choose what runs in ``dtype``). Backward follows the forward's casts."""
    device_type = next(model.parameters()).device.type
    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)

    model.forward = forward


def _uses(config: ParallelizeConfig, action: str) -> bool:
    """Whether ``action`` applies to any block: as the mode, or in the per-module plan."""
    return (
        config.activation_checkpoint == action or action in (config.activation_plan or {}).values()
    )


def check_parallelize_config(pd: ParallelDims, config: ParallelizeConfig) -> None:
    """Refuse the options that would have nothing to act on, or that are untested together,
    with a :class:`ConfigError` naming the trainer's config key (``hp-train``'s preflight and
    :func:`parallelize_llama` both call it)."""
    fsdp = pd.dp * pd.cp > 1  # FSDP shards over dp_shard x cp (and replicates over dp_rep.)
    if config.async_tp:
        if pd.tp == 1 or not config.sequence_parallel:
            raise ConfigError(
                "parallelism.async_tp=true fuses sequence parallelism's collectives into the "
                f"matmuls: it needs tensor_parallel_degree > 1 (got {pd.tp}) and "
                "sequence_parallel = true"
            )
        if _uses(config, "selective"):
            raise ConfigError(
                "parallelism.async_tp=true with selective recomputation: the fused kernels "
                "write their matmuls into shared buffers, which selective checkpointing cannot "
                "cache; use activation_checkpoint full or swap, or leave async_tp false"
            )
        if config.seq_len is not None and (config.seq_len // pd.cp) % pd.tp:
            raise ConfigError(
                f"parallelism.async_tp=true: each rank's sequence ({config.seq_len // pd.cp} "
                f"tokens) must divide by tensor_parallel_degree={pd.tp}: change training.seq_len"
            )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        if local_world and local_world % pd.tp:
            raise ConfigError(
                f"parallelism.async_tp=true: hp-kernels' MC2 runs within one host; "
                f"tensor_parallel_degree={pd.tp} does not divide the {local_world} ranks per "
                "host, so a TP group would span hosts: leave async_tp false"
            )
        import hp_kernels

        if not hp_kernels.is_built():
            raise ConfigError(
                "parallelism.async_tp=true runs hp-kernels' MC2, whose compiled module is "
                "missing: reinstall hp-kernels (pip install packages/hp-kernels), or leave "
                "async_tp false"
            )
    if config.compile:
        untested = {
            "tensor_parallel_degree": pd.tp,
            "context_parallel_degree": pd.cp,
            "pipeline_parallel_degree": pd.pp,
            "expert_parallel_degree": pd.ep,
        }
        wrong = [f"{k}={v}" for k, v in untested.items() if v > 1]
        if wrong:
            raise ConfigError(
                "training.compile=true compiles blocks on one process or under FSDP (data "
                f"parallelism); not with {', '.join(wrong)}: set them to 1, or leave "
                "training.compile false"
            )
        if config.compile_mode in CUDA_GRAPH_MODES and pd.world_size > 1:
            raise ConfigError(
                f"training.compile_mode={config.compile_mode!r} captures CUDA graphs, which "
                f"are tested on one process only (this job has {pd.world_size}: FSDP gathers "
                "parameters into new buffers every step, which a graph would replay stale): "
                "use 'default' or 'max-autotune-no-cudagraphs'"
            )
        if _uses(config, "swap"):
            raise ConfigError(
                "training.compile=true with swapped activations (activation_checkpoint swap) "
                "is untested: use full recomputation, or leave compile false"
            )
        if _uses(config, "selective"):
            raise ConfigError(
                "training.compile=true with selective recomputation fails in torch's "
                "selective checkpoint (a tensor it cached is mutated by the compiled block): "
                "use activation_checkpoint full, or leave compile false"
            )
        recomputed = config.activation_checkpoint != "none" or any(
            a != "none" for a in (config.activation_plan or {}).values()
        )
        if config.compile_mode in CUDA_GRAPH_MODES and recomputed:
            raise ConfigError(
                f"training.compile_mode={config.compile_mode!r} captures CUDA graphs, whose "
                "outputs the next replay overwrites; activation checkpointing re-runs the "
                "blocks while their first outputs are still needed (a replay error on the "
                "H200): leave activation_checkpoint none, or use compile_mode 'default'"
            )
    if not fsdp and config.reduce_dtype not in (None, torch.float32):
        raise ConfigError(
            f"training.mixed_precision_reduce={str(config.reduce_dtype).removeprefix('torch.')!r}"
            " sets FSDP's gradient reduction; this job has no data parallelism, so nothing is "
            "reduced: leave it float32"
        )
    if not fsdp and config.param_dtype == torch.float16:
        raise ConfigError(
            "training.mixed_precision_param='float16' without data parallelism is autocast, "
            "which float16 needs loss scaling for (the trainer has none): use bfloat16"
        )
    if not fsdp and pd.pp > 1 and config.param_dtype is not None:
        raise ConfigError(
            f"training.mixed_precision_param={str(config.param_dtype).removeprefix('torch.')!r}"
            " with pipeline parallelism needs data parallelism (FSDP casts each stage's "
            "parameters): add data_parallel_shard_degree > 1, or leave it float32"
        )
    if config.cpu_offload and not fsdp:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload=true offloads FSDP's shards; this job has no data "
            "parallelism: add data_parallel_shard_degree > 1, or leave it false"
        )
    if config.cpu_offload and pd.ep > 1 and pd.etp > 1:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload=true: with expert_tensor_parallel_degree > 1 the "
            "experts are not FSDP's and would stay on the device: set it to 1, or leave "
            "fsdp_cpu_offload false"
        )


def parallelize_llama(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    mesh=None,
    expert_mesh=None,
    config: ParallelizeConfig | None = None,
) -> nn.Module:
    """Parallelize a :class:`Transformer` (Llama 3, Qwen3(-MoE), Qwen3.5(-MoE), DeepSeek-V3)
    in place, in torchtitan's order:

    1. tensor parallelism over ``tp`` (attention heads and the feed-forward width split;
       with ``sequence_parallel`` the norms run on sequence shards; a MoE takes the whole
       sequence); then context parallelism over ``cp`` (``apply_context_parallel``);
    2. expert parallelism: experts over ``ep`` of the ``dp_shard`` ranks, their hidden width
       over ``tp`` when ``etp > 1``;
    3. ``torch.compile`` per block (``config.compile``), then activation checkpointing per
       block (``config.activation_checkpoint``);
    4. FSDP over ``dp_shard`` (HSDP with ``dp_replicate``): each block is one ``fully_shard``
       group, then the root; each MoE's experts first form a group of their own over the
       experts' data-parallel ranks (``efsdp``), with their gradients scaled by ``1 / ep``
       (an expert's gradient sums the tokens of all ``ep`` ranks). Without data
       parallelism there is no FSDP: ``config.param_dtype`` then means autocast.

    ``mesh`` defaults to ``parallel_dims.build_mesh()`` on the model's device type, and
    ``expert_mesh`` to ``parallel_dims.build_expert_mesh()``. Check the model against the
    degrees first (``parallel_dims.check_model``). Returns the model.
    """
    from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from .models import Transformer

    fn = "parallelize_llama"
    check_instance(model, Transformer, "model", fn, "pass an hp_trainer.models.Transformer")
    check_instance(parallel_dims, ParallelDims, "parallel_dims", fn, "build a ParallelDims")
    if config is not None:
        check_instance(config, ParallelizeConfig, "config", fn, "build a ParallelizeConfig")
    config = config or ParallelizeConfig()
    cfg = model.config
    parallel_dims.check_model(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        n_layers=cfg.n_layers,
        ffn_hidden=cfg.ffn_hidden,
        num_experts=cfg.moe.num_experts if cfg.moe is not None else None,
        expert_hidden=cfg.moe.hidden_dim if cfg.moe is not None else None,
        linear_heads=(
            (cfg.linear_num_key_heads, cfg.linear_num_value_heads)
            if cfg.architecture == "qwen3_5"
            else None
        ),
        mtp_layers=cfg.mtp_layers,
    )
    check_parallelize_config(parallel_dims, config)
    if parallel_dims.world_size == 1 and mesh is None:  # one process: no mesh, no FSDP
        if config.compile:
            apply_compile(model, config.compile_mode)
        _activation_memory(model, config)
        if config.param_dtype is not None:
            apply_autocast(model, config.param_dtype)
        return model
    pd = parallel_dims
    device_type = next(model.parameters()).device.type
    if mesh is None:
        mesh = pd.build_mesh(device_type)
    if expert_mesh is None and pd.ep > 1:
        expert_mesh = pd.build_expert_mesh(device_type)
    if pd.tp > 1:
        _tp_plan(model, mesh["tp"], config.sequence_parallel, cfg.qk_norm, config.async_tp)
        model.tie_weights()  # embedding (Shard(0) on vocab) and output (Shard(0)) agree
    if pd.cp > 1:
        apply_context_parallel(
            model,
            mesh["cp"],
            seq_len=config.seq_len or cfg.max_seq_len,
            method=config.cp_method,
            load_balance=config.cp_load_balance,
        )
    moes = _expert_parallel(model, pd, mesh, expert_mesh) if cfg.moe is not None else []
    if config.compile:
        apply_compile(model, config.compile_mode)
    _activation_memory(model, config)
    fsdp_mesh = dp_mesh(mesh, parallel_dims)
    if fsdp_mesh is None and config.param_dtype is not None:  # no FSDP to cast parameters
        apply_autocast(model, config.param_dtype)
    mp = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    offload = CPUOffloadPolicy() if config.cpu_offload else None
    ignored = []
    if pd.ep > 1:
        if pd.etp > 1:  # each expert already split over ep x tp: no data-parallel copies
            ignored = [p for moe in moes for p in moe.experts.parameters()]
            _scale_grads(ignored, 1.0 / pd.ep)
            if mp.param_dtype is not None:  # FSDP does not cast what it ignores
                for moe in moes:
                    _compute_in(moe.experts, mp.param_dtype)
        else:
            for moe in moes:  # (ParallelDims refuses ep > 1 with dp_replicate > 1)
                experts = fully_shard(
                    moe.experts,
                    mesh=expert_mesh["efsdp"],
                    mp_policy=mp,
                    offload_policy=offload,
                    reshard_after_forward=config.reshard_after_forward,
                )
                experts.set_gradient_scaling_factor(1.0 / pd.ep)
    if fsdp_mesh is not None:
        for block in _blocks(model):
            fully_shard(
                block,
                mesh=fsdp_mesh,
                mp_policy=mp,
                offload_policy=offload,
                reshard_after_forward=config.reshard_after_forward,
                ignored_params=ignored,
            )
        # the root keeps its parameters after forward (backward needs them first), as
        # torchtitan's root does; False still means "never reshard"
        root_raf = None if config.reshard_after_forward is True else config.reshard_after_forward
        fully_shard(
            model,
            mesh=fsdp_mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=root_raf,
            ignored_params=ignored,
        )
    return model
