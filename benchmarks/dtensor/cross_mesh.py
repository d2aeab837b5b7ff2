"""Cross-mesh transfer on CPU ranks: a state dict moved from FSDP 2 on ranks 0-1 (every tensor
Shard(0)) to TP 2 on ranks 2-3 (Shard(1) here: a relayout, not a copy), three ways in one
launch, interleaved:

- ours: ``hp_dtensor.transfer_state_dict`` (point-to-point sends of exactly the overlapping
  boxes, all tensors in one batch);
- naive: every source piece gathered on rank 0, which sends each destination rank its box;
- dcp: ``hp_dcp.save`` on the source ranks, then ``hp_dcp.load`` on the destination ranks (the
  checkpoint round trip a live reshard avoids), into a temporary folder.

Two payloads: a TinyLlama-shaped state dict (``--vocab``, ``--dim``, ``--layers``) and one
256 MiB tensor (``--mib``). Prints GB/s (payload bytes / seconds, median of ``--repeats``) and
the ratios ours / naive and ours / dcp.

    python benchmarks/dtensor/cross_mesh.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402


def _payloads(args):
    from hp_testing.models import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(
        vocab=args.vocab,
        dim=args.dim,
        layers=args.layers,
        heads=8,
        kv_heads=4,
        hidden=args.dim * 8 // 3 // 8 * 8,
    )
    llama = {k: v.detach() for k, v in model.state_dict().items() if v.dim() == 2}
    big = {"t": torch.randn(args.mib * 2**20 // 4 // 1024, 1024)}
    return {"tinyllama": llama, f"{args.mib}MiB": big}


def _measure(args, me, name, full, tmp, src_mesh, dst_mesh):
    """Median seconds of each route for one payload (and its size in bytes)."""
    import hp_dcp
    import hp_dtensor as hp
    from hp_dtensor import DTensor, Shard

    src_group, dst_group = src_mesh.get_group(), dst_mesh.get_group()
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    src = (
        {k: hp.distribute_tensor(v, src_mesh, [Shard(0)]) for k, v in full.items()}
        if me in (0, 1)
        else None
    )
    layouts = {k: [Shard(1)] for k in full} if me in (2, 3) else None

    def ours():
        return hp.transfer_state_dict(src, layouts, src_mesh=src_mesh, dst_mesh=dst_mesh)

    def naive():
        out = {}
        for k, v in full.items():
            pieces = v.chunk(2, dim=0)  # the source layout: Shard(0) on [0, 1]
            if me == 1:
                dist.send(src[k].to_local().contiguous(), 0)
            if me == 0:
                whole = torch.empty_like(v)
                whole[: pieces[0].shape[0]].copy_(src[k].to_local())
                buf = torch.empty_like(pieces[1])
                dist.recv(buf, 1)
                whole[pieces[0].shape[0] :].copy_(buf)
                for i, d in enumerate((2, 3)):
                    dist.send(whole.chunk(2, dim=1)[i].contiguous(), d)
            if me in (2, 3):
                buf = torch.empty_like(v.chunk(2, dim=1)[me - 2]).contiguous()
                dist.recv(buf, 0)
                out[k] = DTensor.from_local(buf, dst_mesh, [Shard(1)], shape=v.shape)
        return out

    def dcp():
        ckpt = os.path.join(tmp, f"{name}")
        if me in (0, 1):
            hp_dcp.save(src, checkpoint_id=ckpt, process_group=src_group)
        dist.barrier()
        if me in (2, 3):
            target = {
                k: DTensor.from_local(
                    torch.empty_like(v.chunk(2, dim=1)[me - 2]),
                    dst_mesh,
                    [Shard(1)],
                    shape=v.shape,
                )
                for k, v in full.items()
            }
            hp_dcp.load(target, checkpoint_id=ckpt, process_group=dst_group)
        dist.barrier()
        if me == 0:
            shutil.rmtree(ckpt, ignore_errors=True)

    routes = {"ours": ours, "naive": naive, "dcp": dcp}
    if me in (2, 3):  # the three give the same destination pieces
        got = ours()
    else:
        ours()
    ref = naive()
    if me in (2, 3):
        for k in full:
            torch.testing.assert_close(got[k].to_local(), ref[k].to_local())
    times = {k: [] for k in routes}
    for _ in range(args.repeats):
        for k, fn in routes.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return nbytes, {k: statistics.median(v) for k, v in times.items()}


def _run(rank, world, args, path, queue):
    warnings.simplefilter("ignore")
    init_rank(rank, world, path, args.threads)
    import hp_dtensor as hp

    src_mesh, dst_mesh = hp.DeviceMesh("cpu", [0, 1]), hp.DeviceMesh("cpu", [2, 3])
    me = rank
    results = {}
    # one folder for the launch (the spawned ranks share their parent)
    tmp = os.path.join(tempfile.gettempdir(), f"hp_cross_mesh_{os.getppid()}")
    if me == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    for name, full in _payloads(args).items():
        results[name] = _measure(args, me, name, full, tmp, src_mesh, dst_mesh)
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    finish(rank, world, args, results, queue, _report)


def _report(args, world, results):
    print(
        f"cross-mesh transfer, FSDP 2 on ranks 0-1 (Shard(0)) -> TP 2 on ranks 2-3 (Shard(1)), "
        f"{world} gloo ranks, torch {torch.__version__}; median of {args.repeats}, barriers "
        "around each"
    )
    print(
        f"{'payload':12s} {'MiB':>7s} {'ours GB/s':>10s} {'naive GB/s':>11s} "
        f"{'dcp GB/s':>9s} {'ours/naive':>11s} {'ours/dcp':>9s}"
    )
    for name, (nbytes, t) in results[0].items():
        gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
        print(
            f"{name:12s} {nbytes / 2**20:7.1f} {gbs['ours']:10.2f} {gbs['naive']:11.2f} "
            f"{gbs['dcp']:9.2f} {t['naive'] / t['ours']:11.2f} {t['dcp'] / t['ours']:9.2f}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu"])
    args = ap.parse_args(argv)
    return launch(_run, _report, args, world=4)


if __name__ == "__main__":
    sys.exit(main())
