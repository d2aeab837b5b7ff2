"""Forward and backward of every rule family against a single-process reference (4 ranks).

Each case builds whole inputs from a fixed seed on every rank, runs the op on DTensors with the
given placements and on the whole tensors, and compares outputs and input gradients.
"""

import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from dt_helpers import check_op  # noqa: E402

from hp_dtensor import Partial, Replicate, Shard, init_device_mesh  # noqa: E402
from hp_testing.pytest_plugin import rank_pool_fixture  # noqa: E402

pool = rank_pool_fixture(4)

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()


def _mesh(two_d=False):
    if two_d:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g)


# -- the cases: name -> (fn, inputs, placements, two_d) ----------------------------------------
def _cases():
    a, b = _rand(8, 6), _rand(8, 6, seed=1)
    u, v = _rand(7, 5), _rand(7, 5, seed=1)  # uneven over 4 ranks
    bias = _rand(6, seed=2)
    c = {}
    # pointwise
    c["add_s0_s0"] = (torch.add, [a, b], [[S0], [S0]], False)
    c["add_s0_s1"] = (lambda x, y: x + y, [a, b], [[S0], [S1]], False)
    c["add_uneven"] = (lambda x, y: x + y, [u, v], [[S0], [R]], False)
    c["add_bias_broadcast"] = (lambda x, y: x + y, [a, bias], [[S0], [R]], False)
    c["add_bias_sharded"] = (lambda x, y: x + y, [a, bias], [[S1], [S0]], False)
    c["add_partial_partial"] = (lambda x, y: x + y, [a, b], [[P], [P]], False)
    c["add_partial_replicate"] = (lambda x, y: x - y, [a, b], [[P], [R]], False)
    c["mul_partial_replicate"] = (lambda x, y: x * y, [a, b], [[P], [R]], False)
    c["div_partial_replicate"] = (lambda x, y: x / (y.abs() + 1), [a, b], [[P], [R]], False)
    c["gelu_partial"] = (F.gelu, [a], [[P]], False)
    c["scalar_ops"] = (lambda x: (2.0 - x) * 3 + x**2 / 4, [u], [[S1]], False)
    c["tanh_relu_uneven"] = (lambda x: torch.relu(torch.tanh(x) - 0.1), [u], [[S0]], False)
    c["where"] = (lambda x, y: torch.where(x > 0, x, y), [a, b], [[S0], [S0]], False)
    c["inplace_mul"] = (lambda x, y: (x * 1).mul_(y), [a, b], [[S0], [R]], False)
    c["inplace_add_partial"] = (lambda x, y: (x * 1).add_(y), [a, b], [[P], [P]], False)
    c["pointwise_2d"] = (lambda x, y: x * y + x, [a, b], [[S0, S1], [R, S1]], True)

    c["clone_to"] = (lambda x: x.clone().to(torch.float64).float(), [a], [[S1]], False)
    # reductions
    c["sum_all"] = (lambda x: x.sum(), [u], [[S0]], False)
    c["sum_dim0"] = (lambda x: x.sum(0), [u], [[S0]], False)
    c["sum_dim1_keepdim"] = (lambda x: x.sum(1, keepdim=True), [u], [[S0]], False)
    c["mean_even"] = (lambda x: x.mean(), [a], [[S0]], False)
    c["mean_uneven"] = (lambda x: x.mean(0), [u], [[S0]], False)
    c["mean_partial"] = (lambda x: x.mean(1), [a], [[P]], False)
    c["amax_sharded"] = (lambda x: x.amax(0), [u], [[S0]], False)
    c["amin_all"] = (lambda x: torch.amin(x), [a], [[S1]], False)
    c["max_dim_tuple"] = (lambda x: x.max(dim=0), [u], [[S0]], False)
    c["var_std"] = (lambda x: x.var(1).sum() + x.std(0).sum(), [u], [[S1]], False)
    c["logsumexp"] = (lambda x: torch.logsumexp(x, 1), [u], [[S0]], False)
    c["norm"] = (lambda x: torch.linalg.vector_norm(x, dim=1), [a], [[S1]], False)
    c["sum_2d"] = (lambda x: x.sum(), [u], [[S0, S1]], True)
    c["sum_2d_nested"] = (lambda x: x.sum(1), [a], [[S0, S0]], True)
    # views
    c["view_merge"] = (lambda x: x.view(-1), [a], [[S0]], False)
    c["view_uneven"] = (lambda x: x.reshape(35), [u], [[S0]], False)
    c["reshape_split"] = (lambda x: x.reshape(4, 4, 6), [_rand(16, 6)], [[S0]], False)
    c["reshape_inner"] = (lambda x: x.reshape(8, 2, 3), [a], [[S1]], False)
    c["transpose"] = (lambda x: x.transpose(0, 1) * 2, [u], [[S0]], False)
    c["t_and_T"] = (lambda x: x.t() + x.T, [_rand(6, 6)], [[S1]], False)
    c["permute"] = (lambda x: x.permute(2, 0, 1), [_rand(4, 5, 6)], [[S2]], False)
    c["flatten_unflatten"] = (
        lambda x: x.flatten(0, 1).unflatten(0, (8, 6)),
        [_rand(8, 6, 3)],
        [[S0]],
        False,
    )
    c["unsqueeze_squeeze"] = (lambda x: x.unsqueeze(1).squeeze(1).unsqueeze(-1), [u], [[S1]], False)
    c["expand"] = (lambda x: x.expand(8, 6) * 1, [_rand(1, 6)], [[S1]], False)
    c["getitem_keep"] = (lambda x: x[:, 1:4], [u], [[S0]], False)
    c["getitem_sharded"] = (lambda x: x[2:5, None, ..., 1], [u], [[S0]], False)
    c["split_chunk"] = (lambda x: torch.split(x, 2, dim=1), [u], [[S0]], False)
    c["chunk_sharded_dim"] = (lambda x: x.chunk(2, dim=0), [u], [[S0]], False)
    c["unbind"] = (lambda x: x.unbind(1), [u], [[S0]], False)
    c["cat_keep"] = (lambda x, y: torch.cat([x, y], dim=1), [u, v], [[S0], [S0]], False)
    c["cat_gather"] = (lambda x, y: torch.cat([x, y]), [u, v], [[S0], [R]], False)
    c["stack"] = (lambda x, y: torch.stack([x, y], dim=1), [u, v], [[S1], [S1]], False)
    c["select_narrow"] = (
        lambda x: x.select(1, 2) + x.narrow(1, 0, 1).squeeze(1),
        [u],
        [[S0]],
        False,
    )
    c["view_2d"] = (
        lambda x: x.view(4, 2, 6).transpose(1, 2),
        [a],
        [[S0, S2 if False else S1]],
        True,
    )
    # matrix products
    w = _rand(6, 5, seed=3)
    c["mm_rowshard"] = (torch.mm, [u.T.contiguous(), _rand(7, 4)], [[S0], [R]], False)
    c["mm_colshard"] = (torch.mm, [a, w], [[R], [S1]], False)
    c["mm_partial"] = (torch.mm, [a, w], [[S1], [S0]], False)
    c["mm_partial_in"] = (torch.mm, [a, w], [[P], [R]], False)
    c["mm_mismatch"] = (torch.mm, [a, w], [[S0], [S0]], False)
    c["mm_gather_fused"] = (torch.mm, [a, w], [[S1], [S1]], False)
    c["linear_gather_2d"] = (F.linear, [_rand(4, 6), _rand(8, 6)], [[S1, S0], [S0, R]], True)
    c["matmul_3d"] = (lambda x, y: x @ y, [_rand(3, 8, 6), w], [[S0], [R]], False)
    c["bmm"] = (torch.bmm, [_rand(4, 5, 6), _rand(4, 6, 3)], [[S0], [S0]], False)
    c["addmm"] = (
        lambda bb, x, y: torch.addmm(bb, x, y),
        [_rand(5), a, w],
        [[R], [S1], [S0]],
        False,
    )
    c["linear_rowwise"] = (F.linear, [a, _rand(5, 6), _rand(5)], [[S1], [S1], [R]], False)
    c["linear_colwise"] = (F.linear, [a, _rand(5, 6), _rand(5)], [[R], [S0], [S0]], False)
    c["linear_batch"] = (F.linear, [_rand(2, 7, 6), _rand(5, 6), _rand(5)], [[S1], [R], [R]], False)
    c["einsum"] = (
        lambda x, y: torch.einsum("bij,bjk->bik", x, y),
        [_rand(4, 5, 6), _rand(4, 6, 3)],
        [[S0], [S0]],
        False,
    )
    c["linear_2d"] = (
        F.linear,
        [_rand(4, 6), _rand(8, 6), _rand(8)],
        [[S0, R], [R, S0], [R, S0]],
        True,
    )
    # embedding
    idx = torch.tensor([[0, 3, 9, 2], [8, 1, 9, 5]])
    c["embedding_vocab"] = (F.embedding, [idx, _rand(10, 4)], [[R], [S0]], False)
    c["embedding_dim"] = (F.embedding, [idx, _rand(10, 6)], [[R], [S1]], False)
    c["embedding_batch"] = (F.embedding, [idx, _rand(10, 4)], [[S1], [R]], False)
    c["embedding_padding"] = (
        lambda i, e: F.embedding(i, e, padding_idx=9),
        [idx, _rand(10, 4)],
        [[R], [S0]],
        False,
    )
    # softmax and norms
    c["softmax"] = (lambda x: F.softmax(x, dim=-1), [u], [[S0]], False)
    c["log_softmax_gather"] = (lambda x: torch.log_softmax(x, 1), [u], [[S1]], False)
    c["layer_norm"] = (
        lambda x, g, bb: F.layer_norm(x, (6,), g, bb),
        [a, _rand(6), _rand(6)],
        [[S0], [R], [R]],
        False,
    )
    c["layer_norm_gather"] = (lambda x: F.layer_norm(x, (6,)), [a], [[S1]], False)
    c["rms_norm"] = (
        lambda x, g: F.rms_norm(x, (5,), g, 1e-6),
        [_rand(3, 7, 5), _rand(5)],
        [[S1], [R]],
        False,
    )
    # attention
    q, k, vv = _rand(2, 4, 5, 8), _rand(2, 4, 5, 8, seed=1), _rand(2, 4, 5, 8, seed=2)
    sdpa = F.scaled_dot_product_attention
    c["sdpa_heads"] = (
        lambda x, y, z: sdpa(x, y, z, is_causal=True),
        [q, k, vv],
        [[S1], [S1], [S1]],
        False,
    )
    c["sdpa_batch_gqa"] = (
        lambda x, y, z: sdpa(x, y, z, enable_gqa=True),
        [_rand(4, 8, 5, 8), _rand(4, 4, 5, 8), _rand(4, 4, 5, 8, seed=3)],
        [[S1], [S1], [S1]],
        False,
    )
    c["sdpa_seq_gather"] = (lambda x, y, z: sdpa(x, y, z), [q, k, vv], [[S2], [S2], [R]], False)
    # losses
    logits = _rand(7, 6)
    tgt = torch.tensor([1, 0, 5, 2, 2, 3, 4])
    tgt_ign = torch.tensor([1, -100, 5, 2, -100, 3, 4])
    wcls = _rand(6).abs() + 0.5
    c["ce_mean"] = (F.cross_entropy, [logits, tgt], [[S0], [S0]], False)
    c["ce_sum"] = (
        lambda x, t: F.cross_entropy(x, t, reduction="sum"),
        [logits, tgt],
        [[S0], [R]],
        False,
    )
    c["ce_none"] = (
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        [logits, tgt],
        [[S0], [S0]],
        False,
    )
    c["ce_ignore_weight"] = (
        lambda x, t, ww: F.cross_entropy(x, t, weight=ww.detach()),
        [logits, tgt_ign, wcls],
        [[S0], [S0], [R]],
        False,
    )
    c["ce_class_sharded"] = (F.cross_entropy, [logits, tgt], [[S1], [R]], False)
    c["ce_vocab_all_options"] = (
        lambda x, t, ww: F.cross_entropy(x, t, weight=ww.detach(), label_smoothing=0.1),
        [logits, tgt_ign, wcls],
        [[S1], [R], [R]],
        False,
    )
    c["ce_vocab_sum_smooth"] = (
        lambda x, t: F.cross_entropy(x, t, reduction="sum", label_smoothing=0.2),
        [_rand(5, 9), torch.tensor([0, 8, 4, -100, 3])],
        [[S1], [R]],
        False,
    )
    c["ce_vocab_none"] = (
        lambda x, t: F.cross_entropy(x, t, reduction="none", ignore_index=2),
        [logits, tgt],
        [[S1], [R]],
        False,
    )
    c["ce_batch_smooth"] = (
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.3),
        [logits, tgt_ign],
        [[S0], [S0]],
        False,
    )
    c["ce_vocab_and_batch_2d"] = (
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
        [logits, tgt_ign],
        [[S0, S1], [S0, R]],
        True,
    )
    c["nll_spatial"] = (
        lambda x, t: F.nll_loss(F.log_softmax(x, 1), t),
        [_rand(2, 5, 7), torch.randint(0, 5, (2, 7), generator=torch.Generator().manual_seed(0))],
        [[S2], [S1]],
        False,
    )
    c["ce_2d"] = (F.cross_entropy, [logits, tgt], [[S0, R], [S0, R]], True)
    # no rule: the fallback
    c["fallback_cumsum"] = (lambda x: torch.cumsum(x, 1), [u], [[S1]], False)
    return c


CASES = _cases()


def _run_case(name):
    fn, inputs, placements, two_d = CASES[name]
    mesh = _mesh(two_d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_op(fn, inputs, placements, mesh, name=name)
    return True


@pytest.mark.parametrize("name", sorted(CASES))
def test_op(pool, name):
    assert pool.run(_run_case, name) == [True] * 4


def _fallback_warns_once():
    mesh = _mesh()
    x = check_op(lambda t: t, [_rand(7, 5)], [[S1]], mesh, grad=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cummax(x, 1)
        torch.cummax(x, 1)
    msgs = [str(r.message) for r in rec if "no sharding rule" in str(r.message)]
    return msgs


def test_fallback_warns_once_with_op_name(pool):
    for msgs in pool.run(_fallback_warns_once):
        assert len(msgs) == 1 and "'cummax'" in msgs[0]


def _placements_of_results():
    mesh = _mesh()
    from hp_dtensor import distribute_tensor

    x = distribute_tensor(_rand(8, 6), mesh, [S0])
    w = distribute_tensor(_rand(6, 4), mesh, [R])
    return [
        str(torch.mm(x, w).placements[0]),
        str(x.sum().placements[0]),
        str(x.transpose(0, 1).placements[0]),
        str(torch.mm(x.transpose(0, 1), x).placements[0]),
    ]


def test_rules_choose_communication_free_strategies(pool):
    assert pool.run(_placements_of_results)[0] == ["S(0)", "P(sum)", "S(1)", "P(sum)"]


def _partial_avg_through_reductions():
    """Gradients of the local pieces of a (Partial(avg), Shard(0)) tensor of 8 x 6 through
    reductions: the global value is the average over mesh dim 0, so each local element enters
    the global mean with weight 1 / (2 * 48), and a column sum of the row mean with 1 / (2 * 8).
    """
    from hp_dtensor import DTensor

    mesh = _mesh(two_d=True)
    grads = []
    for reduce in (lambda x: x.mean(), lambda x: x.mean(0).sum()):
        xl = _rand(4, 6).requires_grad_(True)
        x = DTensor.from_local(xl, mesh, [Partial("avg"), S0], shape=(8, 6))
        reduce(x).full_tensor().backward()
        grads.append(sorted(set(xl.grad.flatten().tolist())))
    return grads


def test_partial_avg_input_through_a_reduction_made_partial_elsewhere(pool):
    """The reduction makes Partial(avg) on mesh dim 1 only; the Partial(avg) that passes
    through on mesh dim 0 must not scale the gradient a second time."""
    for mean_all, mean_rows in pool.run(_partial_avg_through_reductions):
        assert mean_all == pytest.approx([1 / 96]), mean_all
        assert mean_rows == pytest.approx([1 / 16]), mean_rows
