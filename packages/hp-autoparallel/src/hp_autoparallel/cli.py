"""``hp-plan``: rank the ways to train a model on N GPUs and write an hp-train TOML for the best.

    hp-plan --model deepseek-v3-671b --gpus 1024 --gpu h200 --global-batch 4096 --seq 8192

prints a ranked table (config, predicted step time, tokens/s/GPU, MFU, peak memory per GPU,
the biggest cost), the best plan's time and memory by cause, and the path of the TOML it wrote
(to the current folder, or ``--out``). ``--why`` lists why each rejected family was rejected.
Mistakes (an unknown model or GPU kind, a cluster file with missing fields, a GPU count no
configuration can use) print one message naming the argument and the nearest valid choice
and exit with status 2.

    hp-plan calibrate [--out FILE] [--quick]

measures this machine's calibration file (``_calibrate``, imported only by this subcommand:
it needs torch) and writes it; pass it back as ``hp-plan --gpu FILE``.

    hp-plan dry-run CONFIG [--world N] [--ranks all|R,R] [--gpu KIND] [--section.key=value ...]

builds the hp-train configuration with fake tensors and a fake process group of the world
size, runs a step rank by rank and prints each rank's peak memory beside the prediction
(``_dryrun``, torch and hp-trainer imported only by this subcommand).
"""

from __future__ import annotations

import argparse
import sys

from ._hardware import GIB, load_cluster, load_gpu, shipped_clusters
from ._plan import Workload
from ._search import search
from ._spec import model_spec
from ._toml import train_config, write_train_config
from .errors import ClusterFileError, PlanError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hp-plan",
        description="Search data / tensor / pipeline / context / expert parallelism, "
        "microbatches and recomputation for a model on N GPUs; print the ranking and write "
        "an hp-train TOML for the best. `hp-plan calibrate --help`: measure a calibration "
        "file on this machine; `hp-plan dry-run --help`: measure a configuration's peak "
        "memory per rank with fake tensors.",
    )
    ap.add_argument("--model", required=True, help="a model of hp-trainer's registry")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs to use, all of them")
    ap.add_argument("--gpu", default="h200", help="GPU kind (shipped: h200, cpu) or a file")
    ap.add_argument("--global-batch", type=int, default=4096, help="sequences per step")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    ap.add_argument("--cluster", help="cluster TOML (default: the GPU kind's shipped one)")
    ap.add_argument("--top", type=int, default=10, help="rows of the table")
    ap.add_argument("--why", action="store_true", help="why each rejected family was rejected")
    ap.add_argument("--out", default=".", help="folder for the hp-train TOML (default: .)")
    ap.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help="DeepSeek-V3's multi-token prediction depths (0 drops them; hp-trainer runs "
        "them only with pp = tp = cp = 1)",
    )
    ap.add_argument(
        "--no-simulate",
        action="store_true",
        help="rank pipelines by the closed forms only (skip hp-pipeline's simulator)",
    )
    return ap


def _check_positive(value: int, flag: str) -> None:
    if value < 1:
        raise PlanError(f"{flag} {value}: must be at least 1")


def main(argv: list[str] | None = None) -> int:
    """The ``hp-plan`` command; returns the exit status (2 for a mistake in the inputs)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "calibrate":
        from ._calibrate import main as calibrate_main  # torch: only for this subcommand

        return calibrate_main(argv[1:])
    if argv and argv[0] == "dry-run":
        from ._dryrun import main as dry_run_main  # torch and hp-trainer: only for this one

        return dry_run_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        for flag, value in (
            ("--gpus", args.gpus),
            ("--global-batch", args.global_batch),
            ("--seq", args.seq),
            ("--top", args.top),
        ):
            _check_positive(value, flag)
        if args.mtp_layers is not None and args.mtp_layers < 0:
            raise PlanError(f"--mtp-layers {args.mtp_layers}: must be 0 or more")
        spec = model_spec(args.model, mtp_layers=args.mtp_layers)
        gpu = load_gpu(args.gpu)
        if args.cluster is None and gpu.name.lower() not in shipped_clusters():
            raise ClusterFileError(
                f"--gpu {args.gpu!r} is a custom GPU kind ({gpu.name!r}) with no shipped "
                f"cluster: give --cluster (a cluster TOML; shipped: "
                f"{', '.join(shipped_clusters())})"
            )
        cluster = load_cluster(args.cluster or gpu.name)
        work = Workload(args.global_batch, args.seq)
        print(
            f"hp-plan: {spec.name} ({spec.num_params() / 1e9:.2f} B parameters) on {args.gpus} x "
            f"{gpu.name}, {args.global_batch} sequences x {args.seq} tokens per step\n"
            f"cluster {cluster.describe()}",
            flush=True,
        )
        result = search(
            spec, args.gpus, gpu, cluster, work, top=args.top, simulate=not args.no_simulate
        )
    except PlanError as e:
        print(f"hp-plan: {e}", file=sys.stderr)
        return 2
    sim = (
        f"; the best re-scored with hp-pipeline's simulator ({result.simulated} pipelined)"
        if result.simulated
        else ""
    )
    print(
        f"searched {result.families} families, {result.evaluated} configurations "
        f"({result.feasible} fit) in {result.elapsed:.1f} s{sim}\n"
    )
    print(result.table())
    best = result.best
    print(f"\nbest: {best.plan}")
    print(
        "  time per step: "
        + ", ".join(f"{name} {t:.3f} s" for name, t in best.time.rows() if t > 0)
        + f" = {best.time.total:.3f} s"
        + (" (pipeline simulated)" if best.time.simulated else "")
    )
    mem = best.memory
    print(
        "  memory per GPU: "
        + ", ".join(f"{name} {b / GIB:.1f}" for name, b in mem.rows() if b > 0)
        + f" = {mem.allocated / GIB:.1f} GiB allocated, x {mem.fragmentation:.2f} fragmentation"
        f" + {mem.reserve / GIB:.1f} reserve = {mem.peak / GIB:.1f} of {gpu.memory / GIB:.0f} GiB"
    )
    text = train_config(
        best,
        model=spec.name,
        global_batch=args.global_batch,
        seq_len=args.seq,
        gpu=gpu.name,
        cluster=cluster.name,
        mtp_layers=args.mtp_layers,
        compute_dtype=gpu.compute_dtype,
    )
    path = write_train_config(text, args.out, model=spec.name, gpus=args.gpus, gpu=gpu.name)
    print(f"\nwrote the hp-train config of the best plan: {path}")
    if args.why:
        print(f"\nrejected ({len(result.rejected)}):\n{result.why()}")
    elif result.rejected:
        print(f"{len(result.rejected)} families or degree ranges rejected (--why says why)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
