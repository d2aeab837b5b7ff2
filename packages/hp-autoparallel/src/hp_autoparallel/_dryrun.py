"""``hp-plan dry-run CONFIG``: build an hp-train configuration on one process, with fake tensors
and a fake process group of the real world size, and report each rank's peak memory beside
the planner's prediction.

Imported only by the ``dry-run`` subcommand and by code that asks for it (it imports torch and
hp-trainer; the planning core does not). For each rank of a representative set (one per
pipeline rank by default, the first of each ``pp`` coordinate; every rank with
``ranks="all"``) it:

1. starts torch's fake process group (``backend="fake"``) as that rank of the world: every
   collective returns at once with outputs of the right shapes, nothing is sent;
2. builds ``hp_trainer.LLMTrainer`` from the configuration under ``FakeTensorMode``: the
   parameters, optimizer states and activations have shapes, dtypes and devices but no
   storage, so a 671B model builds on a laptop;
3. runs ``LLMTrainer.dry_step`` (a training step's tensor work, nothing read back) under
   torch's ``MemTracker``: a warm-up step that creates the optimizer states, then the measured
   step, whose peak starts from what the warm-up left held, as a real run's steady state does.

The peak is the live tensor bytes on the trainer's device (CUDA sizes rounded to the caching
allocator's 512-byte blocks), i.e. ``torch.cuda.max_memory_allocated`` over a step, without
the allocator's fragmentation. ``step_peak`` measures the same thing on a real run (real
tensors and process group), which is how the tests and benchmarks check the dry run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._hardware import GIB
from ._plan import Plan, Workload
from .errors import PlanError, PlanTypeError

__all__ = ["DryRunReport", "RankPeak", "dry_run", "plan_of_config", "step_peak"]

#: overrides every dry run applies: nothing is written, nothing resumed
_QUIET = (
    "--checkpoint.enable=false",
    "--metrics.tensorboard=false",
    "--metrics.plot=false",
)


@dataclass(frozen=True)
class RankPeak:
    """One rank's measured step: ``peak_bytes`` of live tensors on ``device`` during the
    measured step, ``by_kind`` what held them at that moment (MemTracker's parameter /
    gradient / activation / temporary / optimizer-state / buffer split), ``coords`` the
    rank's place in the world mesh."""

    rank: int
    coords: dict[str, int]
    peak_bytes: int
    by_kind: dict[str, int]
    device: str


@dataclass(frozen=True)
class DryRunReport:
    """What ``dry_run`` found: each measured rank's peak and, where the planner can model the
    configuration, its prediction (``predicted`` allocated bytes of the fullest rank; None
    with ``why_no_prediction`` otherwise)."""

    config: str
    world: int
    ranks: tuple[RankPeak, ...]
    plan: Plan | None
    predicted_bytes: float | None
    predicted_rank: int | None
    why_no_prediction: str = ""
    elapsed_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_bytes(self) -> int:
        """The fullest measured rank's peak."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def compared_bytes(self) -> int | None:
        """The measured peak the prediction is for: the fullest measured rank of the pipeline
        rank the planner found fullest (None when none of its ranks was measured)."""
        if self.predicted_rank is None:
            return None
        same = [r.peak_bytes for r in self.ranks if r.coords.get("pp", 0) == self.predicted_rank]
        return max(same) if same else None

    @property
    def error(self) -> float | None:
        """(predicted - dry run) / dry run on the planner's fullest pipeline rank; None without
        a prediction or when none of that pipeline rank's ranks was measured."""
        got = self.compared_bytes
        if self.predicted_bytes is None or got is None:
            return None
        return (self.predicted_bytes - got) / got

    def to_dict(self) -> dict:
        """The report as plain data (what ``--json`` writes)."""
        return {
            "config": self.config,
            "world": self.world,
            "plan": str(self.plan) if self.plan is not None else None,
            "predicted_bytes": self.predicted_bytes,
            "predicted_rank": self.predicted_rank,
            "why_no_prediction": self.why_no_prediction,
            "peak_bytes": self.peak_bytes,
            "compared_bytes": self.compared_bytes,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
            "ranks": [
                {
                    "rank": r.rank,
                    "coords": r.coords,
                    "peak_bytes": r.peak_bytes,
                    "by_kind": r.by_kind,
                    "device": r.device,
                }
                for r in self.ranks
            ],
        }

    def table(self) -> str:
        """The per-rank peaks and the prediction, for printing."""
        kinds = sorted({k for r in self.ranks for k in r.by_kind})
        unit, scale = ("GiB", GIB) if self.peak_bytes >= GIB else ("MiB", 2**20)
        head = f"{'rank':>5}  {'coordinates':<34} {'peak ' + unit:>9}  " + "  ".join(
            f"{k[:12]:>12}" for k in kinds
        )
        lines = [head, "-" * len(head)]
        for r in self.ranks:
            coords = " ".join(f"{k} {v}" for k, v in r.coords.items()) or "-"
            lines.append(
                f"{r.rank:>5}  {coords:<34} {r.peak_bytes / scale:>9.3f}  "
                + "  ".join(f"{r.by_kind.get(k, 0) / scale:>12.3f}" for k in kinds)
            )
        if self.predicted_bytes is None:
            lines.append(f"no prediction: {self.why_no_prediction}")
        elif self.error is None:
            lines.append(
                f"predicted (hp-plan, {self.plan}): {self.predicted_bytes / scale:.3f} {unit} "
                f"on pipeline rank {self.predicted_rank}, none of whose ranks was measured "
                "(--ranks)"
            )
        else:
            lines.append(
                f"predicted (hp-plan, {self.plan}): {self.predicted_bytes / scale:.3f} {unit} "
                f"allocated on the fullest rank (pipeline rank {self.predicted_rank}); dry run "
                f"{self.compared_bytes / scale:.3f} {unit}: {100 * self.error:+.1f}%"
            )
        lines += list(self.notes)
        return "\n".join(lines)


class _Phase:
    """Stands in for MemTracker's module tracker: whether autograd is running a backward
    (``torch._C._current_graph_task_id``), with no hooks at all. The module tracker's own
    gradient hooks break a backward split into input and weight passes (ZBV's
    ``torch.autograd.grad``), and its per-module statistics refuse a root module called twice
    in one step, which microbatches do."""

    parents = frozenset()  # no module is ever active

    @property
    def is_bw(self) -> bool:
        import torch

        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def _tracker():
    """torch's ``MemTracker`` with :class:`_Phase` for its module tracker: the global peak,
    the storage bookkeeping (``resize_`` included) and the forward / backward / optimizer split
    are MemTracker's own; the per-module statistics are off."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt._mod_tracker = _Phase()
    return mt


def step_peak(build: Callable[[], object], *, warmup_steps: int = 1, measured_steps: int = 1):
    """Build a trainer with ``build()`` and run ``warmup_steps`` then one measured
    ``dry_step`` under torch's ``MemTracker``; returns ``(trainer, peak_bytes, by_kind)``, the
    peak of live tensor bytes on the trainer's device during the measured step and what held
    them (parameters, buffers and optimizer states; activations: what forward allocated;
    temporaries: what backward allocated, gradients included). Works alike on real tensors
    and under ``FakeTensorMode`` (the dry run).

    ``measured_steps > 1`` measures that many steps and keeps the lowest peak (with its
    kinds). On gloo a collective's worker thread lets go of the work's tensors after the waiting
    thread has resumed, so a temporary the program has dropped can still be counted when the
    next one is made: such a late free only ever raises a step's peak, by a few percent in one
    step of thirty on 4 CPU ranks. The lowest of a few steps is the program's own peak; a fake
    process group has no threads and one step is exact."""
    for name, v, low in (("warmup_steps", warmup_steps, 0), ("measured_steps", measured_steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise PlanTypeError(f"step_peak: {name}={v!r}: give an int >= {low}")
    mt = _tracker()
    with mt:  # everything the trainer allocates is tracked, so its release is seen too
        trainer = build()
        if getattr(getattr(trainer, "schedule", None), "threaded_b_f", False):
            raise PlanError(
                "step_peak: the pipeline runs backwards on a helper thread (threaded_b_f), "
                "which the tracker (a per-thread dispatch mode) cannot see: build it without"
            )
        for _ in range(warmup_steps):
            trainer.dry_step()
    mt.track_external(trainer.model, trainer.optimizer)  # names what parameters etc. hold
    # Python's cyclic collector frees garbage (autograd graphs in cycles) when its counters say
    # so, at a point of the step that moves with every allocation of Python objects: collected
    # now and off during the step, the peak is the step's own, the same in every process
    best = None
    for _ in range(measured_steps):
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with mt:  # re-entering starts the peak from what is held now (the steady state)
                trainer.dry_step()
        finally:
            if was_enabled:
                gc.enable()
        snap = mt.get_tracker_snapshot("peak")
        row = snap.get(_device_key(snap, trainer.device), {})
        total = int(row.get("Total", 0))
        if best is None or total < best[0]:
            best = (total, row)
    total, row = best
    by_kind = {str(getattr(k, "value", k)): int(v) for k, v in row.items() if k != "Total" and v}
    if trainer.device.type == "cpu":  # the token corpus is host memory, which a GPU's
        # allocator never sees; on a CPU device the tracker counts it (with the forward's
        # tensors, as it was made outside any step): taken out, it is held all along
        corpus = trainer.data.tokens.untyped_storage().nbytes()
        total -= corpus
        if "Activation" in by_kind:
            by_kind["Activation"] -= corpus
    return trainer, total, by_kind


def _device_key(snap: dict, device):
    """The snapshot's key for ``device`` (MemTracker keys by the tensors' devices; the meta
    tensors hp_dtensor's dispatcher infers shapes with are not device memory)."""
    for k in snap:
        if k.type == device.type and (device.index is None or k.index in (None, device.index)):
            return k
    return device


def plan_of_config(cfg, world: int):
    """``(ModelSpec, Plan, Workload)`` of an hp-train ``JobConfig`` on ``world`` ranks, as the
    planner would have written it; raises :class:`PlanError` saying why for what the planner
    does not model (a per-layer activation plan, a HuggingFace model folder)."""
    from hp_trainer import preflight

    from ._spec import model_spec

    if cfg.model.hf_path:
        raise PlanError(
            "model.hf_path: the planner models the registry's configurations, not a "
            "HuggingFace folder"
        )
    ac = cfg.activation_checkpoint
    if ac.plan:
        raise PlanError(
            f"activation_checkpoint.plan={ac.plan!r}: the planner predicts one mode for every "
            "block; the per-layer policy is hp_autoparallel.offload_policy"
        )
    pd, _ = preflight(cfg, world)
    t, p = cfg.training, cfg.parallelism
    per_rank = t.global_batch_size // pd.dp
    if pd.pp > 1:
        schedule, micro = p.pipeline_schedule, p.pipeline_microbatches or pd.pp
    else:
        schedule, micro = "none", per_rank // (t.local_batch_size or per_rank)
    plan = Plan(
        pd.dp_replicate,
        pd.dp_shard,
        tp=pd.tp,
        pp=pd.pp,
        cp=pd.cp,
        ep=pd.ep,
        etp=pd.etp,
        schedule=schedule,
        microbatches=micro,
        recompute=ac.mode,
    )
    mtp = cfg.model.mtp_layers if cfg.model.mtp_layers >= 0 else None
    return (
        model_spec(cfg.model.name, mtp_layers=mtp),
        plan,
        Workload(t.global_batch_size, t.seq_len),
    )


def _check_dry(cfg) -> None:
    """What a dry run cannot honour, refused by name."""
    if cfg.model.hf_path:
        raise PlanError(
            f"model.hf_path={cfg.model.hf_path!r}: a dry run builds random weights of the "
            "registry's configuration (loading a checkpoint would read it on every rank view): "
            "give model.name instead"
        )
    if cfg.parallelism.collectives != "torch":
        raise PlanError(
            f"parallelism.collectives={cfg.parallelism.collectives!r}: the dry run's fake "
            "process group stands for torch's collectives; run it with "
            "--parallelism.collectives=torch (the tensors are the same)"
        )


def _predict(cfg, world: int, gpu: str | None):
    """``(plan, predicted allocated bytes, fullest pipeline rank, why not)`` for ``cfg``; a
    ``gpu`` given whose compute dtype is not the configuration's is refused."""
    from ._estimate import estimate
    from ._hardware import load_cluster, load_gpu
    from .errors import ClusterFileError

    want = cfg.training.mixed_precision_param
    kind = gpu or ("cpu" if want == "float32" else "h200")
    g = load_gpu(kind)
    if g.compute_dtype != want:
        if gpu is not None:
            raise PlanError(
                f"--gpu {kind!r} is calibrated for {g.compute_dtype}, the configuration "
                f"computes in {want} (training.mixed_precision_param): give a {want} "
                "calibration"
            )
        return None, None, None, f"no shipped calibration computes in {want}: give --gpu FILE"
    try:
        spec, plan, work = plan_of_config(cfg, world)
    except PlanError as e:
        return None, None, None, str(e)
    try:
        cluster = load_cluster(g.name)
    except ClusterFileError:
        cluster = load_cluster("cpu" if want == "float32" else "h200")
    est = estimate(spec, plan, work, g, cluster)
    return plan, est.memory.allocated, est.memory.rank, ""


def _representative(pd, ranks) -> list[int]:
    world = pd.world_size
    if ranks is None:  # one rank per pipeline rank (stages differ; within one they agree)
        per_stage = world // pd.pp
        return [s * per_stage for s in range(pd.pp)]
    if ranks == "all":
        return list(range(world))
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise PlanTypeError(f"dry_run: ranks={ranks!r}: give None, 'all' or a list of ranks")
    if not ranks:
        raise PlanError("dry_run: ranks=[]: give at least one rank (or None, or 'all')")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise PlanTypeError(f"dry_run: ranks: {r!r} is a {type(r).__name__}: give ints")
        if not 0 <= r < world:
            raise PlanError(f"dry_run: ranks: {r} is not a rank of the world of {world}")
        out.append(r)
    return sorted(set(out))


@contextlib.contextmanager
def _fake_world(rank: int, world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hp_dtensor

    if dist.is_initialized():
        raise PlanError(
            "dry_run: a process group is already initialized in this process; run the dry run "
            "in a process of its own (hp-plan dry-run)"
        )
    if world > 1:  # one rank: hp-train makes no process group, nor does the dry run
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    saved_world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)  # under torchrun the trainer would read torchrun's
    try:
        with warnings.catch_warnings():  # the trainer sets timeouts a fake group has not
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            # torch's own deepcopy asks a fake tensor for its address (the stage split copies)
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:  # hp_dtensor's: its cached sub-groups and meshes go with the group
        if saved_world is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_world
        if world > 1:
            hp_dtensor.destroy_process_group(barrier=False)


def _coords(trainer) -> dict[str, int]:
    mesh = trainer.mesh
    if mesh is None:
        return {}
    return {n: int(c) for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)}


def dry_run(
    config,
    *,
    world: int,
    ranks=None,
    gpu: str | None = None,
    overrides: Sequence[str] = (),
    warmup_steps: int = 1,
) -> DryRunReport:
    """Measure ``config`` (an hp-train TOML path) on ``world`` ranks with fake tensors and a
    fake process group, rank by rank (``ranks``: None for one per pipeline rank, ``"all"``,
    or a list), and compare the fullest rank with ``hp_autoparallel.estimate`` for the GPU
    kind ``gpu`` (a shipped kind or a calibration file; default: ``h200`` for a bf16
    configuration, ``cpu`` for an fp32 one). ``overrides`` are hp-train's ``--section.key=value``
    overrides. The trainer's device is CUDA where torch sees one, else the CPU."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_trainer import LLMTrainer, load_config, preflight

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise PlanTypeError(f"dry_run: world={world!r}: give the number of ranks, an int >= 1")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise PlanTypeError(f"dry_run: warmup_steps={warmup_steps!r}: give an int >= 0")
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence):
        raise PlanTypeError(
            f"dry_run: overrides={overrides!r}: give a list of '--section.key=value' strings"
        )
    path = Path(config)
    if not path.is_file():
        raise PlanError(f"dry_run: config {str(config)!r}: no such file (give an hp-train TOML)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(path, [*overrides, *_QUIET, f"--job.dump_folder={tmp}"])
        pd, _ = preflight(cfg, world)  # a configuration that cannot run is refused here
        _check_dry(cfg)
        chosen = _representative(pd, ranks)
        plan, predicted, pred_rank, why = _predict(cfg, world, gpu)
        boundary = None  # what stage 0 sends on: every stage's declared inputs
        if pd.pp > 1:
            with _fake_world(0, world), FakeTensorMode(allow_non_fake_inputs=True):
                boundary = LLMTrainer(cfg).first_stage_outputs()

        def build():
            trainer = LLMTrainer(cfg)
            if boundary is not None:
                n = len(trainer.schedule.placement)
                trainer.schedule.declare_input_shapes({s: boundary for s in range(1, n)})
            return trainer

        peaks = []
        for rank in chosen:
            with _fake_world(rank, world), FakeTensorMode(allow_non_fake_inputs=True):
                trainer, total, by_kind = step_peak(build, warmup_steps=warmup_steps)
                peaks.append(RankPeak(rank, _coords(trainer), total, by_kind, str(trainer.device)))
                trainer_moe = trainer.model_config.moe is not None
                del trainer
    notes = [
        f"device {peaks[0].device} (torch {torch.__version__}); peaks are live tensor bytes "
        "(torch's MemTracker), before the allocator's fragmentation"
    ]
    ac = cfg.activation_checkpoint
    if ac.mode == "swap" or "swap" in (ac.plan or ""):
        notes.append(
            "swap: copies take no time under fake tensors, so none is in flight: a lower bound"
            + (
                " (on a CPU device the host buffers are the same memory and are counted)"
                if peaks[0].device == "cpu"
                else ""
            )
        )
    if trainer_moe and cfg.training.mixed_precision_param == "float32":
        notes.append(
            "MoE in float32: torch's grouped matmul has no fake-tensor rule for it, so the "
            "experts run as a loop of matmuls here (a real run uses the grouped kernel)"
        )
    if trainer_moe:
        notes.append("MoE: routing is data; the dry run routes evenly over experts and ranks")
    return DryRunReport(
        config=str(path),
        world=world,
        ranks=tuple(peaks),
        plan=plan,
        predicted_bytes=predicted,
        predicted_rank=pred_rank,
        why_no_prediction=why,
        elapsed_s=time.perf_counter() - t0,
        notes=tuple(notes),
    )


def main(argv: list[str]) -> int:
    """``hp-plan dry-run CONFIG --world N [--ranks all|R,R,...] [--gpu KIND] [overrides]``."""
    import argparse
    import sys

    from hp_trainer.errors import ConfigError

    ap = argparse.ArgumentParser(
        prog="hp-plan dry-run",
        description="Build an hp-train configuration with fake tensors and a fake process "
        "group of the world size; print each rank's peak memory beside hp-plan's prediction.",
    )
    ap.add_argument("config", help="an hp-train TOML (e.g. the one hp-plan wrote)")
    ap.add_argument("--world", type=int, help="ranks (default: the product of the TOML's degrees)")
    ap.add_argument(
        "--ranks",
        help="'all', or ranks separated by commas (default: the first rank of each pipeline rank)",
    )
    ap.add_argument(
        "--gpu",
        help="GPU kind of the prediction, shipped or a calibration file (default: h200; cpu "
        "for an fp32 configuration)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="steps before the measured one")
    ap.add_argument("--json", help="also write the report here, as JSON")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    try:
        world = args.world if args.world is not None else _world_of(args.config, overrides)
        ranks = None
        if args.ranks == "all":
            ranks = "all"
        elif args.ranks:
            try:
                ranks = [int(r) for r in args.ranks.split(",")]
            except ValueError:
                raise PlanError(
                    f"--ranks {args.ranks!r}: give 'all' or ranks separated by commas"
                ) from None
        report = dry_run(
            args.config,
            world=world,
            ranks=ranks,
            gpu=args.gpu,
            overrides=overrides,
            warmup_steps=args.warmup,
        )
    except PlanError as e:
        print(f"hp-plan dry-run: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # hp-trainer's own refusals name their field
        print(f"hp-plan dry-run: {e}", file=sys.stderr)
        return 2
    print(
        f"hp-plan dry-run: {report.config} on {report.world} ranks, {len(report.ranks)} "
        f"measured in {report.elapsed_s:.1f} s\n"
    )
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
        print(f"wrote {args.json}")
    return 0


def _world_of(config, overrides) -> int:
    """The world size a TOML's degrees name (every degree must be explicit, as hp-plan writes
    them); else :class:`PlanError` asking for ``--world``."""
    from hp_trainer import load_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(Path(config), [*overrides, *_QUIET, f"--job.dump_folder={tmp}"])
    p = cfg.parallelism
    degrees = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
    )
    if any(d < 1 for d in degrees):
        raise PlanError(
            "--world: the configuration leaves a degree to be resolved "
            f"(data_parallel_shard_degree={p.data_parallel_shard_degree}): give --world N"
        )
    n = 1
    for d in degrees:
        n *= d
    return n
