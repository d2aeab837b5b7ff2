"""Two fully_shard models in one process train as they do alone: a frozen teacher under
no_grad, two models trained alternately, both forwards before both backwards, and both losses
in one backward. Each run is compared with single-device references step by step (2 ranks)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hp_dtensor as hp
from hp_fsdp import fully_shard
from hp_testing.models import TinyLlama
from hp_testing.pytest_plugin import rank_pool_fixture

pool = rank_pool_fixture(2)

VOCAB, SEQ, B = 37, 8, 2
TOL = dict(rtol=1e-4, atol=1e-6)


def _batch(step, world):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (B * world, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _pair(seed, mesh):
    """(sharded model, its single-device reference) from one seed."""
    torch.manual_seed(seed)
    ref, model = TinyLlama(), TinyLlama()
    model.load_state_dict(ref.state_dict())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


def _ce(logits, tgt):
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def _check_grads(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {name} should have no gradient"
            continue
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=f"{what} {name}")


def _check_params(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach(), **TOL, msg=f"{what} {name}"
        )


def _scenario(kind, steps=3):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,))
    a, ref_a = _pair(0, mesh)
    b, ref_b = _pair(1, mesh)
    if kind == "teacher":
        for m in (b, ref_b):
            m.requires_grad_(False)
            m.eval()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, ref_a, b, ref_b)]
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        ids, tgt = _batch(step, world)
        if kind == "teacher":  # distillation: the student matches a frozen teacher's logits
            with torch.no_grad():
                t_out = b(ids[mine])
                t_ref = ref_b(ids)
            torch.testing.assert_close(t_out, t_ref[mine], **TOL)
            loss = _ce(a(ids[mine]), tgt[mine]) + F.mse_loss(a(ids[mine]), t_out)
            ref_loss = _ce(ref_a(ids), tgt) + F.mse_loss(ref_a(ids), t_ref)
            loss.backward()
            ref_loss.backward()
            _check_grads(a, ref_a, f"student step {step}")
            opts[0].step()
            opts[1].step()
            continue
        if kind == "alternate":  # one model's whole step, then the other's
            for m, r, om, orf in ((a, ref_a, opts[0], opts[1]), (b, ref_b, opts[2], opts[3])):
                _ce(m(ids[mine]), tgt[mine]).backward()
                _ce(r(ids), tgt).backward()
                _check_grads(m, r, f"alternate step {step}")
                om.step()
                orf.step()
            continue
        outs = [a(ids[mine]), b(ids[mine])]
        refs = [ref_a(ids), ref_b(ids)]
        if kind == "forwards_then_backwards":
            for o, r in zip(outs, refs):
                _ce(o, tgt[mine]).backward()
                _ce(r, tgt).backward()
        else:  # "one_backward": both losses, one backward through both models
            (_ce(outs[0], tgt[mine]) + 2 * _ce(outs[1], tgt[mine])).backward()
            (_ce(refs[0], tgt) + 2 * _ce(refs[1], tgt)).backward()
        _check_grads(a, ref_a, f"{kind} a step {step}")
        _check_grads(b, ref_b, f"{kind} b step {step}")
        for o in opts:
            o.step()
    _check_params(a, ref_a, kind)
    _check_params(b, ref_b, kind)
    # both models are sharded again after the last step
    for m in (a, b):
        assert all(p.to_local().numel() < p.numel() for p in m.parameters() if p.numel() > 1)
    return True


def test_two_models_train_as_they_do_alone(pool):
    for kind in ("teacher", "alternate", "forwards_then_backwards", "one_backward"):
        assert pool.run(_scenario, kind) == [True, True], kind
