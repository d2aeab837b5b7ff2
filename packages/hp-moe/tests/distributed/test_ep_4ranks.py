"""Expert parallelism composed with the other parallelisms on 4 gloo ranks, against one
process: EP 4, ETP 2 x 2, EP 2 x TP 2, EP 2 x FSDP 2, and balancing over DP 2 x EP 2 with
gradient accumulation."""

import os
import sys

import pytest
import torch

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import moe_model as mm  # noqa: E402

import hp_dtensor as hp  # noqa: E402
import hp_moe  # noqa: E402
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

pool = rank_pool_fixture(4, timeout=300)

TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
}


def _ep4():
    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    ref, model = mm.build(), mm.build()
    for layer in model.layers:
        parallelize_module(layer.moe, mesh, {"experts": hp_moe.ExpertParallel()})
    group = mesh.get_group()
    return mm.train_and_compare(
        model,
        ref,
        dp_group=group,
        dp_rank=mesh.get_local_rank(),
        dp_size=4,
        after_backward=lambda m: mm.sync_grads(m, group, ep=4),
    )


def _etp():
    """Experts over ep, their hidden units over tp, attention tensor-parallel over tp."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ref, model = mm.build(), mm.build()
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        parallelize_module(layer.moe, mesh, {"experts": hp_moe.ExpertTensorParallel()})
    w1 = model.layers[0].moe.experts.w1
    assert w1.to_local().shape == (mm.EXPERTS // 2, mm.HIDDEN // 2, mm.DIM)
    group = mesh.get_group("ep")
    return mm.train_and_compare(
        model,
        ref,
        dp_group=group,
        dp_rank=mesh.get_local_rank("ep"),
        dp_size=2,
        after_backward=lambda m: mm.sync_grads(m, group, ep=2),
    )


def _ep_tp():
    """Attention tensor-parallel over tp; experts over ep (each tp rank of an ep coordinate
    runs them on the same tokens)."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ref, model = mm.build(), mm.build()
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        parallelize_module(layer.moe, mesh["ep"], {"experts": hp_moe.ExpertParallel()})
    group = mesh.get_group("ep")
    return mm.train_and_compare(
        model,
        ref,
        dp_group=group,
        dp_rank=mesh.get_local_rank("ep"),
        dp_size=2,
        after_backward=lambda m: mm.sync_grads(m, group, ep=2),
    )


def _ep_fsdp():
    """4 data-parallel ranks: dense layers sharded over all of them, experts over ep 2 and
    sharded over the 2 ranks of each expert's replica group (efsdp)."""
    from hp_fsdp import fully_shard

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = mesh["efsdp", "ep"].flatten("dp")
    ref, model = mm.build(), mm.build()
    for layer in model.layers:
        parallelize_module(layer.moe, mesh["ep"], {"experts": hp_moe.ExpertParallel()})
        experts = fully_shard(layer.moe.experts, mesh=mesh["efsdp"])
        experts.set_gradient_scaling_factor(1 / 2)  # sums over ep's tokens, averaged over efsdp
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    w1 = model.layers[0].moe.experts.w1
    assert w1.to_local().shape == (mm.EXPERTS // 4, mm.HIDDEN, mm.DIM)
    return mm.train_and_compare(
        model, ref, dp_group=dp.get_group(), dp_rank=dp.get_local_rank(), dp_size=4
    )


@pytest.mark.parametrize("case", ["ep4", "etp_2x2", "ep2_tp2", "ep2_fsdp2"])
def test_composed_equals_one_device(pool, case):
    fn = {"ep4": _ep4, "etp_2x2": _etp, "ep2_tp2": _ep_tp, "ep2_fsdp2": _ep_fsdp}[case]
    losses = pool.run(fn)
    assert all(lo == losses[0] for lo in losses) and len(losses[0]) == 5


def _balance_with_accumulation(aux_type):
    """DP 2 x EP 2, 2 accumulation microbatches per step: the expert bias follows the
    single-device rule on global counts, and the aux loss's value and gradient equal one
    device running the same two microbatches (each the union of the ranks' halves).

    "batch" takes its statistics from each rank's own tokens by definition (that is what
    "global" is for): its one-device equivalent runs each rank's slice as a forward of its own,
    with the coefficient divided by the 4 ranks whose gradients the data-parallel mean
    averages."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp_ep = mesh["dp", "ep"].flatten("dp_ep")
    group = dp_ep.get_group()
    kw = dict(aux_loss_type=aux_type, aux_loss_coeff=0.05)
    ref, model = mm.build(**kw), mm.build(**kw)
    per_rank = aux_type == "batch"
    if per_rank:
        for m in mm.moes(ref):
            m.aux_loss_coeff = 0.05 / 4
    for layer in model.layers:
        parallelize_module(layer.moe, mesh["ep"], {"experts": hp_moe.ExpertParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    hp_moe.register_expert_bias_update(opt, model, group=group)
    hp_moe.register_expert_bias_update(ref_opt, ref)
    me = dp_ep.get_local_rank()
    aux_values = []
    for step in range(3):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(2):
            tokens, targets = mm.batch(10 * step + micro, 4)
            if per_rank:
                for r in range(4):
                    part = slice(r * mm.B, (r + 1) * mm.B)
                    (mm.loss_fn(ref(tokens[part]), targets[part]) / 8).backward()
            else:
                (mm.loss_fn(ref(tokens), targets) / 2).backward()
            mine = slice(me * mm.B, (me + 1) * mm.B)
            loss = mm.loss_fn(model(tokens[mine]), targets[mine]) / 2
            loss.backward()
        counts_before = torch.stack([m.tokens_per_expert.clone() for m in mm.moes(model)])
        summed = counts_before.clone()
        hp.get_platform("cpu").all_reduce(summed, "sum", group)
        ref_counts = torch.stack([m.tokens_per_expert.clone() for m in mm.moes(ref)])
        torch.testing.assert_close(summed, ref_counts)  # whole-step counts, every microbatch
        aux = torch.stack([m.aux_loss_total.clone() for m in mm.moes(model)])
        hp.get_platform("cpu").all_reduce(aux, "sum", group)
        ref_aux = torch.stack([m.aux_loss_total.clone() for m in mm.moes(ref)])
        torch.testing.assert_close(aux if per_rank else aux / 4, ref_aux, rtol=1e-5, atol=1e-6)
        aux_values.append(ref_aux.sum().item())
        mm.sync_grads(model, group, ep=2, expert_dp_group=mesh.get_group("dp"))
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                mm.full(p.grad),
                dict(ref.named_parameters())[name].grad,
                rtol=1e-5,
                atol=1e-5,
                msg=f"{aux_type} grad {name} step {step}",
            )
        opt.step()
        ref_opt.step()
        for m, r in zip(mm.moes(model), mm.moes(ref)):
            torch.testing.assert_close(m.expert_bias, r.expert_bias)
            assert m.tokens_per_expert.sum() == 0  # zeroed by the hook
    return aux_values


@pytest.mark.parametrize("aux_type", ["global", "batch", "sequence"])
def test_balance_over_dp_and_ep_with_accumulation(pool, aux_type):
    res = pool.run(_balance_with_accumulation, aux_type)
    assert all(r == res[0] for r in res) and all(v > 0 for v in res[0])
