"""``hp-plan calibrate --cluster-out``: measure on the ranks themselves, all at once.

A step on N ranks of one host is not N copies of a step on one: the ranks share the host (on
the 2-core development VM four CPU ranks get half a core each, and a one-process matmul rate
is twice what each of them sees), and each collective costs what the backend takes between
those processes (gloo between processes that share cores waits for the scheduler: milliseconds
per message, where its bandwidth says microseconds). Neither can be read off a one-process
measurement, so this module launches the N ranks (``torch.multiprocessing``, spawned, a
``FileStore`` rendezvous in a temporary folder: no port to pick) and on every rank at once:

- runs the rate measurements of ``_calibrate`` (matmul, attention, grouped GEMM, memory and
  element-wise bandwidth, optimizer, and on the CPU the host time per aten op), each after a
  barrier, with samples of at least 200 ms: each field is the median over the ranks of what
  each measured while the others did the same;
- times each collective the planner prices (all-gather, reduce-scatter, all-reduce,
  all-to-all over the N ranks, and a send / receive between neighbours) at a small and a
  large size, each rank's median after a barrier, the slowest rank's; and fits NOTE
  [Collectives]' alpha-beta line through the two points (latency per log2 step, bus
  bandwidth);
- measures how much of a large all-gather hides behind matmuls issued while it runs: (compute
  alone + gather alone - both together) / the shorter of the two, clipped to [0, 1], the median
  over ranks (``cluster.overlap``).

The cluster file it writes (``render_cluster``) has these for the intra-node link; its
inter-node link is copied from the shipped cluster of the same kind (one host measures no
inter-node link) and says so. Results come back from the ranks as JSON files: nothing is
unpickled.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import _calibrate as C
from ._calibrate import _fmt, _size, _wrap
from ._hardware import load_cluster
from .errors import CalibrationError

__all__ = ["RankMeasurements", "measure_ranks", "render_cluster"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")
# (small, large) message sizes in bytes: the whole tensor NOTE [Collectives] prices (the
# gathered output, the reduce-scatter / all-reduce input, what a rank sends)
_MESSAGE = {
    ("cpu", False): (4 << 10, 4 << 20),
    ("cpu", True): (1 << 10, 64 << 10),
    ("cuda", False): (64 << 10, 256 << 20),
    ("cuda", True): (64 << 10, 16 << 20),
}
_REPEATS = {False: (3, 15), True: (1, 4)}  # (warm-up, timed) calls of each collective
_TIMEOUT = datetime.timedelta(minutes=5)  # a rank that stops answering fails the others
_MIN_SAMPLE_S = 0.2  # the shortest timed sample of a rate on the ranks (``_median_time``)


@dataclass
class RankMeasurements:
    """What the ranks measured together: the calibration's rate fields (``(section, key) ->
    (value, how)``), each collective's fitted ``(latency s, bus bandwidth B/s, how)``, the
    overlap fraction and how it was measured, the number of ranks and the backend."""

    rates: dict
    collectives: dict
    overlap: float
    overlap_how: str
    ranks: int
    backend: str


def _timed(fn, device, barrier, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()``, each call after a barrier (``_calibrate._median_time``)."""
    return C._median_time(fn, device, warmup=warmup, repeats=repeats, before=barrier)


def _collective_fns(kind: str, nbytes: int, world: int, rank: int, device):
    """A no-argument call running ``kind`` of ``nbytes`` (NOTE [Collectives]'s M) over the
    world, or between neighbour pairs for ``p2p`` (the odd rank out of an odd world idles)."""
    import torch
    import torch.distributed as dist

    n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the world
    if kind == "all_gather":
        inp, out = torch.ones(n // world, device=device), torch.empty(n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind == "reduce_scatter":
        inp, out = torch.ones(n, device=device), torch.empty(n // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if kind == "all_reduce":
        buf = torch.ones(n, device=device)
        return lambda: dist.all_reduce(buf)
    if kind == "all_to_all":
        inp, out = torch.ones(n, device=device), torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    peer = rank ^ 1
    if peer >= world:  # the odd rank out of an odd world waits at the barriers
        return lambda: None
    send, recv = torch.ones(n, device=device), torch.empty(n, device=device)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return exchange


def _fit(kind: str, world: int, sizes, times) -> tuple[float, float]:
    """NOTE [Collectives]' (alpha, bus bandwidth) through two (bytes, seconds) points."""
    (m1, m2), (t1, t2) = sizes, times
    if kind == "p2p":
        frac, per, steps = 1.0, 1.0, 1
    else:
        frac = (world - 1) / world
        per = 2.0 if kind == "all_reduce" else 1.0
        steps = max(1, math.ceil(math.log2(world)))
    dt = max(t2 - t1, 0.05 * t2)  # a large message never faster than a small one
    bw = per * frac * (m2 - m1) / dt
    alpha = max(0.0, t1 - per * frac * m1 / bw) / (per * steps)
    return alpha, bw


def _overlap(world, device, barrier, nbytes, warmup, repeats) -> tuple[float, str]:
    import torch
    import torch.distributed as dist

    n = max(world, nbytes // 4 // world * world)
    inp, out = torch.ones(n // world, device=device), torch.empty(n, device=device)
    size = 256 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device)
    one = _timed(lambda: a @ a, device, barrier, warmup, repeats)
    gather = _timed(lambda: dist.all_gather_into_tensor(out, inp), device, barrier, warmup, repeats)
    count = max(1, round(gather / max(one, 1e-9)))

    def compute():
        for _ in range(count):
            a @ a

    def both():
        w = dist.all_gather_into_tensor(out, inp, async_op=True)
        compute()
        w.wait()

    t_c = _timed(compute, device, barrier, warmup, repeats)
    t_b = _timed(both, device, barrier, warmup, repeats)
    frac = (t_c + gather - t_b) / max(min(t_c, gather), 1e-9)
    how = (
        f"{count} matmuls of {size}^2 ({1e3 * t_c:.2f} ms) beside an all-gather of "
        f"{_size(nbytes)} ({1e3 * gather:.2f} ms): {1e3 * t_b:.2f} ms together"
    )
    return min(1.0, max(0.0, frac)), how


def _rank_main(rank: int, world: int, folder: str, device_type: str, quick: bool) -> None:
    """One rank: its process group, then every measurement (module docstring) into a JSON file."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend, dtype = "nccl", torch.bfloat16
    else:
        torch.set_num_threads(1)  # one thread per CPU rank, as the shipped cpu file
        device = torch.device("cpu")
        backend, dtype = "gloo", torch.float32
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_TIMEOUT)
    try:

        def barrier():
            if device_type == "cuda":
                dist.barrier(device_ids=[rank])
            else:
                dist.barrier()

        cal = C.Calibration(name="", compute_dtype=str(dtype).replace("torch.", ""), device="")
        # samples of 200 ms at least: over many time slices where ranks share cores, as a step's
        s = dataclasses.replace(C._SIZES[(device_type, quick)], min_sample_s=_MIN_SAMPLE_S)
        for _, measure in C.rate_steps(cal, s, device, dtype):
            barrier()  # every rank measures the same thing at the same time
            measure()
        warmup, repeats = _REPEATS[quick]
        sizes = _MESSAGE[(device_type, quick)]
        colls = {}
        for kind in _KINDS:
            times = []
            for nbytes in sizes:
                fn = _collective_fns(kind, nbytes, world, rank, device)
                times.append(_timed(fn, device, barrier, warmup, repeats))
            colls[kind] = times
        overlap, how = _overlap(world, device, barrier, sizes[1], warmup, repeats)
        result = {
            "rates": {f"{k[0]}.{k[1]}": [m.value, m.how] for k, m in cal.fields.items()},
            "collectives": colls,
            "overlap": [overlap, how],
        }
        path = Path(folder) / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result))
        path.with_suffix(".tmp").replace(path)
        barrier()
    finally:
        dist.destroy_process_group()


def measure_ranks(ranks: int, *, device: str, quick: bool = False) -> RankMeasurements:
    """Launch ``ranks`` processes of ``device`` (``"cpu"``: gloo; ``"cuda"``: NCCL, one GPU
    each) and measure on all of them at once (module docstring)."""
    import torch
    import torch.multiprocessing as mp

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise CalibrationError(
            f"calibrate: ranks={ranks!r}: measuring a cluster (--cluster-out) needs --ranks >= 2 "
            "(the ranks of one host that run together)"
        )
    if device == "cuda" and torch.cuda.device_count() < ranks:
        count = torch.cuda.device_count()
        fix = f"use --ranks {count} or --device cpu" if count >= 2 else "use --device cpu"
        raise CalibrationError(
            f"calibrate: --ranks {ranks} with --cluster-out on CUDA needs {ranks} GPUs; torch "
            f"sees {count}: {fix}"
        )
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.start_processes(
                _rank_main,
                args=(ranks, folder, device, quick),
                nprocs=ranks,
                join=True,
                start_method="spawn",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # or killed
            raise CalibrationError(
                f"calibrate: a rank failed while measuring ({e}); run again with fewer --ranks "
                "or --quick to see whether the machine can hold them"
            ) from None
        results = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(ranks)]
    rates = {}
    for key, (_, how) in results[0]["rates"].items():
        values = [r["rates"][key][0] for r in results]
        rates[tuple(key.split("."))] = (
            statistics.median(values),
            f"{how}; the median over {ranks} ranks measuring at once (rank by rank: "
            + ", ".join(f"{v:.4g}" for v in values)
            + ")",
        )
    sizes = _MESSAGE[(device, quick)]
    colls = {}
    for kind in _KINDS:
        times = [max(r["collectives"][kind][i] for r in results) for i in range(2)]
        alpha, bw = _fit(kind, ranks, sizes, times)
        what = "a send and a receive between neighbours" if kind == "p2p" else f"{ranks} ranks"
        colls[kind] = (
            alpha,
            bw,
            f"measured: {kind} ({what}) of {_size(sizes[0])} in {1e6 * times[0]:.0f} us and "
            f"{_size(sizes[1])} in {1e6 * times[1]:.0f} us (the slowest rank's median)",
        )
    overlaps = [r["overlap"][0] for r in results]
    overlap = statistics.median(overlaps)
    how = (
        f"measured: {results[0]['overlap'][1]} on rank 0; the fraction hidden, median over "
        f"{ranks} ranks (" + ", ".join(f"{v:.2f}" for v in overlaps) + ")"
    )
    backend = "nccl" if device == "cuda" else "gloo"
    return RankMeasurements(rates, colls, overlap, how, ranks, backend)


def render_cluster(
    m: RankMeasurements, *, kind: str, device_name: str, gpus_per_node: int | None = None
) -> str:
    """The cluster file's text (the format of ``data/clusters/*.toml``), each field with how
    it was obtained; the inter-node link copied from the shipped cluster of ``kind``.
    ``gpus_per_node`` is the host's (default: the ranks measured)."""
    base_kind = "h200" if m.backend == "nccl" else "cpu"
    base = load_cluster(kind if kind in ("h200", "cpu") else base_kind)
    lines = _wrap(
        f"{device_name}: {m.ranks} {m.backend} ranks of one host, written by `hp-plan calibrate "
        f"--cluster-out` on {time.strftime('%Y-%m-%d %H:%M')}. Each collective timed on all ranks "
        "at once at two sizes, the line latency x ceil(log2 n) + bus bytes / bandwidth through "
        "them (NOTE [Collectives] in hp_autoparallel._hardware)."
    )
    lines += [
        "",
        "[cluster]",
        f'name = "{kind}-{m.ranks}-measured"',
        f"gpus_per_node = {gpus_per_node or m.ranks}",
    ]
    lines.append(f'backend = "{m.backend}"')
    lines += _wrap(m.overlap_how)
    lines.append(f"overlap = {_fmt(m.overlap)}")
    lines += ["", "[intra_node]"]
    ag_alpha, ag_bw, _ = m.collectives["all_gather"]
    lines += _wrap("the all-gather's (below): the default of any collective without its own")
    lines.append(f"latency_us = {_fmt(ag_alpha * 1e6)}")
    lines.append(f"bandwidth_gbps = {_fmt(ag_bw / 1e9)}")
    for kind_ in _KINDS:
        alpha, bw, how = m.collectives[kind_]
        lines += _wrap(how)
        lines.append(f"{kind_}_latency_us = {_fmt(alpha * 1e6)}")
        lines.append(f"{kind_}_gbps = {_fmt(bw / 1e9)}")
    inter = base.inter
    lines += ["", "[inter_node]"]
    lines += _wrap(f"not measured (one host): copied from the shipped {base.name!r} cluster")
    lines.append(f"latency_us = {_fmt(inter.latency * 1e6)}")
    lines.append(f"bandwidth_gbps = {_fmt(inter.bw('all_gather') / 1e9)}")
    lines.append("")
    return "\n".join(lines)
