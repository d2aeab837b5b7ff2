"""NOTE [Host ops] against torch: the aten ops a ``TorchDispatchMode`` sees in one
``LLMTrainer.dry_step`` of hp-trainer's models on one CPU process (fp32), as rank 0 of a fake
process group of 4 under FSDP (and alone, without FSDP), split by whether
autograd's engine is running, per block (the difference between one and two blocks, or two and
four for Qwen3.5's gated attention) and for the rest of the step. The planner's counts must be
these exactly: a change to the models, the trainer or torch's CPU decompositions shows here
(update the counts in ``_layers`` and the NOTE)."""

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hp_trainer")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hp_autoparallel import Plan, model_spec  # noqa: E402
from hp_autoparallel import _layers as L  # noqa: E402
from hp_autoparallel._dryrun import _fake_world  # noqa: E402
from hp_trainer import LLMTrainer, load_config  # noqa: E402
from hp_trainer.models import CONFIGS  # noqa: E402


class _Count(TorchDispatchMode):
    """Ops by phase: ``b`` while autograd's engine runs, ``s`` inside clipping, the optimizer
    step and ``zero_grad``, ``f`` otherwise; and clipping's all-reduces."""

    def __init__(self):
        super().__init__()
        self.n = collections.Counter()
        self.phase = "f"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = "b" if torch._C._current_graph_task_id() >= 0 else self.phase
        self.n[phase] += 1
        if phase == "s" and str(func.overloadpacket) == "c10d.allreduce_":
            self.n["norm all-reduces"] += 1
        if str(func.overloadpacket) == "c10d.alltoall_base_":
            self.n[f"all-to-all {phase}"] += 1
        return func(*args, **(kwargs or {}))

    def per_step(self, fn):
        def wrapped(*args, **kwargs):
            self.phase = "s"
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = "f"

        return wrapped


def _ops(monkeypatch, tmp_path, planner_toml, model, layers, seq, plan):
    """Aten ops of one ``dry_step`` of ``model`` cut to ``layers`` blocks by phase (``_Count``),
    under ``plan`` on a fake process group of its world (real tensors: the fake group's
    collectives leave them as they are, which changes no op count)."""
    base = CONFIGS[model]
    kw = {"n_layers": layers}
    if base.moe is not None:
        kw["moe"] = base.moe.replace(layers=tuple(range(layers)))
    if base.layer_types:
        kw["layer_types"] = tuple(base.layer_types[:layers])
    name = f"{model}-ops-{layers}"
    monkeypatch.setitem(CONFIGS, name, base.replace(**kw))
    tag = f"{name}-{plan.world}-{plan.tp}-{plan.pp}-{plan.ep}-{plan.dp_replicate}"
    path, _ = planner_toml(model, plan, batch=8, seq=seq, name=tag)
    cfg = load_config(
        path,
        [
            f"--model.name={name}",
            "--checkpoint.enable=false",
            "--metrics.tensorboard=false",
            "--metrics.plot=false",
            f"--job.dump_folder={tmp_path / tag}",
        ],
    )
    with _fake_world(0, plan.world):
        trainer = LLMTrainer(cfg)
        for _ in range(2):  # the optimizer's state exists from the first step on
            trainer.dry_step()
        count = _Count()
        monkeypatch.setattr(trainer, "_clip", count.per_step(trainer._clip))
        for name_ in ("step", "zero_grad"):
            monkeypatch.setattr(
                trainer.optimizer, name_, count.per_step(getattr(trainer.optimizer, name_))
            )
        with count:
            trainer.dry_step()
        del trainer
    return count.n


FSDP4 = Plan(1, 4)


def _per_block(monkeypatch, tmp_path, planner_toml, model, seq, lo=1, hi=2, plan=FSDP4):
    """((forward, backward, per step) of the blocks lo..hi, the same of the lo-block model)."""
    n1 = _ops(monkeypatch, tmp_path, planner_toml, model, lo, seq, plan)
    n2 = _ops(monkeypatch, tmp_path, planner_toml, model, hi, seq, plan)
    return tuple(n2[k] - n1[k] for k in "fbs"), tuple(n1[k] for k in "fbs")


def _minus(a, b):
    return tuple(x - y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("model", ["llama3-tiny", "qwen3-tiny", "qwen3-moe-tiny"])
def test_attention_blocks_and_the_rest(monkeypatch, tmp_path, planner_toml, model):
    spec = model_spec(model)
    block, one = _per_block(monkeypatch, tmp_path, planner_toml, model, 64)
    kind = L.kind_of(spec, 0)
    assert block == (*L.block_ops(spec, kind, 64), L.block_step_ops(spec, kind))
    assert _minus(one, block) == (*L.rest_ops(spec), L.rest_step_ops(spec))


def test_without_fsdp(monkeypatch, tmp_path, planner_toml):
    """One process (no FSDP): a block dispatches fewer ops, the rest too."""
    spec = model_spec("llama3-tiny")
    kind = L.kind_of(spec, 0)
    block, one = _per_block(monkeypatch, tmp_path, planner_toml, "llama3-tiny", 64, plan=Plan(1, 1))
    assert block == (*L.block_ops(spec, kind, 64, fsdp=False), L.block_step_ops(spec, kind))
    assert _minus(one, block) == (*L.rest_ops(spec, fsdp=False), L.rest_step_ops(spec, False))


@pytest.mark.parametrize("seq", [128, 256])
def test_qwen35_blocks_by_chunks(monkeypatch, tmp_path, planner_toml, seq):
    spec = model_spec("qwen3.5-tiny")
    gdn, one = _per_block(monkeypatch, tmp_path, planner_toml, "qwen3.5-tiny", seq)
    kind = L.kind_of(spec, 0)
    assert kind[0] == "linear_attention"
    assert gdn == (*L.block_ops(spec, kind, seq), L.block_step_ops(spec, kind))
    assert _minus(one, gdn) == (*L.rest_ops(spec), L.rest_step_ops(spec))
    pair, _ = _per_block(monkeypatch, tmp_path, planner_toml, "qwen3.5-tiny", seq, lo=2, hi=4)
    kind = L.kind_of(spec, 3)
    assert kind[0] == "gated_attention"
    assert _minus(pair, gdn) == (*L.block_ops(spec, kind, seq), L.block_step_ops(spec, kind))


def test_full_recomputation_runs_the_forward_again(monkeypatch, tmp_path, planner_toml):
    """The planner counts a checkpointed block's backward as its forward's ops plus its own
    backward's; torch's checkpoint re-runs a few fewer: within 5% of the block's total."""
    spec = model_spec("llama3-tiny")
    plan = Plan(1, 4, recompute="full")
    (f, b, s), _ = _per_block(monkeypatch, tmp_path, planner_toml, "llama3-tiny", 64, plan=plan)
    pf, pb = L.block_ops(spec, L.kind_of(spec, 0), 64)
    assert abs((f + b) - (pf + pb + pf)) <= 0.05 * (f + b)
    assert s == L.block_step_ops(spec, L.kind_of(spec, 0))


@pytest.mark.parametrize(
    "model, plan",
    [
        ("llama3-tiny", Plan(1, 4)),
        ("llama3-tiny", Plan(2, 2)),
        ("llama3-tiny", Plan(4, 1)),
        ("llama3-tiny", Plan(1, 2, tp=2)),
        ("llama3-tiny", Plan(1, 2, cp=2)),
        ("llama3-tiny", Plan(1, 2, pp=2, schedule="1f1b", microbatches=4)),
        ("llama3-tiny", Plan(1, 1, tp=2)),
        ("qwen3-moe-tiny", Plan(1, 4, ep=2)),
        ("qwen3-moe-tiny", Plan(1, 4, ep=4)),
    ],
)
def test_clipping_all_reduces(monkeypatch, tmp_path, planner_toml, model, plan):
    """The planner prices as many all-reduces of the norm as ``clip_grad_norm_`` runs."""
    from hp_autoparallel import Evaluator, Workload, load_cluster, load_gpu

    n = _ops(monkeypatch, tmp_path, planner_toml, model, 2, 64, plan)["norm all-reduces"]
    ev = Evaluator(model_spec(model), Workload(8, 64), load_gpu("cpu"), load_cluster("cpu"))
    assert len(ev._norm_groups(plan)) == n


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_all_to_alls(monkeypatch, tmp_path, planner_toml, ep):
    """A MoE block under expert parallelism runs the all-to-alls the planner prices."""
    from hp_autoparallel._estimate import EP_ALL_TO_ALLS

    n = _ops(monkeypatch, tmp_path, planner_toml, "qwen3-moe-tiny", 2, 64, Plan(1, 4, ep=ep))
    (fd, fc), (bd, bc) = EP_ALL_TO_ALLS
    assert (n["all-to-all f"], n["all-to-all b"]) == (2 * (fd + fc), 2 * (bd + bc))
