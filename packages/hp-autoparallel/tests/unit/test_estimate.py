"""The memory and step-time models against values worked out by hand here, on Llama 3 8B with
a calibration and a cluster of round numbers (zero latency), so every term can be followed."""

import dataclasses

import pytest

from hp_autoparallel import (
    Cluster,
    GpuCalibration,
    Link,
    Plan,
    StageLayout,
    Workload,
    estimate,
    load_cluster,
    load_gpu,
    model_spec,
)

GIB = 2**30
GPU = GpuCalibration(
    name="test",
    memory=100 * GIB,
    peak_flops=1e15,
    compute_dtype="bfloat16",
    matmul_flops=1e15,
    attention_flops=5e14,
    grouped_gemm_flops=5e14,
    memory_bandwidth=1e12,
    host_bandwidth=1e10,
    selective_overhead=1e-3,
    swap_overhead=2e-3,
    cp_step_overhead=0.0,
    cp_merge_bytes=0.0,
    fragmentation=1.25,
    runtime_reserve=1 * GIB,
)
FAST = Link(0.0, 1e12, 1e12, 1e12, 1e12, 1e12)  # collectives that hide under compute
CLUSTER = Cluster("test", 8, FAST, FAST)
SPEC = model_spec("llama3-8b")  # d 4096, 32 blocks, 32 heads / 8 kv of 128, ffn 14336
WORK = Workload(32, 4096)
D, L, H, KV, HD, F, V = 4096, 32, 32, 8, 128, 14336, 128256
P = 8_030_261_248  # parameters (test_spec checks the count against hp-trainer's)
BLOCK = 218_103_808 + 2 * D  # projections and the two norms
ROOT = V * D + V * D + D  # embedding, output, final norm
T = 4096  # tokens per microbatch: one sequence
ROPE = 2 * 4096 * HD * 4  # the rotary tables: fp32 cos and sin of the 4096 positions
HEAD = 2 * D + 4 + 2 * D  # per token: the final norm's input and rstd, the output's input


def _acts_none(tp=1):
    """Bytes one block saves without recomputation, per token (NOTE [Saved activations])."""
    attn = D / tp + D + (H + 2 * KV) * HD / tp + H * HD / tp + H / tp * 4 / 2
    ffn = D / tp + D + 4 * F / tp
    return (attn + ffn) * 2 + 2 * 4 / tp  # and the two norms' fp32 rstd


def test_memory_fsdp_by_hand():
    est = estimate(SPEC, Plan(1, 8, microbatches=4), WORK, GPU, CLUSTER)
    m = est.memory
    assert m.parameters == pytest.approx(P / 8 * 4)
    # the last micro-step's loss: the earlier ones made the gradients (fp32 shards), the root
    # stays gathered (bf16) for the backward, every block's saved set and the loss's buffers
    assert m.phase == "loss"
    assert m.gradients == pytest.approx(P / 8 * 4)
    assert m.optimizer == pytest.approx(P / 8 * 8)
    assert m.fsdp_buffers == pytest.approx(ROOT * 2)
    assert m.activations == pytest.approx(L * T * _acts_none())
    assert m.logits == pytest.approx(T * (V * 4 + HEAD) + T * V * 8)
    assert m.other == ROPE
    assert m.allocated == pytest.approx(
        m.parameters
        + m.gradients
        + m.optimizer
        + m.fsdp_buffers
        + m.activations
        + m.logits
        + m.other
    )
    assert m.peak == pytest.approx(m.allocated * 1.25 + GIB)
    # the backward's end is less. At the embedding's backward: every block's fp32
    # reduce-scatter output (its shard), the last block's input (its whole gradients: the
    # earlier inputs were let go of before the next was packed), the root's parameters and
    # gradients (bf16). At the root's reduce-scatter the blocks' outputs were added into the
    # gradients and freed: the root's gathered parameters and gradients, its input and output
    embedding = L * BLOCK * 4 / 8 + BLOCK * 4 + ROOT * 2 * 2
    root = ROOT * (2 * 2 + 4 + 4 / 8)
    assert max(embedding, root) < m.fsdp_buffers + m.activations + m.logits


def test_fragmentation_and_reserve_come_from_the_calibration():
    plan = Plan(1, 8, microbatches=4)
    plain = dataclasses.replace(GPU, fragmentation=1.0, runtime_reserve=0.0)
    a = estimate(SPEC, plan, WORK, GPU, CLUSTER).memory
    b = estimate(SPEC, plan, WORK, plain, CLUSTER).memory
    assert b.peak == pytest.approx(b.allocated) == pytest.approx(a.allocated)
    assert a.peak == pytest.approx(1.25 * a.allocated + GIB)


def test_memory_at_the_loss_by_hand():
    # two micro-steps of 2 sequences: the loss's backward outweighs the backward's end
    m = estimate(SPEC, Plan(1, 8, microbatches=2), WORK, GPU, CLUSTER).memory
    t = 2 * T
    assert m.phase == "loss"
    assert m.gradients == pytest.approx(P / 8 * 4)  # the first micro-step's
    # FSDP reshards each block after its forward: only the root stays gathered (bf16) for its
    # backward, and no gradient exists yet
    assert m.fsdp_buffers == pytest.approx(ROOT * 2)
    assert m.activations == pytest.approx(L * t * _acts_none())
    # the head's inputs and the fp32 log-softmax kept; in its backward, that output's gradient
    # and the input's (fp32)
    assert m.logits == pytest.approx(t * (V * 4 + HEAD) + t * V * 8)
    assert m.other == ROPE


def test_block_backward_by_hand():
    # llama3-tiny (2 blocks, d 64, ffn 160, 4 heads / 2 kv of 16, vocab 256) under full
    # recomputation: the peak is the backward of block 0, the last, at its SwiGLU's
    tiny = model_spec("llama3-tiny")
    d, f, v = 64, 160, 256
    block = 2 * d * d + 2 * d * 32 + 3 * d * f + 2 * d
    t = 2 * 256  # two sequences per rank
    m = estimate(tiny, Plan(1, 4, recompute="full"), Workload(8, 256), GPU, CLUSTER).memory
    assert m.phase == "backward" and m.gradients == 0
    whole = t * ((d + d + 128 + 64 + 4 * 4 / 2) + (d + d + 4 * f)) * 2 + t * 2 * 4
    # block 0's input (block 1's went with its backward); the block recomputed, whole but for
    # its input (the kept one); the gradients of the block's output, of w2's input and of
    # silu(a) * b's two inputs, less the product (w2's weight gradient, its only reader, ran)
    assert m.activations == pytest.approx(t * d * 2 + whole - t * d * 2 + t * (d + 2 * f) * 2)
    # the block gathered, w2's gradient, the root gathered (embedding, output, final norm) with
    # the head's gradients (output projection, final norm); block 1's fp32 reduce-scatter
    # input and output, which hp_fsdp holds until the backward's end: more than block 1's
    # backward had (block 0 prefetched in bf16, one more block input)
    root = 2 * v * d + d
    assert m.fsdp_buffers == pytest.approx(
        (block + f * d + root + v * d + d) * 2 + block * (4 + 4 / 4)
    )
    assert m.logits == 0


def test_recompute_modes_by_hand():
    def acts(mode):
        return estimate(SPEC, Plan(1, 8, microbatches=4, recompute=mode), WORK, GPU, CLUSTER)

    def memory(mode):  # one micro-step of 8 sequences per rank: the loss is the peak
        return estimate(SPEC, Plan(1, 4, recompute=mode), WORK, GPU, CLUSTER).memory

    none, sel, full, swap = (acts(m) for m in ("none", "selective", "full", "swap"))
    m_none, m_sel, m_full, m_swap = (memory(m) for m in ("none", "selective", "full", "swap"))
    t = 8 * T
    whole = t * _acts_none()
    # full: each block's input (the peak is the loss's backward, before any block is
    # recomputed: one block's whole set then is less than the loss's buffers)
    assert m_full.phase == "loss"
    assert m_full.activations == pytest.approx(L * t * D * 2)
    assert whole < t * V * 8
    # selective: the input, q/k/v, wo's output (before its reduce-scatter), attention output
    # and log-sum-exp, w1 / w3 / w2 outputs
    kept = D + (H + 2 * KV) * HD + D + H * HD + H * 2 + 2 * F + D
    assert m_sel.phase == "loss"
    assert m_sel.activations == pytest.approx(L * t * kept * 2)
    # swap: at the loss only the copies in flight, at most hp-offload's 1 GiB window (in
    # backward a restored block and the next one prefetched join it: less than the loss's
    # buffers here)
    assert m_swap.phase == "loss"
    assert m_swap.activations == pytest.approx(GIB)
    assert 2 * whole < m_swap.logits
    assert m_none.activations > m_sel.activations > m_full.activations
    # time: full recomputation runs each block's forward again
    mm = 2 * T * 218_103_808 / 1e15
    at = T * 4096 * H * 256 / 5e14
    # the forward's element-wise bytes (NOTE [Element-wise traffic], bf16 stream under FSDP):
    # norms, residual adds, RoPE, SwiGLU
    el = T * (20 * D + 20 * (H + KV) * HD + 10 * F + 8) / 1e12
    assert full.time.recompute == pytest.approx(4 * L * (mm + at + el))
    assert sel.time.recompute == pytest.approx(4 * L * (el + 1e-3))
    assert none.time.recompute == 0


def test_step_time_fsdp_by_hand():
    est = estimate(SPEC, Plan(1, 8, microbatches=4), WORK, GPU, CLUSTER)
    t = est.time
    mm = 2 * T * 218_103_808 / 1e15  # the block's GEMMs
    at = T * 4096 * H * (HD + HD) / 5e14  # causal attention: half of the s x s pairs, x 2
    # element-wise bytes (NOTE [Element-wise traffic], bf16 stream under FSDP): norms, residual
    # adds, RoPE, SwiGLU forward; backward adds the gradient sums of the residual and of the
    # norm outputs read by several projections
    r = (H + KV) * HD
    el = T * (20 * D + 20 * r + 10 * F + 8) / 1e12
    el_b = T * (42 * D + 20 * r + 18 * F + 8) / 1e12
    block = (mm + at + el) + (mm + 2.5 * at + el_b) + mm  # forward, input grad, weight grad
    # the output GEMMs; final norm, logits.float(), log_softmax, nll and their backwards; the
    # embedding's backward
    head = 3 * (2 * T * D * V / 1e15) + T * (10 * D + 36 * V + 28) / 1e12 + T * (2 * D + 8) / 1e12
    accumulate = 3 * P / 8 * 12 / 1e12  # three micro-steps add into the fp32 gradient shards
    assert t.compute == pytest.approx(4 * (L * block + head) + accumulate)
    # FSDP: gathers (bf16) and reduce-scatters (fp32) over 8 ranks, 7/8 of the bytes each;
    # exposed: the root's and the first block's gathers, the last block's gather at the start
    # of backward, the first block's and the root's reductions; the rest hides under compute
    ag, rs = 7 / 8 * BLOCK * 2 / 1e12, 7 / 8 * BLOCK * 4 / 1e12
    root_ag, root_rs = 7 / 8 * ROOT * 2 / 1e12, 7 / 8 * ROOT * 4 / 1e12
    assert t.fsdp_exposed == pytest.approx(4 * (root_ag + 2 * ag + rs + root_rs))
    assert t.optimizer == pytest.approx(P / 8 * 32 / 1e12)
    assert t.tp_comm == t.cp_comm == t.ep_comm == t.pp_bubble == 0
    assert t.total == pytest.approx(t.compute + t.fsdp_exposed + t.optimizer)
    tps = 32 * 4096 / t.total / 8
    assert est.tokens_per_s_per_gpu == pytest.approx(tps)
    assert est.mfu == pytest.approx(tps * SPEC.flops_per_token(4096) / 1e15)


def test_tensor_parallel_comm_by_hand():
    slow = Link(0.0, 1e11, 1e11, 1e11, 1e11, 1e11)
    est = estimate(SPEC, Plan(1, 4, tp=2, microbatches=8), WORK, GPU, Cluster("t", 8, slow, slow))
    # per block and microbatch: 2 all-gathers + 2 reduce-scatters of the whole sequence's
    # hidden states forward, the same backward; half the bytes cross over 2 ranks
    x = 1 / 2 * T * D * 2 / 1e11
    # the embedding's reduce-scatter and its backward's gather; the head's input gather and
    # its backward's reduce-scatter, and the logits' gather over tp
    ends = 2 * x + 2 * x + 1 / 2 * T * V * 2 / 1e11
    assert est.time.tp_comm == pytest.approx(8 * (L * 8 * x + ends))
    # tensor parallelism halves the projections' activations and their shards (at the loss:
    # one micro-step of 8 sequences per rank)
    m = estimate(SPEC, Plan(1, 4, tp=2), WORK, GPU, CLUSTER).memory
    assert m.phase == "loss"
    assert m.activations == pytest.approx(L * 8 * T * _acts_none(tp=2))
    assert est.memory.parameters == pytest.approx(
        (P - L * 2 * D - D) / 8 * 4 + (L * 2 + 1) * D / 4 * 4
    )


def test_pipeline_ranks_hold_their_in_flight_microbatches():
    plan = Plan(1, 4, pp=2, schedule="1f1b", microbatches=8)
    est = estimate(SPEC, plan, WORK, GPU, CLUSTER)
    assert est.layout == StageLayout(((0, 17), (17, 32)), (0, 1))  # hp-trainer's split
    # rank 0 (the embedding and 17 blocks) is the fullest in its backward with 2 microbatches
    # in flight: its stage gathered for the step (bf16 parameters and gradients), 2 x 17
    # blocks' saved sets and one SwiGLU backward's gradients. Rank 1's RESHARD is less: its
    # stage's parameters gathered, and at its fullest, the first block's pack (the head was
    # packed first): the gradients not yet packed, that block's fp32 input, the head's fp32
    # output (its shard), the 8 microbatches' logits it keeps
    stage0 = 17 * BLOCK + V * D
    m = est.memory
    assert m.rank == 0 and m.phase == "backward" and m.logits == 0
    assert m.fsdp_buffers == pytest.approx(stage0 * 2 * 2)
    assert m.activations == pytest.approx(2 * 17 * T * _acts_none() + T * (D + 2 * F) * 2)
    stage1 = 15 * BLOCK + V * D + D
    head = V * D + D
    reshard = stage1 * 2 + (stage1 - head) * 2 + BLOCK * 4 + head / 4 * 4 + 8 * T * V * 2
    assert reshard < m.fsdp_buffers + m.activations
    # with 2 microbatches of 4 sequences, rank 0 holds both for its 17 blocks at its first
    # backward (its stage and their gradients gathered): it is the fullest
    two = estimate(SPEC, dataclasses.replace(plan, microbatches=2), WORK, GPU, CLUSTER).memory
    t = 4 * T
    stage0 = 17 * BLOCK + V * D
    assert two.rank == 0
    assert two.fsdp_buffers == pytest.approx(stage0 * 2 * 2)
    assert two.activations == pytest.approx(2 * 17 * t * _acts_none() + t * (D + 2 * F) * 2)
    gp = estimate(SPEC, dataclasses.replace(plan, schedule="gpipe"), WORK, GPU, CLUSTER)
    assert gp.memory.activations in (
        pytest.approx(8 * 17 * T * _acts_none()),
        pytest.approx(8 * 15 * T * _acts_none()),
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_last_stage_keeps_every_microbatchs_logits(schedule):
    # hp_pipeline stores each microbatch's detached logits on the last stage under every
    # schedule (all m of them by its last microbatch's loss, and at RESHARD) and concatenates
    # them at the end of step() (2 x m x tokens x vocab x bf16 then, with nothing else left)
    m = 8
    plan = Plan(1, 4, pp=2, schedule=schedule, microbatches=m)
    est = estimate(SPEC, plan, WORK, GPU, CLUSTER)
    kept = m * T * V * 2
    if schedule == "gpipe":  # every microbatch's head inputs and log-softmax at the loss
        assert est.memory.rank == 1
        assert est.memory.phase == "loss"
        assert est.memory.logits == pytest.approx(m * T * (V * 4 + HEAD) + T * V * 8 + kept)
    else:  # here rank 0's backward outweighs rank 1 (test_pipeline_ranks_hold_...); with 4
        # blocks (2 per stage) rank 1 is the fullest, at its last loss: the kept logits too
        spec = dataclasses.replace(SPEC, n_layers=4)
        one = estimate(spec, plan, WORK, GPU, CLUSTER).memory
        assert one.rank == 1
        assert one.logits == pytest.approx(T * (V * 4 + HEAD) + T * V * 8 + kept)


def _acts_autocast():
    """Per token, one block without recomputation under autocast (no FSDP): the fp32 block
    and ffn-norm inputs, a bf16 copy of the normed input per projection (q, k, v; w1, w3)."""
    attn = D * 4 + 3 * D * 2 + ((H + 2 * KV) * HD + H * HD) * 2 + H * 4
    ffn = D * 4 + 2 * D * 2 + 4 * F * 2
    return attn + ffn + 2 * 4


def test_autocast_without_fsdp_keeps_fp32_stream_and_weight_copies():
    # dp x cp == 1: fp32 parameters under torch.autocast; one microbatch of 4 x 4096 tokens
    work = Workload(4, 4096)
    t = 4 * T
    none = estimate(SPEC, Plan(1, 1, recompute="none"), work, GPU, CLUSTER).memory
    assert none.phase == "loss" and none.gradients == 0  # set_to_none: none yet
    assert none.activations == pytest.approx(L * t * _acts_autocast())
    # every matmul saves its weight's bf16 copy (all but the embedding's lookup); the rotary
    # tables
    assert none.other == pytest.approx((P - V * D) * 2 + ROPE)
    # the final norm's fp32 input and rstd, the output's bf16 input, log-softmax and its
    # backward
    assert none.logits == pytest.approx(t * (D * 4 + 4 + D * 2) + t * V * 12)
    # full: the fp32 block inputs; the forward's cache is gone at the loss, but the output
    # projection saved its copy (16 sequences, so that the loss outweighs the optimizer step)
    big = Workload(16, 4096)
    full = estimate(SPEC, Plan(1, 1, recompute="full"), big, GPU, CLUSTER).memory
    assert full.phase == "loss"
    assert full.activations == pytest.approx(L * 4 * t * D * 4)
    assert full.other == pytest.approx(V * D * 2 + ROPE)


def test_optimizer_step_can_be_the_peak():
    # foreach AdamW: parameters, gradients, two moments and the sqrt of the second: 20 B each
    work = Workload(4, 4096)
    est = estimate(SPEC, Plan(1, 1, microbatches=4, recompute="full"), work, GPU, CLUSTER)
    m = est.memory
    assert m.phase == "optimizer"
    assert m.allocated == pytest.approx(P * 20 + ROPE)  # and the rotary tables
    assert m.activations == m.logits == 0


def test_shipped_h200_prediction_is_sane():
    est = estimate(
        SPEC,
        Plan(1, 8, microbatches=4, recompute="full"),
        WORK,
        load_gpu("h200"),
        load_cluster("h200"),
    )
    assert 0.2 < est.mfu < 0.7  # a real model on the shipped calibration
    assert est.memory.peak < 139 * GIB


MOE = model_spec("qwen3-30b-a3b")  # 48 MoE blocks: 128 experts of 768, top-8, d 2048


def _moe_params():
    blk = MOE.layer_params(0)
    root = MOE.embedding_params() + MOE.head_params().tp
    return 48 * blk.tp + root, 48 * blk.replicated + MOE.dim, 48 * blk.experts


@pytest.mark.parametrize(
    "plan,dense_shard,repl_shard,expert_shard",
    [
        (Plan(1, 16, ep=8), 16, 16, 16),  # experts over ep 8 x efsdp 2
        (Plan(1, 8, tp=2, ep=8, etp=2), 16, 8, 16),  # experts over ep x tp, no FSDP
        (Plan(1, 8, tp=2, etp=2), 16, 8, 16),  # experts split over tp, then FSDP over 8
        (Plan(1, 8, tp=2), 16, 8, 8),  # experts whole on each tp rank, FSDP over 8
        (Plan(2, 4, tp=2), 8, 4, 4),  # HSDP: sharded over 4, replicated over 2
    ],
)
def test_expert_and_dense_shards(plan, dense_shard, repl_shard, expert_shard):
    tp_params, repl, experts = _moe_params()
    est = estimate(MOE, plan, Workload(64, 2048), GPU, CLUSTER)
    per_rank = tp_params / dense_shard + repl / repl_shard + experts / expert_shard
    assert est.memory.parameters == pytest.approx(per_rank * 4)
    assert est.memory.optimizer == pytest.approx(per_rank * 8)


def test_expert_all_to_all_by_hand():
    bw = 1e11
    link = Link(0.0, bw, bw, bw, bw, bw)
    plan = Plan(1, 8, ep=8, microbatches=4)  # 64 / 8 = 8 sequences per rank, 2 per microbatch
    est = estimate(MOE, plan, Workload(64, 2048), GPU, Cluster("t", 8, link, link))
    tokens = 2 * 2048
    # dispatch and combine forward, their adjoints backward: 4 all-to-alls of tokens per MoE
    # block and microbatch, each sending top_k copies of every token, 7/8 of them to other
    # ranks; and 3 of the routed counts (int64 per expert)
    one = 7 / 8 * tokens * 8 * 2048 * 2 / bw
    counts = 7 / 8 * 8 * MOE.num_experts / bw
    assert est.time.ep_comm == pytest.approx(4 * 48 * (4 * one + 3 * counts))


@pytest.mark.parametrize(
    "plan, work, arg",
    [
        (Plan(1, 8, microbatches=3), WORK, "global_batch"),
        (Plan(1, 4, cp=2), Workload(32, 4095), "seq_len"),
        (Plan(1, 2, tp=4, ep=2, etp=2), WORK, "etp"),
    ],
)
def test_estimate_checks_divisibility(plan, work, arg):
    from hp_autoparallel import PlanError

    with pytest.raises(PlanError, match=arg):
        estimate(SPEC, plan, work, GPU, CLUSTER)


@pytest.mark.parametrize(
    "args, arg",
    [
        (("llama3-8b", Plan(1, 8), WORK, GPU, CLUSTER), "spec"),
        ((SPEC, Plan(1, 8), WORK, "h200", CLUSTER), "gpu"),
        ((SPEC, Plan(1, 8), (32, 4096), GPU, CLUSTER), "work"),
        ((SPEC, (1, 8), WORK, GPU, CLUSTER), "plan"),
        ((SPEC, Plan(1, 8), WORK, GPU, "h200"), "cluster"),
    ],
)
def test_estimate_names_an_argument_of_the_wrong_type(args, arg):
    from hp_autoparallel import PlanTypeError

    with pytest.raises(PlanTypeError, match=f"{arg}=.*give a "):
        estimate(*args)


def test_swap_is_checked_against_host_memory():
    plan = Plan(1, 8, microbatches=4, recompute="swap")
    est = estimate(SPEC, plan, WORK, GPU, CLUSTER)
    assert est.memory.host == pytest.approx(L * T * _acts_none())  # every saved activation
    assert est.fits(GPU)  # no host figure: unchecked
    small = dataclasses.replace(GPU, host_memory=est.memory.host / 2)
    assert not est.fits(small) and not est.fits_host(small)
    assert est.fits(dataclasses.replace(GPU, host_memory=est.memory.host * 2))
    assert estimate(SPEC, Plan(1, 8, microbatches=4), WORK, GPU, CLUSTER).memory.host == 0


def test_shipped_calibrations_give_host_memory():
    assert load_gpu("h200").host_memory == 70 * GIB
    cpu = load_gpu("cpu")  # CPU ranks swap to the RAM they share: the same figure
    assert cpu.host_memory == pytest.approx(cpu.memory) and 4 * GIB < cpu.host_memory < 6 * GIB


def test_swap_time_is_the_swap_manager_timeline():
    """Swap's time: with a link far faster than compute only the host time per swapped block
    is left; with a slow one the step waits for every byte out and back (the copies run one at
    a time); without FSDP, autocast's bf16 weight casts travel too (they are saved tensors,
    not leaves)."""
    plan = Plan(1, 8, microbatches=4, recompute="swap")

    def swap_s(**kw):
        gpu = dataclasses.replace(GPU, **kw)
        return estimate(SPEC, plan, WORK, gpu, CLUSTER).time.swap

    fast = swap_s(host_bandwidth=1e18)
    assert fast == pytest.approx(4 * L * 2e-3, rel=1e-3)  # 4 microbatches x 32 blocks x 2 ms
    bw = 1e8  # 0.1 GB/s: the copies are everything
    saved = L * T * _acts_none()
    slow = swap_s(host_bandwidth=bw, swap_overhead=0.0)
    assert slow == pytest.approx(4 * 2 * saved / bw, rel=0.02)
    one = Plan(1, 1, recompute="swap")  # no FSDP: fp32 parameters under autocast
    work = Workload(1, 4096)
    est = estimate(SPEC, one, work, dataclasses.replace(GPU, host_bandwidth=bw), CLUSTER)
    from hp_autoparallel import _layers

    kind = _layers.kind_of(SPEC, 0)
    acts = L * _layers.saved_bytes(SPEC, kind, "none", T, 1, 1, 2, True)
    casts = L * (BLOCK - 2 * D) * 2  # every projection's bf16 weight (the norms' are not cast)
    assert est.time.swap == pytest.approx(2 * (acts + casts) / bw, rel=0.02)
    assert est.time.swap > slow / 4  # more than the same tokens' activations under FSDP


def test_fsdp_without_overlap_exposes_every_collective():
    """``cluster.overlap = 0`` (gloo on CPU ranks that share their cores): each block's
    all-gather (forward and backward) and reduce-scatter, and the root's gather and reduction,
    all show; with overlap 1 the same collectives hide under compute where it is longer."""
    from hp_autoparallel import Evaluator

    slow = Link(1e-4, 1e10, 1e10, 1e10, 1e10, 1e10)
    plan = Plan(1, 8)
    hidden = estimate(SPEC, plan, WORK, GPU, Cluster("t", 8, slow, slow)).time.fsdp_exposed
    bare = Cluster("t", 8, slow, slow, overlap=0.0)
    ev = Evaluator(SPEC, WORK, GPU, bare)
    est = ev.estimate(plan)
    layout = ev.layout(plan)
    rank = ev._rank_groups(layout, 1)[0][0]
    block_ag, block_rs = ev._group(rank.kinds[0], plan)
    root_ag, root_rs = ev._group(rank.root, plan)
    assert est.time.fsdp_exposed == pytest.approx(root_ag + root_rs + L * (2 * block_ag + block_rs))
    half = dataclasses.replace(bare, overlap=0.5)
    mid = estimate(SPEC, plan, WORK, GPU, half).time.fsdp_exposed
    assert hidden < mid < est.time.fsdp_exposed


def test_host_dispatch_counts_every_op():
    """A calibration with ``host_per_op`` adds each block's and the step's aten ops (NOTE [Host
    ops]) times it: forward and backward per microbatch, a recomputed forward again; without
    FSDP the blocks' hooks' ops go; the shipped H200 file prices none."""
    from hp_autoparallel import _layers as LY

    per_op = 1e-5
    gpu = dataclasses.replace(GPU, host_per_op=per_op)
    kind = LY.kind_of(SPEC, 0)
    f, b = LY.block_ops(SPEC, kind, 4096)
    rf, rb = LY.rest_ops(SPEC)
    step = L * LY.block_step_ops(SPEC, kind) + LY.rest_step_ops(SPEC)  # once per step
    for m, mode, again in ((1, "none", 0), (4, "none", 0), (2, "full", f)):
        est = estimate(SPEC, Plan(1, 8, microbatches=m, recompute=mode), WORK, gpu, CLUSTER)
        want = (m * (L * (f + b + again) + rf + rb) + step) * per_op
        assert est.time.host == pytest.approx(want)
        assert ("host dispatch", est.time.host) in est.time.rows()
        base = estimate(SPEC, Plan(1, 8, microbatches=m, recompute=mode), WORK, GPU, CLUSTER)
        assert est.time.total == pytest.approx(base.time.total + want)
    one = estimate(SPEC, Plan(1, 1), Workload(1, 4096), gpu, CLUSTER)
    nf, nb = LY.block_ops(SPEC, kind, 4096, fsdp=False)
    rf0, rb0 = LY.rest_ops(SPEC, fsdp=False)
    step0 = L * LY.block_step_ops(SPEC, kind) + LY.rest_step_ops(SPEC, fsdp=False)
    assert one.time.host == pytest.approx((L * (nf + nb) + rf0 + rb0 + step0) * per_op)
    assert load_gpu("h200").host_per_op == 0.0 and load_gpu("cpu").host_per_op > 0
    # under a pipeline FSDP's hooks run once a step: a microbatch more adds the last stage's
    # blocks and rest without them
    from hp_autoparallel import Evaluator

    hosts = {}
    for m in (2, 4):
        plan = Plan(1, 4, pp=2, schedule="1f1b", microbatches=m)
        ev = Evaluator(SPEC, WORK, gpu, CLUSTER)
        hosts[m] = ev.estimate(plan).time.host
        lo, hi = ev.layout(plan).ranges[-1]
    per_mb = (hi - lo) * (nf + nb) + rf0 + rb0
    assert hosts[4] - hosts[2] == pytest.approx(2 * per_mb * per_op)
    # selective recomputation dispatches the forward again too
    sel = estimate(SPEC, Plan(1, 8, recompute="selective"), WORK, gpu, CLUSTER).time.host
    full = estimate(SPEC, Plan(1, 8, recompute="full"), WORK, gpu, CLUSTER).time.host
    assert sel == pytest.approx(full)


def test_gradient_norm_all_reduce_is_in_the_optimizer_time():
    """Clipping all-reduces the norm over a stage's ranks (and under a pipeline over the
    stages), train_step two scalars over the world: latency-only terms."""
    lat = Link(1e-3, 1e12, 1e12, 1e12, 1e12, 1e12)
    cl = Cluster("t", 8, lat, lat)
    opt = {}
    for plan in (Plan(1, 8), Plan(1, 4, pp=2, schedule="1f1b", microbatches=4)):
        a = estimate(SPEC, plan, WORK, GPU, cl).time.optimizer
        z = estimate(SPEC, plan, WORK, GPU, CLUSTER).time.optimizer
        opt[plan.pp] = a - z
    # all-reduce: 2 x latency x ceil(log2 n): 8 ranks; 4 ranks then 2 stages; and
    # train_step's two scalars over the 8 ranks
    metrics = 2 * (2 * 1e-3 * 3)
    assert opt[1] == pytest.approx(2 * 1e-3 * 3 + metrics)
    assert opt[2] == pytest.approx(2 * 1e-3 * 2 + 2 * 1e-3 * 1 + metrics)
