"""The memory and step-time models of one configuration. Pure Python.

``estimate(spec, plan, workload, gpu, cluster)`` returns an :class:`Estimate`: the peak memory
of the fullest rank (:class:`MemoryEstimate`) and the step time of the slowest
(:class:`StepTime`), each broken down by cause, for what hp-trainer runs with those settings:

NOTE [What the trainer keeps]
- FSDP (whenever dp x cp > 1) keeps each rank's shard of every parameter in fp32, its
  gradient in fp32 (``mixed_precision_reduce = float32``) and AdamW's two fp32 moments: 16
  bytes per sharded parameter. Dense parameters are split over tp (the ``tp`` class of
  NOTE [Parameter classes]) and sharded over dp_shard x cp; routed experts are split over
  ep x etp and sharded over the experts' own data-parallel ranks (dp_shard / ep). Without
  FSDP the same 16 bytes are whole, plus the bf16 copies autocast casts for the matmuls.
- FSDP reshards each block after its forward; the root (embedding, final norm, output) stays
  gathered (bf16) from forward to backward. In backward a block is gathered with the next one
  prefetched; its gradients are made in bf16 and packed into an fp32 reduce-scatter input (the
  block's whole gradients) with an fp32 output (its shard). hp_fsdp lets go of the input once
  the reduce-scatter is done (before the next block packs) and holds the output until the
  backward's end (``ParamGroup._rs``), when the outputs become the gradient shards (or are added
  into the earlier micro-steps' and freed) and the root is reduced: by the last block's backward
  that is 4 / shard bytes per parameter of every other block, and one block's 4 bytes per
  parameter. A block's pack holds its parameters, its whole bf16 gradients, the next block
  prefetched and its input at once. The head's gradients (output projection, final norm) exist
  from the first block's backward, the embedding's at the end.
- Under a pipeline, hp-pipeline's UNSHARD gathers every stage once per step and keeps it (with
  its bf16 gradients, no fp32 shard of any) until RESHARD reduces all groups at once (one
  group's fp32 input at a time, each group's gradients let go of as it is packed, the fp32
  outputs adding up); the last stage keeps each microbatch's detached logits (all m by its last
  microbatch's loss) and concatenates them after RESHARD (2 m then). On gloo
  (``Cluster.holds_sends``) a send's work reports completion only once waited, so every tensor a
  rank sent (hidden states forward, their gradients back) stays until the step's end; on NCCL it
  is let go at the next compute step.
- Activations: NOTE [Saved activations] in ``_layers``, times the microbatches in flight
  (``_pipeline.inflight``); the last stage keeps the fp32 log-softmax of
  ``F.cross_entropy(logits.float())`` (4 bytes per logit: the bf16 logits and their fp32 copy
  are gone once the loss is computed) and, in its backward, that output's gradient and the
  input's (8 more), and the head's inputs (the final norm's, with its rstd, and the output
  projection's). A block's backward is fullest in its SwiGLU's backward: the block's whole set
  (recomputed, where it kept less: its kept part is not made twice) and
  ``_layers.backward_transient`` (the gradients of the block's output, w2's input and the
  SwiGLU's two inputs, less the product w2's weight gradient consumed), with w2's weight
  gradient made. The rotary tables (fp32 cos and sin of the rank's positions) stay all along.
- The peak is the fullest of the step's moments, each summed by cause: the loss's backward
  (every saved set, the log-softmax buffers, the weight copies still saved), the forward's end
  (autocast's whole cache of copies, the logits), a block's backward and its pack (the first,
  the second-to-last, the last: the saved sets of the blocks left, the FSDP buffers and
  gradients of the blocks done), the embedding's backward and the root's reduce-scatter (every
  block's gradients), under a pipeline also its last backward (one microbatch, every send held),
  RESHARD and the outputs' concatenation, and the optimizer step (fp32 parameters, gradients,
  two moments and foreach AdamW's sqrt of the second: 20 bytes per sharded parameter). Gradients
  exist while a microbatch runs only after the step's first backward
  (``zero_grad(set_to_none=True)``), so with one microbatch and no pipeline they are not beside
  the activations. Checked on one H200 (1.3B and Llama-3.2-1B, no / full / selective / swap /
  two micro-steps): within 0.4% of the allocated peaks; against ``hp-plan dry-run`` on 4 CPU
  ranks (benchmarks/RESULTS.md) and a fake 8-rank Llama 3 8B (no / full recomputation): within
  1.6%.
- Without FSDP (autocast): the residual stream is fp32, each projection saves its own bf16
  copy of its norm's output, every matmul saves its weight's bf16 copy (the embedding's
  lookup casts nothing); a checkpointed block saves none, the output projection its own.
- Swap keeps hp-offload's in-flight window (1 GiB of device copies not yet on the host) and
  two blocks' sets being prefetched back.
- The allocated peak times the calibration's fragmentation factor, plus its runtime reserve,
  must fit the GPU's memory.

NOTE [Where time goes]
- Compute: FLOPs of dense GEMMs, attention and grouped GEMMs at the calibration's measured
  rates; backward is 2x the GEMMs and 2.5x attention. Memory-bound kernels (norms, RoPE,
  SwiGLU, residual adds, autocast's casts of activations and weights, gradient sums, the
  logits' loss, permutations; gradient accumulation) are bytes read + written, forward and
  backward each derived op by op (NOTE [Element-wise traffic] in ``_layers``), at the
  calibration's element-wise bandwidth (``rates.elementwise_gbps``; the memory bandwidth where
  the file has none).
- Exposed communication: tensor-parallel all-gathers / reduce-scatters (sequence parallelism)
  and the logits' all-gather sit on the critical path (hp-trainer's default is not async TP);
  the context-parallel ring runs unoverlapped (``ContextParallel``); expert all-to-alls too
  (per MoE block two of tokens and two small ones, the routed counts and the gate values,
  forward; two and one backward).
  FSDP's all-gather of block i overlaps block i-1's forward (the first is exposed), its
  reduce-scatter the next block's backward; the last reduce-scatters and the root's are
  exposed. Overlap hides ``cluster.overlap`` of what fits under the compute (1 on NCCL; about
  0 for gloo on CPU ranks that share their cores: NOTE [Collectives]). Under a pipeline the
  once-per-step gather and reduction are exposed, and the bubble comes from the schedule
  (closed form, or hp-pipeline's simulator). Gradient clipping all-reduces the norm's partial
  sums (scalars) as ``clip_grad_norm_`` groups the parameters, and ``train_step`` two more
  scalars over the world (the loss's mean, the flags every rank must agree on): latency.
- Host dispatch (NOTE [Host ops] in ``_layers``): where the calibration prices it (CPU
  ranks, whose device is the host), each block's and the step's aten ops times its
  ``host_us_per_op``, forward and backward, a recomputed forward's again.
- Recomputation runs a block's forward again in backward (its collectives too); selective
  recomputes the element-wise work and a MoE's experts, plus the calibration's per-block
  host overhead; swap adds what hp_offload's SwapManager timeline gives (one copy at a time
  over the host link, the forward throttled past the in-flight cap, prefetch in backward:
  ``_offload.simulate``) and its per-block host overhead.
- The optimizer step reads and writes the fp32 shards (AdamW and clipping: 32 bytes per
  parameter) at the calibration's optimizer rate (``rates.optimizer_gbps``, measured by
  ``hp-plan calibrate``; the memory bandwidth where the file has none).
Not modelled yet: contention between collectives sharing a link, GEMMs slowed by concurrent
communication kernels, host-bound GPU steps (host work that runs ahead of the kernels), load
imbalance between experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _layers as L
from ._hardware import GIB, Cluster, GpuCalibration
from ._pipeline import inflight, makespan
from ._plan import Plan, StageLayout, Workload
from ._spec import LayerParams, ModelSpec
from .errors import PlanError, PlanTypeError

__all__ = ["Estimate", "Evaluator", "MemoryEstimate", "StepTime", "estimate"]

SWAP_WINDOW = 1 * GIB  # hp_offload.SwapManager's default max_inflight_bytes
_RS = 4  # bytes per gradient value reduced (mixed_precision_reduce = float32)
_STATE = 16  # fp32 parameter, gradient and two AdamW moments per sharded parameter
_OPT_BYTES = 32  # AdamW + clipping traffic per sharded parameter
_ADAM_TEMP = 4  # foreach AdamW's fp32 sqrt(exp_avg_sq) of every parameter, during the step
_RSTD = 4  # fp32 reciprocal RMS per token an RMSNorm saves
#: all-to-alls of one MoE block under expert parallelism, (tokens, small) in the forward (the
#: routed counts, the dispatched rows, their gate values, the combine) and in the backward (rows,
#: gates and combine reversed), as hp-moe runs them (tests/unit/test_host_ops.py); the small ones
#: are priced at their latency
EP_ALL_TO_ALLS = ((2, 2), (2, 1))
_STEP_SCALARS = 2  # train_step's all-reduces over the world: the loss's mean, the flags' MAX


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of the fullest rank (``rank``), in bytes, by cause. ``allocated`` is the
    sum; ``peak`` what the allocator reserves (``allocated x fragmentation + reserve``)."""

    rank: int
    parameters: float
    gradients: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    logits: float
    other: float
    fragmentation: float
    reserve: float
    host: float = 0.0  # pinned host bytes the rank's swapped activations take (swap only)
    phase: str = "loss"  # when the peak is: "loss", "forward", "backward" or "optimizer"

    @property
    def allocated(self) -> float:
        """The allocated peak."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.fsdp_buffers
            + self.activations
            + self.logits
            + self.other
        )

    @property
    def peak(self) -> float:
        """Reserved peak: what must fit the device."""
        return self.allocated * self.fragmentation + self.reserve

    def rows(self) -> list[tuple[str, float]]:
        """``(cause, bytes)`` pairs, for printing."""
        return [
            ("parameters (fp32 shards)", self.parameters),
            ("gradients (fp32 shards)", self.gradients),
            ("optimizer (AdamW moments, step temporaries)", self.optimizer),
            ("FSDP gathered params/grads and buffers", self.fsdp_buffers),
            ("activations", self.activations),
            ("logits and loss", self.logits),
            ("other (autocast / expert copies, CP ring, rotary tables)", self.other),
        ]


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest rank, by cause (their sum is ``total``)."""

    compute: float
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_bubble: float
    pp_comm: float
    fsdp_exposed: float
    optimizer: float
    swap: float
    simulated: bool = False
    #: the host's dispatch of every aten op, where it adds to the step (NOTE [Host ops])
    host: float = 0.0

    @property
    def total(self) -> float:
        """The step time."""
        return (
            self.compute
            + self.recompute
            + self.tp_comm
            + self.cp_comm
            + self.ep_comm
            + self.pp_bubble
            + self.pp_comm
            + self.fsdp_exposed
            + self.optimizer
            + self.swap
            + self.host
        )

    def rows(self) -> list[tuple[str, float]]:
        """``(cause, seconds)`` pairs."""
        return [
            ("compute", self.compute),
            ("recompute", self.recompute),
            ("TP comm", self.tp_comm),
            ("CP comm", self.cp_comm),
            ("EP all-to-all", self.ep_comm),
            ("PP bubble", self.pp_bubble),
            ("PP transfers", self.pp_comm),
            ("FSDP exposed", self.fsdp_exposed),
            ("optimizer", self.optimizer),
            ("swap", self.swap),
            ("host dispatch", self.host),
        ]

    def biggest_overhead(self) -> tuple[str, float]:
        """The largest cause other than compute, and its share of the step."""
        name, t = max(self.rows()[1:], key=lambda r: r[1])
        return name, t / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class Estimate:
    """A configuration's predicted memory and step time, and the figures derived from them."""

    plan: Plan
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    layout: StageLayout = field(repr=False)

    def fits(self, gpu: GpuCalibration) -> bool:
        """Whether the reserved peak fits ``gpu``'s memory (and swapped activations its host
        memory per GPU, where the calibration gives one)."""
        return self.memory.peak <= gpu.memory and self.fits_host(gpu)

    def fits_host(self, gpu: GpuCalibration) -> bool:
        """Whether the swapped activations fit ``gpu``'s host memory per GPU."""
        return gpu.host_memory is None or self.memory.host <= gpu.host_memory


# -- sharding -----------------------------------------------------------------------------------


def _expert_shard(plan: Plan) -> int:
    """Ranks one expert parameter is split over (NOTE [What the trainer keeps])."""
    if plan.ep > 1:
        return plan.ep * plan.tp if plan.etp > 1 else plan.dp_shard
    return (plan.tp if plan.etp > 1 else 1) * plan.fsdp_shard


def _expert_gathered(plan: Plan) -> int:
    """Ranks an expert is split over while FSDP has it gathered (0: FSDP does not own it)."""
    if plan.ep > 1:
        return 0 if plan.etp > 1 else plan.ep
    return plan.tp if plan.etp > 1 else 1


def _sharded(p: LayerParams, plan: Plan) -> float:
    """Parameters of ``p`` one rank keeps (its shards)."""
    fs = plan.fsdp_shard
    return p.tp / (plan.tp * fs) + p.replicated / fs + p.experts / _expert_shard(plan)


def _gathered(p: LayerParams, plan: Plan) -> float:
    """Parameters of ``p`` FSDP gathers on one rank (experts FSDP does not own excluded)."""
    g = _expert_gathered(plan)
    return p.tp / plan.tp + p.replicated + (p.experts / g if g else 0.0)


def _autocast(plan: Plan, ab: int) -> bool:
    """Whether the trainer runs ``plan`` under ``torch.autocast`` (no FSDP to cast the fp32
    parameters, a compute dtype narrower than fp32)."""
    return not plan.fsdp and ab < 4


# -- blocks ---------------------------------------------------------------------------------------


class _Ctx:
    """What every block of one microbatch shape shares: the tokens, the degrees that shape a
    block's work, the hardware. Depends on the data-parallel degrees only through whether FSDP
    applies, so stage costs are shared (cached) between plans that differ only there."""

    def __init__(
        self,
        spec,
        tokens,
        seq,
        tp,
        cp,
        ep,
        etp,
        gpu,
        cluster,
        autocast=False,
        fsdp=True,
        pipelined=False,
    ):
        self.spec, self.gpu, self.cluster = spec, gpu, cluster
        self.fsdp = fsdp  # the blocks are FSDP groups (their hooks' ops: NOTE [Host ops])
        self.pipelined = pipelined  # under a pipeline those hooks run once a step
        self.tokens, self.seq = tokens, seq
        self.tp, self.cp, self.ep, self.etp = tp, cp, ep, etp
        self.ab = gpu.act_bytes
        self.autocast = autocast  # fp32 parameters under torch.autocast (no FSDP)
        # the trainer's mesh: pp, dp_replicate, dp_shard, cp, tp (innermost); ep inside dp_shard
        self.cp_stride = tp
        self.ep_stride = tp * cp

    def coll(self, kind, size, stride, nbytes):
        return self.cluster.collective(kind, size, stride, nbytes)


_FIELDS = ("f", "fc", "bi", "bw", "recompute", "tp", "cp", "ep", "swap", "hf", "hb")


@dataclass
class _Acc:
    """Seconds of one microbatch on one stage (or rank), by cause. ``f`` forward compute, ``fc``
    the forward's exposed collectives (also counted in ``tp`` / ``cp`` / ``ep``), ``bi`` / ``bw``
    input- / weight-gradient compute, ``hf`` / ``hb`` the host's dispatch in the forward /
    backward (NOTE [Host ops] in ``_layers``: 0 unless the calibration prices it)."""

    f: float = 0.0
    fc: float = 0.0
    bi: float = 0.0
    bw: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    swap: float = 0.0
    hf: float = 0.0
    hb: float = 0.0

    @property
    def forward(self) -> float:
        """The forward pass, collectives and host dispatch included."""
        return self.f + self.fc + self.hf

    @property
    def total(self) -> float:
        """Forward and backward."""
        return (
            self.f
            + self.bi
            + self.bw
            + self.recompute
            + self.tp
            + self.cp
            + self.ep
            + self.swap
            + self.hf
            + self.hb
        )

    def add(self, other: _Acc) -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _block_time(c: _Ctx, kind, mode: str, acc: _Acc, count: int) -> tuple[float, float]:
    """Add ``count`` blocks of ``kind`` to ``acc``; return one block's (forward, backward)
    seconds for FSDP's overlap model."""
    spec, gpu = c.spec, c.gpu
    tp, cp, ep = c.tp, c.cp, c.ep
    w = L.work(spec, kind, c.tokens, c.seq, tp, c.etp, c.ab, c.autocast, c.seq // cp)
    t_mm = w.matmul / gpu.matmul_flops
    t_at = w.attention / gpu.attention_flops
    t_gg = w.grouped / gpu.grouped_gemm_flops
    rate = gpu.elementwise_rate
    t_el = w.elementwise / rate
    t_el_b = w.elementwise_backward / rate
    t_cast = 0.0
    if c.autocast:  # each matmul weight cast to bf16 in the forward, its gradient back
        p = L.kind_params(spec, kind)
        t_cast = L.CAST_BYTES * (w.matmul / (2 * c.tokens) + p.experts / c.etp) / rate
    f = t_mm + t_at + t_gg + t_el + t_cast
    bi = t_mm + 2.5 * t_at + t_gg + t_el_b + t_cast
    bw = t_mm + t_gg
    tp_f = tp_b = 0.0
    if tp > 1:
        ag = c.coll("all_gather", tp, 1, w.tp_bytes)
        rs = c.coll("reduce_scatter", tp, 1, w.tp_bytes)
        tp_f = w.tp_gathers * ag + w.tp_scatters * rs
        tp_b = w.tp_gathers * rs + w.tp_scatters * ag
        tp_b += c.coll("all_reduce", tp, 1, w.tp_grad_allreduce)
    cp_f = cp_b = 0.0
    if cp > 1 and w.cp_bytes:
        shift = c.cluster.p2p(cp, c.cp_stride, w.cp_bytes)
        merge = cp * (
            gpu.cp_step_overhead
            + gpu.cp_merge_bytes * c.tokens * w.cp_features / gpu.memory_bandwidth
        )
        cp_f = (cp - 1) * shift + merge / 3
        cp_b = 2 * (cp - 1) * shift + 2 * merge / 3
    ep_f = ep_b = 0.0
    if w.a2a_bytes and ep > 1:
        data = c.coll("all_to_all", ep, c.ep_stride, w.a2a_bytes)
        # the routed counts (int64 per expert) or the rows' gate values: latency
        counts = c.coll("all_to_all", ep, c.ep_stride, 8 * spec.num_experts)
        (fd, fc), (bd, bc) = EP_ALL_TO_ALLS
        ep_f = fd * data + fc * counts
        ep_b = bd * data + bc * counts
    rec = 0.0
    if mode == "full":
        rec = f + tp_f + cp_f + ep_f
    elif mode == "selective":
        moe = w.moe_grouped / gpu.grouped_gemm_flops + w.moe_elementwise / rate
        rec = t_el + t_cast + moe + tp_f + ep_f + gpu.selective_overhead
    # swap: its time is the stage's, from the copy timeline (_swap_time)
    # under a pipeline FSDP's hooks run once a step (UNSHARD / RESHARD): Evaluator._step_ops
    ops_f, ops_b = L.block_ops(spec, kind, c.seq // cp, c.fsdp and not c.pipelined)
    if mode in ("full", "selective"):  # the forward's ops again in backward
        ops_b += ops_f
    hf, hb = ops_f * gpu.host_per_op, ops_b * gpu.host_per_op
    acc.hf += count * hf
    acc.hb += count * hb
    acc.f += count * f
    acc.fc += count * (tp_f + cp_f + ep_f)
    acc.bi += count * bi
    acc.bw += count * bw
    acc.recompute += count * rec
    acc.tp += count * (tp_f + tp_b)
    acc.cp += count * (cp_f + cp_b)
    acc.ep += count * (ep_f + ep_b)
    return f + tp_f + cp_f + ep_f + hf, bi + bw + rec + tp_b + cp_b + ep_b + hb


def _swapped_bytes(
    spec,
    kind,
    tokens: int,
    seq: int,
    tp: int,
    etp: int,
    ab: int,
    autocast: bool,
    norm=False,
    local: int = 0,
):
    """Bytes hp_offload's SwapManager moves to the host for one block: what it saves without
    recomputation and, under autocast, each matmul's bf16 weight cast (saved for backward and
    not a leaf, so moved like an activation). ``seq`` is the whole sequence, ``local`` the
    part one rank runs (default: ``seq``)."""
    saved = L.saved_bytes(spec, kind, "none", tokens, tp, etp, ab, autocast, norm, local or seq)
    if autocast:
        w = L.work(spec, kind, tokens, seq, tp, etp, ab, autocast)
        saved += (w.matmul / (2 * tokens) + L.kind_params(spec, kind).experts / etp) * ab
    return saved


def _swap_time(c: _Ctx, lo: int, hi: int, last: bool, head_s: float) -> float:
    """Seconds swapping every block of ``[lo, hi)`` (and the MTP blocks on the last stage) adds
    to a microbatch: hp_offload's SwapManager timeline (``_offload.simulate``: one copy at a
    time over the host link, the forward throttled past the in-flight cap, each block fetched
    back when backward reaches the swapped block after it) with each block's forward and
    backward times and saved bytes, plus the calibration's host time per swapped block. Under
    autocast the bytes moved include each matmul's bf16 weight cast: it is saved for backward
    and is not a leaf, so the manager moves it as any activation."""
    from ._offload import LayerCost, simulate

    spec = c.spec
    kinds = [L.kind_of(spec, i) for i in range(lo, hi)]
    if last:
        kinds += [L.kind_of(spec, spec.n_layers - 1)] * spec.mtp_layers
    costs = {}
    for kind in set(kinds):
        scratch = _Acc()
        f, b = _block_time(c, kind, "none", scratch, 1)
        moved = _swapped_bytes(
            spec,
            kind,
            c.tokens,
            c.seq,
            c.tp,
            c.etp,
            c.ab,
            c.autocast,
            c.gpu.decomposed_norm,
            c.seq // c.cp,
        )
        costs[kind] = LayerCost(int(moved), 0, f, b)
    _, extra = simulate(
        [costs[k] for k in kinds],
        ["swap"] * len(kinds),
        d2h_bytes_per_s=c.gpu.host_bandwidth,
        head_s=head_s,
        swap_overhead_s=c.gpu.swap_overhead,
    )
    return extra


def _head_time(c: _Ctx, acc: _Acc, depths: int) -> None:
    """The output projection, the logits' all-gather over tp and the loss, once for the main
    prediction and once per MTP depth."""
    spec, gpu, tp = c.spec, c.gpu, c.tp
    t, v, d = c.tokens, spec.vocab_size, spec.dim
    mm = 2 * t * d * v / tp / gpu.matmul_flops
    el_f, el_b = L.head_elementwise(spec, tp, c.ab, c.autocast)
    rate = gpu.elementwise_rate
    cast = L.CAST_BYTES * d * v / tp / rate if c.autocast else 0.0  # the output weight's
    acc.f += depths * (mm + t * el_f / rate) + cast
    acc.bi += depths * (mm + t * el_b / rate) + cast
    ops_f, ops_b = L.rest_ops(spec, c.fsdp and not c.pipelined)
    acc.hf += ops_f * gpu.host_per_op
    acc.hb += ops_b * gpu.host_per_op
    acc.bw += depths * mm
    if tp > 1:
        ag_in = c.coll("all_gather", tp, 1, t * d * c.ab)
        rs_in = c.coll("reduce_scatter", tp, 1, t * d * c.ab)
        logits = c.coll("all_gather", tp, 1, t * v * c.ab)
        acc.tp += depths * (ag_in + rs_in + logits)
        acc.fc += depths * (ag_in + logits)


def _embedding_time(c: _Ctx, acc: _Acc) -> None:
    """The embedding's reduce-scatter to sequence shards (and its all-gather in backward), and
    its backward's index-add."""
    acc.bi += (
        c.tokens
        * L.embedding_elementwise(c.spec, c.tp, c.ab, c.autocast)
        / (c.gpu.elementwise_rate)
    )
    if c.tp > 1:
        nbytes = c.tokens * c.spec.dim * c.ab
        rs = c.coll("reduce_scatter", c.tp, 1, nbytes)
        acc.tp += rs + c.coll("all_gather", c.tp, 1, nbytes)
        acc.fc += rs


def _mtp_time(c: _Ctx, acc: _Acc, mode: str) -> None:
    """DeepSeek-V3's MTP modules: a block like the last one, the ``2 d -> d`` projection."""
    spec = c.spec
    if not spec.mtp_layers:
        return
    _block_time(c, L.kind_of(spec, spec.n_layers - 1), mode, acc, spec.mtp_layers)
    proj = spec.mtp_layers * 2 * c.tokens * 2 * spec.dim * spec.dim / c.gpu.matmul_flops
    acc.f += proj
    acc.bi += proj
    acc.bw += proj


@dataclass(frozen=True)
class _Rank:
    """A pipeline rank's share of the model: its stages, their blocks' parameters (DeepSeek's
    MTP blocks with the last stage's: each is an FSDP group of its own), the root group's
    (embedding; final norm and output; MTP's norms and projection), and one block of each
    kind."""

    stages: tuple[int, ...]
    blocks: LayerParams
    root: LayerParams
    first: bool
    last: bool
    kinds: tuple[LayerParams, ...]


class Evaluator:
    """Estimates plans of one model, workload and hardware, sharing what plans have in common
    (each stage's costs per microbatch shape, each FSDP group's collective times, each
    pipeline rank's parameters) in caches it owns. The search keeps one; :func:`estimate`
    builds one per call.

    Example::

        ev = Evaluator(model_spec("llama3-70b"), Workload(4096, 8192), load_gpu("h200"),
                       load_cluster("h200"))
        ev.estimate(Plan(1, 128, tp=8, recompute="full", microbatches=4)).time.total
    """

    def __init__(self, spec: ModelSpec, work: Workload, gpu: GpuCalibration, cluster: Cluster):
        _check_types("Evaluator", spec=spec, work=work, gpu=gpu, cluster=cluster)
        self.spec, self.work, self.gpu, self.cluster = spec, work, gpu, cluster
        self.ab = gpu.act_bytes
        self._stages: dict = {}
        self._groups: dict = {}
        self._ranks: dict = {}
        self._saved: dict = {}
        self._layouts: dict = {}
        self._flops = spec.flops_per_token(work.seq_len)

    # -- structure ----------------------------------------------------------------------------
    def layout(self, plan: Plan) -> StageLayout:
        """The stages hp-trainer builds for ``plan``: its block split (``balance_stages`` over
        its per-block costs, ``_pipeline.stage_ranges``), the schedule's placement."""
        key = (plan.pp, plan.schedule)
        if key not in self._layouts:
            if plan.pp == 1:
                lay = StageLayout.single(self.spec.n_layers)
            else:
                from ._pipeline import stage_ranges

                ranges = stage_ranges(self.spec, plan.pp * plan.vpp, self.work.seq_len)
                lay = StageLayout.for_schedule(ranges, plan.schedule, plan.pp)
            self._layouts[key] = lay
        return self._layouts[key]

    def _rank_groups(self, layout: StageLayout, pp: int) -> list[tuple[_Rank, list[int]]]:
        """Pipeline ranks grouped by what they hold (ranks of a group cost the same and
        differ only in the microbatches in flight)."""
        key = (layout, pp)
        if key not in self._ranks:
            spec = self.spec
            groups: dict = {}
            for rank in range(pp):
                stages = tuple(layout.stages_of(rank))
                blocks = LayerParams(0, 0, 0)
                kinds: dict = {}
                sig = []
                for s in stages:
                    counts = L.layer_kinds(spec, *layout.ranges[s])
                    sig.append((tuple(sorted(counts.items())), s == 0, s == layout.n_stages - 1))
                    for kind, n in counts.items():
                        kinds[kind] = p = L.kind_params(spec, kind)
                        blocks = blocks + LayerParams(n * p.tp, n * p.replicated, n * p.experts)
                first, last = 0 in stages, layout.n_stages - 1 in stages
                root = LayerParams(0, 0, 0)
                if first:
                    root = root + LayerParams(spec.embedding_params(), 0, 0)
                if last:
                    root = root + spec.head_params()
                    if spec.mtp_layers:
                        n, p = spec.mtp_layers, spec.layer_params(spec.n_layers - 1)
                        mtp = LayerParams(n * p.tp, n * p.replicated, n * p.experts)
                        blocks = blocks + mtp
                        extra = spec.mtp_params()  # minus its blocks: norms and projection
                        root = root + LayerParams(
                            extra.tp - mtp.tp, extra.replicated - mtp.replicated, 0
                        )
                sig = tuple(sig)
                if sig not in groups:
                    rank_info = _Rank(stages, blocks, root, first, last, tuple(kinds.values()))
                    groups[sig] = (rank_info, [])
                groups[sig][1].append(rank)
            self._ranks[key] = list(groups.values())
        return self._ranks[key]

    # -- costs --------------------------------------------------------------------------------
    def _stage(self, layout: StageLayout, s: int, plan: Plan, tokens: int):
        """(_Acc of one microbatch, {kind: (forward, backward) of one block}) of stage ``s``.
        Cached: do not modify the results."""
        lo, hi = layout.ranges[s]
        first, last = s == 0, s == layout.n_stages - 1
        autocast = _autocast(plan, self.ab)
        key = (lo, hi, first, last, plan.recompute, tokens, plan.tp, plan.cp, plan.ep, plan.etp)
        key += (autocast, plan.fsdp, plan.pp > 1)
        hit = self._stages.get(key)
        if hit is None:
            c = _Ctx(
                self.spec,
                tokens,
                self.work.seq_len,
                plan.tp,
                plan.cp,
                plan.ep,
                plan.etp,
                self.gpu,
                self.cluster,
                autocast,
                plan.fsdp,
                plan.pp > 1,
            )
            acc = _Acc()
            per_kind = {}
            for kind, n in L.layer_kinds(self.spec, lo, hi).items():
                per_kind[kind] = _block_time(c, kind, plan.recompute, acc, n)
            if first:
                _embedding_time(c, acc)
            head_s = 0.0
            if last:
                before = acc.f + acc.bi + acc.bw
                _head_time(c, acc, 1 + self.spec.mtp_layers)
                head_s = acc.f + acc.bi + acc.bw - before
                _mtp_time(c, acc, plan.recompute)
            if plan.recompute == "swap":
                acc.swap = _swap_time(c, lo, hi, last, head_s)
            hit = self._stages[key] = (acc, per_kind)
        return hit

    def _group(self, p: LayerParams, plan: Plan) -> tuple[float, float]:
        """(all-gather, reduce-scatter + HSDP all-reduce) seconds of one FSDP group holding
        ``p`` (when ep > 1 a MoE block's experts are a group of their own over the experts'
        data-parallel ranks; both are counted here)."""
        key = (p, plan.tp, plan.cp, plan.dp_replicate, plan.dp_shard, plan.ep, plan.etp)
        hit = self._groups.get(key)
        if hit is None:
            cl, ab, tp = self.cluster, self.ab, plan.tp
            fs = plan.fsdp_shard
            g = _expert_gathered(plan)
            dense = p.tp / tp + p.replicated
            experts = p.experts / g if g else 0.0
            ag = cl.collective("all_gather", fs, tp, dense * ab)
            rs = cl.collective("reduce_scatter", fs, tp, dense * _RS)
            if plan.dp_replicate > 1:
                stride = plan.dp_shard * plan.cp * tp
                rs += cl.collective("all_reduce", plan.dp_replicate, stride, dense / fs * _RS)
            if experts:
                size, stride = (plan.dp_shard // plan.ep, plan.ep * tp) if plan.ep > 1 else (fs, tp)
                ag += cl.collective("all_gather", size, stride, experts * ab)
                rs += cl.collective("reduce_scatter", size, stride, experts * _RS)
            hit = self._groups[key] = (ag, rs)
        return hit

    def _fsdp(self, layout, rank: _Rank, plan: Plan, per_kind) -> float:
        """Exposed FSDP seconds of one step on a rank (NOTE [Where time goes])."""
        spec = self.spec
        counts: dict = {}
        for s in rank.stages:
            for kind, n in L.layer_kinds(spec, *layout.ranges[s]).items():
                counts[kind] = counts.get(kind, 0) + n
        times = {k: self._group(L.kind_params(spec, k), plan) for k in counts}
        root_ag, root_rs = self._group(rank.root, plan)
        if plan.pp > 1:  # gathered once at UNSHARD, reduced once at RESHARD: all exposed
            return root_ag + root_rs + sum(n * sum(times[k]) for k, n in counts.items())
        lo, hi = layout.ranges[0]
        first, last = L.kind_of(spec, lo), L.kind_of(spec, hi - 1)
        exposed = root_ag + times[first][0] + times[last][0] + times[first][1] + root_rs
        pairs = dict(L.kind_pairs(spec, lo, hi))
        if spec.mtp_layers:  # MTP blocks run after the last block, each its own group
            pairs[(last, last)] = pairs.get((last, last), 0) + spec.mtp_layers
        o = self.cluster.overlap

        def shows(comm: float, compute: float) -> float:  # what shows of comm under compute
            return comm - o * min(comm, compute)

        for (prev, cur), n in pairs.items():
            exposed += n * shows(times[cur][0], per_kind[prev][0])  # gather ahead
            exposed += n * shows(times[prev][0] + times[cur][1], per_kind[cur][1])
        return plan.microbatches * exposed

    def _saved_per_stage(self, layout, rank: _Rank, plan: Plan, tokens: int):
        """(mean saved bytes per microbatch over the rank's stages, the largest block's whole
        set, the most a recomputed block adds to what it kept (its whole set less its kept
        set), the largest backward transient of a block): NOTE [Saved activations]."""
        key = (layout, rank.stages, plan.recompute, tokens, plan.tp, plan.etp, plan.fsdp, plan.cp)
        hit = self._saved.get(key)
        if hit is None:
            spec, ab = self.spec, self.ab
            ac = _autocast(plan, ab)
            nx = self.gpu.decomposed_norm
            kept = "none" if plan.recompute == "swap" else plan.recompute
            total = window = fresh = transient = 0.0
            seq, tp, etp = self.work.seq_len, plan.tp, plan.etp
            local = seq // plan.cp  # the sequence each rank runs
            for s in rank.stages:
                for kind, n in L.layer_kinds(spec, *layout.ranges[s]).items():
                    whole = L.saved_bytes(spec, kind, "none", tokens, tp, etp, ab, ac, nx, local)
                    if plan.recompute == "swap":  # what the manager moves, casts included
                        whole = _swapped_bytes(
                            spec, kind, tokens, seq, plan.tp, plan.etp, ab, ac, nx, local
                        )
                        total += n * whole
                    else:
                        mine = L.saved_bytes(spec, kind, kept, tokens, tp, etp, ab, ac, nx, local)
                        total += n * mine
                        fresh = max(fresh, whole - mine)
                    window = max(window, whole)
                    transient = max(
                        transient,
                        L.backward_transient(spec, kind, tokens, plan.tp, plan.etp, ab, ac),
                    )
                if s == layout.n_stages - 1 and spec.mtp_layers:
                    kind = L.kind_of(spec, spec.n_layers - 1)
                    total += spec.mtp_layers * (
                        L.saved_bytes(spec, kind, kept, tokens, tp, etp, ab, ac, nx, local)
                        + 4 * tokens * spec.dim * ab  # the two norms' inputs, the projection's
                    )
            hit = self._saved[key] = (total / len(rank.stages), window, fresh, transient)
        return hit

    # -- the estimate -------------------------------------------------------------------------
    def estimate(
        self,
        plan: Plan,
        *,
        layout: StageLayout | None = None,
        held: tuple[int, ...] | None = None,
        pipeline_time: float | None = None,
    ) -> Estimate:
        """See :func:`estimate`."""
        _check_types("Evaluator.estimate", plan=plan)
        _check_plan(plan, self.work)
        gpu = self.gpu
        layout = layout or self.layout(plan)
        tokens = plan.sequences_per_microbatch(self.work) * self.work.seq_len // plan.cp
        m = plan.microbatches
        worst = None
        slowest = None
        fsdp_t = opt_t = accumulate = step_host = 0.0
        for rank, members in self._rank_groups(layout, plan.pp):
            if plan.pp > 1:
                if held is not None:
                    h = max(held[r] for r in members)
                else:
                    h = max(inflight(plan.schedule, plan.pp, m, r) for r in members)
            else:
                h = 1
            mem = self._memory(layout, rank, plan, tokens, h)
            if worst is None or mem.allocated > worst.allocated:
                worst = mem
            acc = _Acc()
            for s in rank.stages:
                acc.add(self._stage(layout, s, plan, tokens)[0])
            if slowest is None or acc.total > slowest.total:
                slowest = acc
            shard = _sharded(rank.blocks + rank.root, plan)
            if plan.fsdp:
                per_kind = self._stage(layout, rank.stages[0], plan, tokens)[1]
                fsdp_t = max(fsdp_t, self._fsdp(layout, rank, plan, per_kind))
            opt_t = max(opt_t, shard * _OPT_BYTES / gpu.optimizer_rate)
            if gpu.host_per_op:  # priced where the host's work adds to the step (CPU ranks)
                step_host = max(step_host, self._step_ops(layout, rank, plan) * gpu.host_per_op)
            # every micro-step after the first adds into the fp32 gradients
            accumulate = max(
                accumulate, (m - 1) * shard * L.ACCUMULATE_BYTES / gpu.elementwise_rate
            )
        a = slowest
        bubble = transfers = 0.0
        if plan.pp > 1:
            comm = self._transfer(plan, tokens)
            span = pipeline_time
            if span is None:
                span = makespan(plan.schedule, plan.pp, m, a.forward, a.total - a.forward, comm)
            transfers = 2 * (layout.n_stages - 1) * comm
            bubble = max(0.0, span - m * a.total - transfers)
        t = StepTime(
            compute=m * (a.f + a.bi + a.bw) + accumulate,
            recompute=m * a.recompute,
            tp_comm=m * a.tp,
            cp_comm=m * a.cp,
            ep_comm=m * a.ep,
            pp_bubble=bubble,
            pp_comm=transfers,
            fsdp_exposed=fsdp_t,
            optimizer=opt_t + self._norm_time(plan),
            swap=m * a.swap,
            simulated=pipeline_time is not None,
            host=m * (a.hf + a.hb) + step_host,
        )
        tps = self.work.tokens / t.total / plan.world
        return Estimate(plan, worst, t, tps, tps * self._flops / gpu.peak_flops, layout)

    def _memory(self, layout, rank: _Rank, plan: Plan, tokens: int, held: int) -> MemoryEstimate:
        """The fullest of the step's moments (NOTE [What the trainer keeps]): the loss's
        backward, the forward's end, a block's backward (the first, the last two and the end
        of the backward), a pipeline's RESHARD and the concatenation of its outputs, the
        optimizer step."""
        spec, ab, mode = self.spec, self.ab, plan.recompute
        autocast = _autocast(plan, ab)
        stream = 4 if autocast else ab
        m = plan.microbatches
        pipelined = plan.pp > 1
        v, d = spec.vocab_size, spec.dim
        everything = rank.blocks + rank.root
        shard = _sharded(everything, plan)
        mean, window, fresh, transient = self._saved_per_stage(layout, rank, plan, tokens)
        acts = held * mean
        host = 0.0
        recomputed = 0.0  # what the block being recomputed in backward adds to its kept set
        loss_acts = acts
        if mode == "swap":  # every saved activation goes to pinned host memory
            host = acts
            # at the loss only the copies still in flight are on the device (at most the
            # manager's cap); in backward a restored block and the next one prefetched too
            loss_acts = min(acts, SWAP_WINDOW)
            acts = loss_acts + 2 * window
        elif mode in ("full", "selective"):
            recomputed = fresh
        # gradients while a microbatch runs: after the step's first backward (``zero_grad(
        # set_to_none=True)`` ends every step), except under a pipeline with FSDP, which
        # accumulates into the gathered stage's gradients and reduces only at RESHARD
        if plan.fsdp and pipelined:
            early_grads = 0.0
        elif m > 1 or pipelined:
            early_grads = shard * 4
        else:
            early_grads = 0.0
        logits = fwd_logits = kept_out = 0.0
        if rank.last:
            keep = m if plan.schedule == "gpipe" else 1
            depths = 1 + spec.mtp_layers
            # the final norm's input (a decomposed norm's fp32 copy and x * rstd) and rstd,
            # sequence-sharded, and the output projection's (gathered) input
            norm_in = L.DECOMPOSED_NORM if self.gpu.decomposed_norm else stream
            head = depths * keep * tokens * ((norm_in * d + _RSTD) / plan.tp + ab * d)
            # F.cross_entropy(logits.float()): log_softmax keeps its fp32 output; its backward
            # adds that output's gradient and the input's (the bf16 logits and their fp32 copy
            # are gone once the loss is computed)
            logits = head + depths * keep * tokens * v * 4 + tokens * v * 8
            if pipelined:
                # hp_pipeline's last stage keeps every microbatch's (detached) logits under
                # every schedule: all m at its last microbatch's loss; step() concatenates them
                # at its end (twice that then)
                kept_out = m * tokens * v * ab
                fwd_logits = head + kept_out + (depths - 1) * tokens * v * ab
            else:
                fwd_logits = head + depths * tokens * v * ab  # the logits the forward returns
        # the rotary tables (fp32 cos and sin of the rank's positions), held all along
        rope = spec.rope_dim
        # (each pipeline stage holds its own)
        persistent = 2 * self.work.seq_len // plan.cp * rope * 4 * len(rank.stages)
        other = persistent
        copies = kept_copies = block_copies = saved_copies = 0.0
        if plan.fsdp:
            if plan.ep > 1 and plan.etp > 1 and ab < 4:  # experts FSDP does not cast
                c = rank.blocks.experts / _expert_shard(plan) * ab
                other += c if mode != "full" else c / spec.n_layers
        elif autocast:  # bf16 weight copies: autocast caches them until the forward ends
            # the embedding's lookup is not cast (a tied output projection is, once)
            output = spec.vocab_size * spec.dim / plan.tp * ab if rank.last else 0.0
            copies = _gathered(everything, plan) * ab
            if rank.first:
                copies -= spec.embedding_params() / plan.tp * ab
            if rank.last and spec.tie_word_embeddings:
                copies += output
            if mode == "none":  # every matmul saves its weight's copy
                kept_copies = copies
                saved_copies = copies - output  # the blocks' (each until its backward)
            elif mode == "swap":  # the blocks' saved copies went to the host with the rest
                kept_copies = output
            else:  # checkpointed blocks save none: only the output projection's stays
                kept_copies = output
                block_copies = max(_gathered(p, plan) for p in rank.kinds) * ab
        if plan.cp > 1:  # the ring's received keys and values
            other += 2 * max(
                L.work(spec, k, tokens, self.work.seq_len, plan.tp, plan.etp, ab).cp_bytes
                for s in rank.stages
                for k in L.layer_kinds(spec, *layout.ranges[s])
            )
        kinds = {k for s in rank.stages for k in L.layer_kinds(spec, *layout.ranges[s])}
        n = sum(hi - lo for lo, hi in (layout.ranges[s] for s in rank.stages))
        n += spec.mtp_layers if rank.last else 0
        root_g = _gathered(rank.root, plan)
        head_g = 0.0  # what the head's backward made before the blocks': its gradients
        if rank.last:
            head_g = _gathered(spec.head_params(), plan)
            if spec.tie_word_embeddings:
                head_g += spec.embedding_params() / plan.tp
        block = max(_gathered(p, plan) for p in rank.kinds)
        down = max(_gathered(L.down_params(spec, k), plan) for k in kinds)
        # one block's backward, at its SwiGLU's: the block's saved set whole again (recomputed)
        # and the gradients of NOTE [What the trainer keeps], less the sets of blocks done
        working = recomputed + transient
        phases = []
        if pipelined:
            # hp-pipeline's UNSHARD gathers the stage for the step: its parameters and their
            # gradients stay until RESHARD reduces them all at once
            u = _gathered(everything, plan)
            bufs = 2 * ab * u if plan.fsdp else 0.0
            sends = end_sends = all_sends = 0.0
            if self.cluster.holds_sends:  # gloo: what hp-pipeline sent, until the step's end
                xfer = tokens * d / plan.tp * stream
                last_stage = layout.n_stages - 1
                fwd = sum(1 for s in rank.stages if s != last_stage)  # stages sending forward
                bwd = sum(1 for s in rank.stages if s != 0)  # stages sending gradients back
                if rank.stages == (last_stage,):  # its fullest: its last microbatches' loss,
                    sends = (m - held) * xfer  # the earlier ones' input gradients sent
                else:  # at the first backward: each microbatch-stage in flight was sent on
                    sends = held * fwd / len(rank.stages) * xfer
                end_sends = (fwd * m + bwd * (m - 1)) * xfer
                all_sends = (fwd + bwd) * m * xfer
            one = (mean if mode != "swap" else 2 * window) + working
            lost, lost_loss = other + block_copies, other + kept_copies
            phases += [
                ("loss", early_grads, bufs, loss_acts + sends, logits + kept_out, lost_loss),
                ("forward", early_grads, bufs, acts + sends, fwd_logits, other + copies),
                ("backward", early_grads, bufs, acts + working + sends, kept_out, lost),
                # the step's last backward: one microbatch left, every send of the step held
                ("backward", early_grads, bufs, one + end_sends, kept_out, lost),
                # step()'s concatenation of the kept logits, after RESHARD
                ("backward", shard * 4, 0.0, 0.0, 2 * kept_out, other),
            ]
            if plan.fsdp:  # RESHARD: the groups packed one after another (the root first),
                # each group's gradients let go of as they are packed, one fp32 input alive at
                # a time (the one before is let go of first), the earlier groups' fp32 outputs
                # (a group's own is made once its gradients are packed and gone)
                nb = max(n, 1)
                block_g = _gathered(rank.blocks, plan) / nb
                block_s = _sharded(rank.blocks, plan) / nb
                groups = [(root_g, _sharded(rank.root, plan))] if root_g else []
                groups += [(block_g, block_s)] * n
                packed_before = outs = worst = 0.0
                for g_, s_ in groups:
                    worst = max(worst, ab * (u - packed_before) + _RS * (g_ + outs))
                    packed_before += g_
                    outs += s_
                reshard = ab * u + worst
                phases.append(("backward", 0.0, reshard, all_sends, kept_out, other))
        else:
            # FSDP reshards each block after its forward; the root stays gathered for the
            # backward (no gradient exists yet at the loss)
            fw_bufs = root_g * ab if plan.fsdp else 0.0
            phases += [
                # the loss's backward: every block's saved set, the log-softmax buffers
                ("loss", early_grads, fw_bufs, loss_acts, logits, other + kept_copies),
                # the forward's end: autocast's whole cache, the logits
                ("forward", early_grads, fw_bufs, acts, fwd_logits, other + copies),
            ]
            if plan.fsdp:  # each reduce-scatter's fp32 output (the shard), until the backward's
                # end; its input (the block's packed gradients) only until the next one starts
                made = _sharded(rank.blocks, plan) * _RS
                packed = block * _RS
            else:  # the fp32 gradients of the blocks done
                made = _sharded(rank.blocks, plan) * 4
                packed = 0.0
            # the first block's backward, the second-to-last's (the last with a block
            # prefetched), the last's, the backward's end (every block's gradients made)
            for k in sorted({0, max(n - 2, 0), n - 1, n}):
                done, left = k / n, (n - k) / n
                if k == n:
                    if plan.fsdp:
                        # the embedding's backward: every block reduced (their fp32 shards),
                        # the last block's input not yet let go of, the root gathered with
                        # its gradients
                        bufs = 2 * root_g * ab + made + packed
                        phases.append(("backward", early_grads, bufs, 0.0, 0.0, other))
                        # the root's reduce-scatter, after the blocks' outputs became their
                        # gradients (added into the earlier micro-steps' and freed, or kept
                        # as the shards): the root's input and output beside it
                        grads = early_grads or made
                        bufs = 2 * root_g * ab + (root_g + _sharded(rank.root, plan)) * _RS
                        phases.append(("backward", grads, bufs, 0.0, 0.0, other))
                    else:
                        phases.append(("backward", shard * 4, 0.0, 0.0, 0.0, other))
                    continue
                act = (left * acts if mode != "swap" else acts) + working
                oth = other + block_copies + left * saved_copies
                if plan.fsdp:  # this block and the next (prefetched) gathered, its
                    # down projection's gradient, the root's parameters, the head's
                    # gradients
                    nxt = 1 if k < n - 1 else 0
                    gathered = block * (1 + nxt) + down + root_g + head_g
                    grads = early_grads
                    bufs = gathered * ab + done * made + (packed if k > 0 else 0.0)
                    # the same block's pack, its backward done: its whole gradients beside
                    # its parameters and the next block's, its fp32 input (the one before
                    # let go of first), the earlier blocks' outputs
                    after = (n - k - 1) / n
                    act_p = after * acts if mode != "swap" else acts
                    pack = (block * (2 + nxt) + root_g + head_g) * ab + done * made + packed
                    oth_p = other + after * saved_copies
                    phases.append(("backward", grads, pack, act_p, 0.0, oth_p))
                else:
                    grads = max(early_grads, done * made + (head_g + down) * 4)
                    bufs = 0.0
                phases.append(("backward", grads, bufs, act, 0.0, oth))
        name, grads, bufs, act, lg, oth = max(phases, key=lambda p: sum(p[1:]))
        opt = shard * (_STATE - 8)
        params = shard * 4
        # the optimizer step: foreach AdamW's sqrt of the second moments is one more fp32
        # copy of every parameter (torch's _multi_tensor_adam), with gradients all there
        if shard * 8 + persistent >= grads + bufs + act + lg + oth:
            name, grads, bufs, act, lg, oth = "optimizer", shard * 4, 0.0, 0.0, 0.0, persistent
            opt += shard * _ADAM_TEMP
        return MemoryEstimate(
            rank=rank.stages[0] % max(plan.pp, 1),
            parameters=params,
            gradients=grads,
            optimizer=opt,
            fsdp_buffers=bufs,
            activations=act,
            logits=lg,
            other=oth,
            fragmentation=self.gpu.fragmentation,
            reserve=self.gpu.runtime_reserve,
            host=host,
            phase=name,
        )

    def _step_ops(self, layout, rank: _Rank, plan: Plan) -> int:
        """Aten ops a pipeline rank dispatches once per step (NOTE [Host ops]): its blocks'
        and, on the last stage, the rest's parameters' clipping and AdamW."""
        spec, n = self.spec, 0
        hooks = plan.fsdp and plan.pp > 1  # FSDP's hooks at UNSHARD / RESHARD, once a step
        for s in rank.stages:
            for kind, count in L.layer_kinds(spec, *layout.ranges[s]).items():
                n += count * L.block_step_ops(spec, kind)
                if hooks:
                    n += count * sum(L.FSDP_OPS)
        if rank.last:
            n += L.rest_step_ops(spec, plan.fsdp)
            if hooks:
                n += sum(L.REST_FSDP_OPS)
        return n

    def _norm_groups(self, plan: Plan) -> list[tuple[int, int]]:
        """(size, stride) of each all-reduce of gradient clipping's partial sums (one scalar
        each) as hp_optim's ``clip_grad_norm_`` runs them: one per group of parameters sharing
        a mesh and placements and per mesh dimension it is sharded over (counted on a fake
        process group, ``tests/unit/test_host_ops.py``). None for whole parameters
        (replication alone), one over the FSDP ranks; with tensor parallelism three over them
        and two over tp (split weights, replicated norms); with expert parallelism two more
        for the experts (over ep and over the experts' data-parallel ranks); under a pipeline
        one over the stages."""
        tp, fs = plan.tp, plan.fsdp_shard
        ar = []
        if plan.dp_shard * plan.cp > 1 or tp > 1 or plan.ep > 1:
            ar.append((fs, tp))
        if tp > 1:
            ar += [(fs, tp), (fs, tp), (tp, 1), (tp, 1)]
        if plan.ep > 1:
            ar += [(plan.ep, tp * plan.cp), (max(1, plan.dp_shard // plan.ep), plan.ep * tp)]
        if plan.pp > 1:
            ar.append((plan.pp, plan.world // plan.pp))
        return [(n, stride) for n, stride in ar if n > 1]

    def _norm_time(self, plan: Plan) -> float:
        """Seconds of gradient clipping's all-reduces (``_norm_groups``) and of the scalar
        all-reduces ``train_step`` adds: the loss's mean and the ranks' agreement on its flags
        over the world, a MoE model's routing statistics, the MTP loss's mean: latency."""
        cl = self.cluster
        t = sum(cl.collective("all_reduce", n, stride, 4) for n, stride in self._norm_groups(plan))
        scalars = _STEP_SCALARS + (self.spec.num_experts > 0) + (self.spec.mtp_layers > 0)
        return t + scalars * cl.collective("all_reduce", plan.world, 1, 4)

    def _transfer(self, plan: Plan, tokens: int) -> float:
        """One activation (or gradient) transfer between pipeline stages: a microbatch's
        hidden states, sequence-sharded over tp."""
        stride = plan.dp * plan.cp * plan.tp
        return self.cluster.p2p(plan.pp, stride, tokens * self.spec.dim / plan.tp * self.ab)

    def stage_costs(self, plan: Plan, layout: StageLayout):
        """Per stage, the seconds of one microbatch's forward, input-gradient pass (B, with
        recomputation, swap and the backward's collectives) and weight-gradient pass (W), and
        one transfer's seconds: what the pipeline simulator takes."""
        tokens = plan.sequences_per_microbatch(self.work) * self.work.seq_len // plan.cp
        fwd, bi, bw = [], [], []
        for s in range(layout.n_stages):
            a, _ = self._stage(layout, s, plan, tokens)
            fwd.append(a.forward)
            bi.append(a.total - a.forward - a.bw)
            bw.append(a.bw)
        return tuple(fwd), tuple(bi), tuple(bw), self._transfer(plan, tokens)


def estimate(
    spec: ModelSpec,
    plan: Plan,
    work: Workload,
    gpu: GpuCalibration,
    cluster: Cluster,
    *,
    layout: StageLayout | None = None,
    held: tuple[int, ...] | None = None,
    pipeline_time: float | None = None,
) -> Estimate:
    """Predict ``plan``'s peak memory per GPU and step time for ``work`` on ``gpu`` GPUs of
    ``cluster`` (NOTE [What the trainer keeps], NOTE [Where time goes]).

    ``layout`` gives the pipeline stages (default: hp-trainer's split); ``held`` the
    microbatch-stages each pipeline rank holds at its peak (default: the closed forms of
    ``_pipeline.inflight``); ``pipeline_time`` the simulated makespan of the step's
    microbatches (default: ``_pipeline.makespan``). The degrees are not checked here: the
    search checks them with hp-trainer's own rules.

    Example::

        est = estimate(model_spec("llama3-8b"), Plan(1, 8, microbatches=8, recompute="full"),
                       Workload(64, 8192), load_gpu("h200"), load_cluster("h200"))
        est.memory.peak / 2**30, est.time.total, est.mfu
    """
    _check_types("estimate", spec=spec, plan=plan, work=work, gpu=gpu, cluster=cluster)
    ev = Evaluator(spec, work, gpu, cluster)
    return ev.estimate(plan, layout=layout, held=held, pipeline_time=pipeline_time)


_EXPECTED = {
    "spec": (ModelSpec, 'model_spec("llama3-8b")'),
    "plan": (Plan, "Plan(dp_replicate, dp_shard, ...)"),
    "work": (Workload, "Workload(global_batch, seq_len)"),
    "gpu": (GpuCalibration, 'load_gpu("h200")'),
    "cluster": (Cluster, 'load_cluster("h200")'),
}


def _check_types(fn: str, **args) -> None:
    """:class:`PlanTypeError` naming the first argument of the wrong type and what to pass."""
    for name, value in args.items():
        cls, how = _EXPECTED[name]
        if not isinstance(value, cls):
            raise PlanTypeError(
                f"{fn}: {name}={value!r} is a {type(value).__name__}: give a {cls.__name__}, "
                f"e.g. {how}"
            )


def _check_plan(plan: Plan, work: Workload) -> None:
    """The divisibility the estimate relies on; :class:`PlanError` names the argument."""
    per = plan.dp * plan.microbatches
    if work.global_batch % per:
        raise PlanError(
            f"estimate: work.global_batch={work.global_batch} is not divisible by dp x "
            f"microbatches = {plan.dp} x {plan.microbatches} = {per}: change global_batch, "
            "the data-parallel degrees or plan.microbatches"
        )
    if work.seq_len % plan.cp:
        raise PlanError(
            f"estimate: work.seq_len={work.seq_len} is not divisible by plan.cp={plan.cp}"
        )
    if plan.etp not in (1, plan.tp):
        raise PlanError(f"estimate: plan.etp={plan.etp} must be 1 or plan.tp={plan.tp}")
