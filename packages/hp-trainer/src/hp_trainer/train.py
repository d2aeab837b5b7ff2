"""``hp-train``: check the config, then launch ``python -m hp_trainer.train`` on ``--nproc``
ranks through torchrun (``torch.distributed.run``); each rank runs :func:`run`."""

from __future__ import annotations

import argparse
import gc
import math
import os
import subprocess
import sys

from ._trainer import preflight
from .config import load_config
from .errors import ConfigError

__all__ = ["main", "run"]


def _parse(argv):
    ap = argparse.ArgumentParser(
        prog="hp-train",
        description="Train with HyperParallel. Overrides: --section.key value, "
        "e.g. --training.steps 50",
    )
    ap.add_argument("--config", help="TOML job config")
    ap.add_argument(
        "--nproc", type=int, default=0, help="ranks on this host (default: the config's degrees)"
    )
    return ap.parse_known_args(argv)


def _world_from(cfg) -> int:
    p = cfg.parallelism
    degrees = [
        p.data_parallel_replicate_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
    ]
    shard = p.data_parallel_shard_degree
    return math.prod(degrees) * (shard if shard > 0 else 1)


def run(argv: list[str] | None = None) -> list[float]:
    """One rank's job (what torchrun starts): train and report where the outputs went."""
    from ._trainer import LLMTrainer
    from .callbacks import LoggingCallback, MoeMonitorCallback

    args, overrides = _parse(argv)
    cfg = load_config(args.config, overrides)
    m = cfg.metrics
    log = LoggingCallback(log_freq=m.log_freq, tensorboard=m.tensorboard, plot=m.plot)
    callbacks = [log]
    monitor = None
    trainer = LLMTrainer(cfg, callbacks=callbacks)
    if trainer.model_config.moe is not None:
        monitor = MoeMonitorCallback(log_freq=m.log_freq, tensorboard=m.tensorboard, plot=m.plot)
        trainer.callbacks.append(monitor)
    losses = trainer.train()
    if trainer.rank == 0:
        paths = {**log.paths, **(monitor.paths if monitor is not None else {})}
        for what, path in sorted(paths.items()):
            print(f"{what}: {path}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # drop the trainer (its meshes hold process groups, in reference cycles) now, not in the
    # interpreter's final teardown: a gloo group destroyed there aborted a process now and then
    # (as hp_kernels' workspaces once did)
    del trainer, log, monitor, callbacks
    gc.collect()
    return losses


def main(argv: list[str] | None = None) -> int:
    """The ``hp-train`` command: check everything, then hand over to torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = _parse(argv)
    try:
        cfg = load_config(args.config, overrides)
        nproc = args.nproc or _world_from(cfg)
        preflight(cfg, nproc)
    except ConfigError as e:
        print(f"hp-train: {e}", file=sys.stderr)
        return 2
    forward, skip = [], False  # the ranks get everything but --nproc
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            forward.append(a)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "hp_trainer.train",
        *forward,
    ]
    return _run_forwarding_signals(cmd)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _run_forwarding_signals(cmd: list[str]) -> int:
    """Run torchrun; a SIGTERM to ``hp-train`` (a scheduler's preemption) goes to the ranks
    themselves: they finish the step, checkpoint and exit 0, and torchrun then ends as it does
    when its workers succeed. Where its children cannot be listed, torchrun gets it (it then
    gives the ranks 30 s and exits non-zero). A terminal's Ctrl-C reaches every process
    already."""
    import signal

    proc = subprocess.Popen(cmd)

    def forward(signum, frame):
        workers = _children(proc.pid)
        for pid in workers or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    if "RANK" in os.environ:
        run()
    else:
        sys.exit(main())
