"""Expert-parallel models with the rest of the stack (4 gloo ranks): hp-dcp checkpoints saved at
EP 4 load at EP 2 x DP 2 and in one process; clip_grad_norm_ is exact with expert parameters
on their own meshes (EP 2 x FSDP 2); hp-offload's checkpoint_wrapper around MoE blocks."""

import os
import sys

import torch

from hp_testing.pytest_plugin import rank_pool_fixture

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import moe_model as mm  # noqa: E402

import hp_dcp  # noqa: E402
import hp_dtensor as hp  # noqa: E402
import hp_moe  # noqa: E402
from hp_dtensor.parallel import parallelize_module  # noqa: E402

pool = rank_pool_fixture(4, timeout=300)


def _ep(model, mesh):
    for layer in model.layers:
        parallelize_module(layer.moe, mesh, {"experts": hp_moe.ExpertParallel()})
    return model


def _full_state(model):
    return {k: mm.full(v).clone() for k, v in model.state_dict().items()}


def _save_ep4(path):
    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    model = _ep(mm.build(seed=5), mesh)
    with torch.no_grad():  # a distinct, non-initial state: bias moved, weights scaled
        for i, layer in enumerate(model.layers):
            layer.moe.expert_bias.add_(0.01 * (i + 1))
            mm.local(layer.moe.experts.w2).mul_(1.5)
    hp_dcp.save({"model": hp_dcp.ModelState(model)}, checkpoint_id=path)
    assert model.layers[0].moe.experts.w1.to_local().shape[0] == mm.EXPERTS // 4
    return _full_state(model)


def _load_ep2(path):
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = _ep(mm.build(seed=9), mesh["ep"])
    hp_dcp.load({"model": hp_dcp.ModelState(model)}, checkpoint_id=path)
    assert model.layers[0].moe.experts.w1.to_local().shape[0] == mm.EXPERTS // 2
    return _full_state(model)


def test_saved_at_ep4_loads_at_ep2_and_in_one_process(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pool.run(_save_ep4, path)[0]
    for loaded in pool.run(_load_ep2, path):
        assert set(loaded) == set(saved)
        for k in saved:
            torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0, msg=k)
    one = mm.build(seed=13)  # this process: no process group, plain tensors
    hp_dcp.load({"model": hp_dcp.ModelState(one)}, checkpoint_id=path)
    for k, v in one.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)


def _clip_and_offload():
    """EP 2 x FSDP 2 with every block under hp-offload's full checkpointing, clip_grad_norm_ on
    the mixed set of meshes, 3 AdamW steps: every clipped gradient and the norm equal one
    process's."""
    from hp_fsdp import fully_shard
    from hp_offload import CheckpointPolicy, checkpoint_wrapper
    from hp_optim import clip_grad_norm_

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = mesh["efsdp", "ep"].flatten("dp")
    ref, model = mm.build(), mm.build()
    for i, layer in enumerate(model.layers):
        parallelize_module(layer.moe, mesh["ep"], {"experts": hp_moe.ExpertParallel()})
        fully_shard(layer.moe.experts, mesh=mesh["efsdp"]).set_gradient_scaling_factor(0.5)
        fully_shard(layer, mesh=dp)
        model.layers[i] = checkpoint_wrapper(layer, policy=CheckpointPolicy(mode="full"))
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    hp_moe.register_expert_bias_update(opt, model, group=dp.get_group())
    hp_moe.register_expert_bias_update(ref_opt, ref)
    me = dp.get_local_rank()
    ref_params = dict(ref.named_parameters())
    norms = []
    for step in range(3):
        tokens, targets = mm.batch(step, 4)
        rows = slice(me * mm.B, (me + 1) * mm.B)
        opt.zero_grad()
        ref_opt.zero_grad()
        mm.loss_fn(model(tokens[rows]), targets[rows]).backward()
        mm.loss_fn(ref(tokens), targets).backward()
        total = clip_grad_norm_(model.parameters(), max_norm=0.05)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-7)
        assert total > 0.05  # the clip is active
        for name, p in model.named_parameters():
            name = name.replace("._checkpoint_wrapped_module", "")
            torch.testing.assert_close(
                p.grad.full_tensor(),
                ref_params[name].grad,
                rtol=1e-5,
                atol=1e-7,
                msg=f"clipped grad {name} step {step}",
            )
        opt.step()
        ref_opt.step()
        norms.append(float(total))
    for m, r in zip(mm.moes(model), mm.moes(ref)):
        torch.testing.assert_close(m.expert_bias, r.expert_bias)
    return norms


def test_clip_grad_norm_and_checkpoint_wrapper_with_ep_x_fsdp(pool):
    res = pool.run(_clip_and_offload)
    assert all(r == res[0] for r in res)
