"""threaded_b_f on one process: ZBV's two stages on this rank (the V folded onto one rank), B
and W kept apart, the backward of each B + F pair and every W on the helper thread."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_pipeline import (
    PipelineError,
    PipelineStage,
    ScheduleZBV,
    add_communication,
    fuse_overlap_b_f,
    v_placement,
    zbv_steps,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(16), nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=False)
        self.p = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        with torch.autocast("cpu", enabled=False):  # an fp32 island (a router, say)
            return h + h.float() @ self.p.t()


def _models():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()), nn.Sequential(Block(), nn.Linear(16, 4))


def _loss(out, y):
    return F.mse_loss(out.float(), y)


def _grads(threaded: bool, m: int = 4):
    a, b = _models()
    stages = [PipelineStage(a, 0, 2, device="cpu"), PipelineStage(b, 1, 2, device="cpu")]
    sched = ScheduleZBV(stages, m, loss_fn=_loss, overlap_b_f=True, threaded_b_f=threaded)
    # one rank holds both stages; keep B and W apart (build_schedule would merge them)
    sched.steps = add_communication(fuse_overlap_b_f(zbv_steps(1, m)), v_placement(1))[0]
    assert any(s.type.name == "W" for s in sched.steps)
    torch.manual_seed(1)
    x, y = torch.randn(2 * m, 5, 16), torch.randn(2 * m, 5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sched.step(x, target=y)
    if threaded:
        assert sched._helper is not None
    return {n: p.grad.clone() for n, p in [*a.named_parameters(), *b.named_parameters()]}


def test_threaded_equals_one_thread_under_the_callers_autocast():
    """The helper thread runs under the caller's autocast state, as a backward on the calling
    thread does: the gradients are the same to the bit (they differed by ~1e-3 when the
    helper ran without it, through the fp32 island)."""
    plain, threaded = _grads(False), _grads(True)
    for n in plain:
        assert torch.equal(plain[n], threaded[n]), n


def test_threaded_refuses_tensor_subclass_parameters():
    """A DTensor-like parameter means collectives inside the stage's forward and backward,
    which two threads would issue in a different order on each rank."""

    class Sub(torch.Tensor):
        pass

    a, b = _models()
    a[0].p = nn.Parameter(torch.Tensor._make_subclass(Sub, torch.zeros(16, 16), True))
    stages = [PipelineStage(a, 0, 2, device="cpu"), PipelineStage(b, 1, 2, device="cpu")]
    with pytest.raises(PipelineError, match="threaded_b_f=True: stage 0's parameter '0.p'"):
        ScheduleZBV(stages, 4, loss_fn=_loss, overlap_b_f=True, threaded_b_f=True)
