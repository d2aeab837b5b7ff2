"""Where a second gradient-accumulation micro-step's time goes (issue 29): hp-trainer's step of
one configuration with 1 and with 2 micro-steps under torch.profiler, the CUDA kernels' and the
host's time by op, and the ops whose time grows most. A diagnostic for the step-time model.

    python benchmarks/autoparallel/profile_microsteps.py --model llama3.2-1b --recompute full
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile

import torch


def run(model: str, recompute: str, batch: int, seq: int, micro: int, steps: int):
    from torch.profiler import ProfilerActivity, profile

    from hp_trainer import LLMTrainer, load_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"--model.name={model}",
                f"--training.seq_len={seq}",
                f"--training.global_batch_size={batch}",
                f"--training.local_batch_size={batch // micro}",
                f"--training.steps={steps + 3}",
                "--training.mixed_precision_param=bfloat16",
                f"--activation_checkpoint.mode={recompute}",
                "--checkpoint.enable=false",
                "--metrics.tensorboard=false",
                "--metrics.plot=false",
                f"--job.dump_folder={tmp}",
            ],
        )
        tr = LLMTrainer(cfg)
        for _ in range(2):
            tr.train_step()
        times = [tr.train_step()["step_time_s"] for _ in range(steps)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tr.train_step()
        torch.cuda.synchronize()
    dev, host = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        dev[e.key] += e.device_time_total / 1e3
        host[e.key] += e.self_cpu_time_total / 1e3
    return statistics.median(times) * 1e3, dev, host


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--recompute", default="full")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernels' times are the question)")
    res = {m: run(args.model, args.recompute, args.batch, args.seq, m, args.steps) for m in (1, 2)}
    for m, (ms, dev, host) in res.items():
        print(
            f"micro-steps {m}: {ms:.1f} ms/step; kernels {sum(dev.values()):.1f} ms, host "
            f"{sum(host.values()):.1f} ms (profiled step)"
        )
    d1, d2 = res[1][1], res[2][1]
    h1, h2 = res[1][2], res[2][2]
    print("\nkernel time growing most (ms, 1 -> 2 micro-steps)")
    for k in sorted(set(d1) | set(d2), key=lambda k: d1[k] - d2[k])[:15]:
        print(f"  {d2[k] - d1[k]:+8.2f}  {d1[k]:8.2f} -> {d2[k]:8.2f}  {k[:90]}")
    print("\nhost self time growing most (ms)")
    for k in sorted(set(h1) | set(h2), key=lambda k: h1[k] - h2[k])[:15]:
        print(f"  {h2[k] - h1[k]:+8.2f}  {h1[k]:8.2f} -> {h2[k]:8.2f}  {k[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
