"""``hp-plan dry-run`` and the planner's memory model against real runs on 4 CPU ranks (issue 29).

For each configuration the planner writes its hp-train TOML (``train_config(estimate(...))``);
then, in one launch:

- the real run: 4 gloo ranks (``hp_testing.run_ranks``) each build ``hp_trainer.LLMTrainer``
  from the TOML and measure a warm-up step and one step with ``hp_autoparallel.step_peak``
  (torch's MemTracker over real tensors: the live tensor bytes a rank holds at its peak);
- the dry run: ``hp-plan dry-run TOML --ranks all --json`` in a process of its own (fake
  tensors, a fake process group of 4 ranks, one rank's view after another);
- the prediction: ``hp_autoparallel.estimate`` with the shipped ``cpu`` calibration and cluster
  (or ``--calibration`` / ``--cluster`` files; ``--calibrate`` runs ``hp-plan calibrate --ranks 4
  --cluster-out`` first, in the same launch, and predicts with what it measured).

It prints, per configuration, the fullest rank's real peak, the dry run's (rank by rank the
largest difference too) and the prediction, with their errors, and the real step time (the
median of 3 runs of 9 ``train_step`` calls back to back between barriers, after the memory
steps) beside the predicted one. Targets: the dry run within 3% of the real run on every
rank; the prediction within 5% of the fullest real rank and 15% of the step time.

    python benchmarks/autoparallel/dry_run_cpu.py [--only NAME] [--out results.json]
        [--calibrate | --calibration FILE --cluster FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DRY_TARGET = 3.0  # percent
MEMORY_TARGET = 5.0  # percent
TIME_TARGET = 15.0  # percent
WORLD = 4
TIMED_STEPS = 9  # steps back to back per timed run, after the memory steps


@dataclass(frozen=True)
class Case:
    """One configuration on 4 ranks: model, plan degrees, recompute, batch x sequence."""

    name: str
    model: str
    plan: dict
    batch: int = 8
    seq: int = 256


CASES = (
    Case("fsdp4", "llama3-tiny", {"dp_shard": 4}),
    Case("hsdp2x2", "llama3-tiny", {"dp_replicate": 2, "dp_shard": 2}),
    # replication alone: whole parameters on each rank, gradients all-reduced
    Case("replicate4", "llama3-tiny", {"dp_replicate": 4, "dp_shard": 1}),
    Case("fsdp2-tp2", "llama3-tiny", {"dp_shard": 2, "tp": 2}),
    Case("pp2-fsdp2", "llama3-tiny", {"dp_shard": 2, "pp": 2, "schedule": "1f1b", "mb": 4}),
    Case("fsdp4-full", "llama3-tiny", {"dp_shard": 4, "recompute": "full"}),
    Case("cp2-fsdp2", "llama3-tiny", {"dp_shard": 2, "cp": 2}),
    Case("moe-ep2-fsdp4", "qwen3-moe-tiny", {"dp_shard": 4, "ep": 2}),
    Case("moe-ep4", "qwen3-moe-tiny", {"dp_shard": 4, "ep": 4}),
    # Qwen3.5: three Gated DeltaNet blocks (four chunks of the delta rule each) and one gated
    # attention block
    Case("qwen3.5-fsdp4", "qwen3.5-tiny", {"dp_shard": 4}),
)


def plan_of(case: Case):
    """The planner's ``Plan`` and ``Workload`` of ``case``."""
    from hp_autoparallel import Plan, Workload

    p = dict(case.plan)
    plan = Plan(
        p.pop("dp_replicate", 1),
        p.pop("dp_shard", 1),
        tp=p.pop("tp", 1),
        pp=p.pop("pp", 1),
        cp=p.pop("cp", 1),
        ep=p.pop("ep", 1),
        schedule=p.pop("schedule", "none"),
        microbatches=p.pop("mb", 1),
        recompute=p.pop("recompute", "none"),
    )
    if p:
        raise ValueError(f"{case.name}: unknown plan keys {sorted(p)}")
    return plan, Workload(case.batch, case.seq)


def write_toml(
    case: Case, folder: Path, calibration: str = "cpu", cluster: str = "cpu"
) -> tuple[Path, float, float]:
    """The planner's TOML of ``case``, its predicted allocated bytes and step seconds under
    ``calibration`` and ``cluster`` (shipped kinds or files)."""
    from hp_autoparallel import estimate, load_cluster, load_gpu, model_spec, train_config

    plan, work = plan_of(case)
    gpu = load_gpu(calibration)
    est = estimate(model_spec(case.model), plan, work, gpu, load_cluster(cluster))
    text = train_config(
        est,
        model=case.model,
        global_batch=case.batch,
        seq_len=case.seq,
        gpu=gpu.name,
        compute_dtype=gpu.compute_dtype,
    )
    path = folder / f"{case.name}.toml"
    path.write_text(text)
    return path, est.memory.allocated, est.time.total


def _real_rank(toml: str, dump: str) -> dict:
    """One rank of the real run (under run_ranks): build, warm up, measure one step's peak,
    then time train_step (3 runs of TIMED_STEPS back to back between barriers)."""
    import torch.distributed as dist

    from hp_autoparallel import step_peak
    from hp_trainer import LLMTrainer, load_config

    cfg = load_config(
        toml,
        [
            "--checkpoint.enable=false",
            "--metrics.tensorboard=false",
            "--metrics.plot=false",
            f"--job.dump_folder={dump}",
        ],
    )
    trainer, peak, by_kind = step_peak(lambda: LLMTrainer(cfg), measured_steps=3)
    # then the step's time, without the tracker, of the step training runs (train_step: with
    # its loss and flags all-reduced and read back), as a training loop sees it: steps back to
    # back between two barriers (whose latency is spread over them), three times, the median
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(TIMED_STEPS):
            trainer.train_step()
        dist.barrier()
        times.append((time.perf_counter() - t0) / TIMED_STEPS)
    return {
        "rank": dist.get_rank(),
        "peak_bytes": peak,
        "by_kind": by_kind,
        "step_s": statistics.median(times),
    }


def real_run(toml: Path, folder: Path) -> dict[int, dict]:
    """Each rank's real step peak, by rank."""
    from hp_testing import run_ranks

    out = run_ranks(_real_rank, WORLD, args=(str(toml), str(folder / "dump")), timeout=600)
    return {r["rank"]: r for r in out}


def dry_run(toml: Path, folder: Path) -> dict:
    """``hp-plan dry-run TOML --ranks all --json`` in a process of its own."""
    out = folder / f"{toml.stem}.dry.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "hp_autoparallel",
            "dry-run",
            str(toml),
            "--ranks",
            "all",
        ]
        + ["--gpu", "cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode:
        raise RuntimeError(
            f"hp-plan dry-run failed (exit {proc.returncode}):\n{proc.stdout}\n"
            f"{proc.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


def check(case: Case, folder: Path, calibration: str = "cpu", cluster: str = "cpu") -> dict:
    """Real, dry and predicted for ``case``."""
    toml, predicted, predicted_s = write_toml(case, folder, calibration, cluster)
    real = real_run(toml, folder)
    dry = dry_run(toml, folder)
    per_rank = []
    for r in dry["ranks"]:
        m = real[r["rank"]]["peak_bytes"]
        per_rank.append(100.0 * (r["peak_bytes"] - m) / m)
    real_max = max(r["peak_bytes"] for r in real.values())
    step_s = max(r["step_s"] for r in real.values())  # (the ranks wait for each other)
    return {
        "config": case.name,
        "model": case.model,
        "plan": dry["plan"],
        "real_bytes": {k: v["peak_bytes"] for k, v in real.items()},
        "real_by_kind": {k: v["by_kind"] for k, v in real.items()},
        "dry_bytes": {r["rank"]: r["peak_bytes"] for r in dry["ranks"]},
        "dry_err_pct": per_rank,
        "dry_worst_pct": max(per_rank, key=abs),
        "predicted_bytes": predicted,
        "predicted_err_pct": 100.0 * (predicted - real_max) / real_max,
        "real_max_bytes": real_max,
        "dry_max_bytes": dry["peak_bytes"],
        "dry_elapsed_s": dry["elapsed_s"],
        "step_ms": step_s * 1e3,
        "predicted_ms": predicted_s * 1e3,
        "time_err_pct": 100.0 * (predicted_s - step_s) / step_s,
    }


def table(rows: list[dict]) -> str:
    """The comparison, one line per configuration."""
    mib = 2**20
    head = (
        f"{'config':<16} {'plan':<34} {'real MiB':>9} {'dry MiB':>9} {'dry err':>8} "
        f"{'pred MiB':>9} {'pred err':>9} {'step ms':>8} {'pred ms':>8} {'err':>7}  ok"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = [
            "dry" if abs(r["dry_worst_pct"]) <= DRY_TARGET else "DRY!",
            "mem" if abs(r["predicted_err_pct"]) <= MEMORY_TARGET else "MEM!",
            "time" if abs(r["time_err_pct"]) <= TIME_TARGET else "TIME!",
        ]
        lines.append(
            f"{r['config']:<16} {r['plan']:<34} {r['real_max_bytes'] / mib:>9.2f} "
            f"{r['dry_max_bytes'] / mib:>9.2f} {r['dry_worst_pct']:>+7.2f}% "
            f"{r['predicted_bytes'] / mib:>9.2f} {r['predicted_err_pct']:>+8.1f}% "
            f"{r['step_ms']:>8.1f} {r['predicted_ms']:>8.1f} {r['time_err_pct']:>+6.1f}%  "
            f"{' '.join(ok)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only the configurations whose name contains this")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--calibration", default="cpu", help="GPU calibration (kind or file)")
    ap.add_argument("--cluster", default="cpu", help="cluster (kind or file)")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="first run `hp-plan calibrate --ranks 4 --cluster-out` here and predict with "
        "what it measured (instead of --calibration / --cluster)",
    )
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.only or args.only in c.name]
    if not cases:
        ap.error(f"--only {args.only!r} matches no configuration")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.calibrate:
            args.calibration, args.cluster = f"{tmp}/cpu.toml", f"{tmp}/cluster.toml"
            cmd = [sys.executable, "-m", "hp_autoparallel", "calibrate", "--device", "cpu"]
            cmd += ["--ranks", str(WORLD), "--out", args.calibration]
            cmd += ["--cluster-out", args.cluster]
            subprocess.run(cmd, check=True)
        for case in cases:
            rows.append(check(case, Path(tmp), args.calibration, args.cluster))
            r = rows[-1]
            print(
                f"{case.name}: real {r['real_max_bytes'] / 2**20:.2f} MiB, dry "
                f"{r['dry_worst_pct']:+.2f}% (worst rank), predicted "
                f"{r['predicted_err_pct']:+.1f}%; step {r['step_ms']:.1f} ms, predicted "
                f"{r['time_err_pct']:+.1f}%",
                flush=True,
            )
    print()
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
