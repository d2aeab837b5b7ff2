"""hp_dcp against torch.distributed.checkpoint on the same sharded state dict, in one launch:
save GB/s, load GB/s (into the same sharding) and the time training is blocked by async_save.
Ratios > 1 mean hp_dcp is better (faster, or blocked for less time). Target >= 1.0x on each.

    python benchmarks/dcp/save_load.py                 # ~2 GB, 2 then 4 gloo ranks
    python benchmarks/dcp/save_load.py --gb 0.2 --worlds 2 --repeats 2   # quick
    torchrun --nproc_per_node=2 benchmarks/dcp/save_load.py --device cuda   # GPU tensors

Every save fsyncs its files (both libraries' default), so save figures include this machine's
disk, whose flush times vary several-fold from one call to the next: the first round is a
warm-up, the figures are medians of ``--repeats`` rounds, and the caches are synced before
each timed call. Loads read what the page cache holds, as a resume right after a save would.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import finish, init_rank, launch  # noqa: E402


def _state(world, rank, args):
    """``count`` fp32 matrices of (rows, 1024) sharded by rows, plus a few small values: the same
    local tensors wrapped as hp and as torch DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TDTensor
    from torch.distributed.tensor import Shard as TShard

    import hp_dtensor as hp

    cols = 1024
    count = 16
    rows = int(args.gb * 2**30 / (count * cols * 4))
    rows -= rows % world
    g = torch.Generator().manual_seed(rank)
    dev = args.device
    locals_ = [torch.randn(rows // world, cols, generator=g).to(dev) for _ in range(count)]
    hmesh = hp.init_device_mesh(dev, (world,))
    tmesh = init_device_mesh(dev, (world,))
    ours = {
        f"layers.{i}.w": hp.DTensor.from_local(t, hmesh, [hp.Shard(0)])
        for i, t in enumerate(locals_)
    }
    theirs = {
        f"layers.{i}.w": TDTensor.from_local(t, tmesh, [TShard(0)]) for i, t in enumerate(locals_)
    }
    small = {"norm": torch.ones(cols, device=dev), "step": torch.tensor(7.0)}
    ours.update(small)
    theirs.update(small)
    nbytes = count * rows * cols * 4 + cols * 4 + 4
    return ours, theirs, nbytes


def _timed(fn):
    os.sync()  # start from a clean disk: no earlier write-back lands in this figure
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _verify(ours, root) -> bool:
    """Save, zero the tensors, load: every value must come back (a load that silently did
    nothing would make the timed loads meaningless)."""
    import hp_dcp
    import hp_dtensor as hp

    def local(v):
        return v.to_local() if isinstance(v, hp.DTensor) else v

    p = os.path.join(root, "verify")
    hp_dcp.save(ours, checkpoint_id=p)
    keep = {k: local(v).clone() for k, v in ours.items()}
    for v in ours.values():
        local(v).zero_()
    hp_dcp.load(ours, checkpoint_id=p)
    ok = all(torch.equal(local(v), keep[k]) for k, v in ours.items())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(p, ignore_errors=True)
    return ok


def _run(rank, world, args, path, queue):
    import torch.distributed.checkpoint as tdcp

    import hp_dcp

    init_rank(rank, world, path, threads=1)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    ours, theirs, nbytes = _state(world, rank, args)
    root = args.dir
    keys = (
        "save_hp",
        "save_pt",
        "cache_hp",
        "cache_pt",
        "load_hp",
        "load_pt",
        "async_hp",
        "async_pt",
    )
    res = {k: [] for k in keys}

    def clean(p):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    for rep in range(args.repeats + 1):  # round 0 warms up (its figures are dropped below)
        a, b = os.path.join(root, f"hp{rep}"), os.path.join(root, f"pt{rep}")
        order = [("hp", a), ("pt", b)] if rep % 2 == 0 else [("pt", b), ("hp", a)]
        for who, p in order:  # alternate who goes first: the page cache favours neither
            if who == "hp":
                res["save_hp"].append(_timed(lambda p=p: hp_dcp.save(ours, checkpoint_id=p))[0])
            else:
                res["save_pt"].append(_timed(lambda p=p: tdcp.save(theirs, checkpoint_id=p))[0])
        for who, p in order:  # the software path alone: no fsync, into the page cache
            q = p + "_nosync"
            if who == "hp":
                w = hp_dcp.FileSystemWriter(q, sync_files=False)
                res["cache_hp"].append(
                    _timed(lambda q=q, w=w: hp_dcp.save(ours, checkpoint_id=q, storage_writer=w))[0]
                )
            else:
                w = tdcp.FileSystemWriter(q, sync_files=False)
                res["cache_pt"].append(_timed(lambda w=w: tdcp.save(theirs, storage_writer=w))[0])
            clean(q)
        for who, p in order:
            if who == "hp":
                res["load_hp"].append(_timed(lambda p=p: hp_dcp.load(ours, checkpoint_id=p))[0])
            else:
                res["load_pt"].append(_timed(lambda p=p: tdcp.load(theirs, checkpoint_id=p))[0])
        clean(a)
        clean(b)
    # async: the time save() blocks the caller; the write is awaited before the next call
    for rep in range(args.repeats + 1):
        for who in ("hp", "pt"):
            p = os.path.join(root, f"async_{who}{rep}")
            os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            if who == "hp":
                fut = hp_dcp.async_save(ours, checkpoint_id=p)
            else:
                fut = tdcp.async_save(theirs, checkpoint_id=p)
            blocked = time.perf_counter() - t0
            fut.result()
            if rep:  # the first call of each allocates its staging buffers
                res[f"async_{who}"].append(blocked)
            clean(p)
    if os.environ.get("HP_BENCH_RAW"):
        print(rank, {k: [round(x, 2) for x in v] for k, v in res.items()}, flush=True)
    verified = _verify(ours, root)
    med = {k: statistics.median(v if k.startswith("async") else v[1:]) for k, v in res.items()}
    med["nbytes"] = nbytes
    med["verified"] = verified
    finish(rank, world, args, med, queue, _report)


def _report(args, world, results):
    # a collective op takes as long as its slowest rank: report the slowest rank's medians
    keys = [k for k in results[0] if k not in ("nbytes", "verified")]
    med = {k: max(r[k] for r in results.values()) for k in keys}
    gb = results[0]["nbytes"] / 1e9
    print(
        f"\nhp_dcp vs torch.distributed.checkpoint: {gb:.2f} GB, {world} "
        f"{'gloo ranks (CPU tensors)' if args.device == 'cpu' else 'ranks (CUDA tensors)'}, "
        f"median of {args.repeats}, torch {torch.__version__}"
    )
    print(f"{'figure':<22}{'hp_dcp':>12}{'torch DCP':>12}{'ratio':>8}")
    for what, label in (
        ("save", "save GB/s"),
        ("cache", "save no-fsync GB/s"),
        ("load", "load GB/s"),
    ):
        hp_, pt = gb / med[f"{what}_hp"], gb / med[f"{what}_pt"]
        print(f"{label:<22}{hp_:>12.2f}{pt:>12.2f}{hp_ / pt:>8.2f}")
    hp_, pt = med["async_hp"], med["async_pt"]
    print(f"{'async blocked s':<22}{hp_:>12.3f}{pt:>12.3f}{pt / hp_:>8.2f}")
    ok = all(r.get("verified", True) for r in results.values())
    print("hp_dcp save -> zero -> load round trip:", "values equal" if ok else "MISMATCH")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gb", type=float, default=2.0, help="state dict size in GiB")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=None, help="folder to write into (default: a temp folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        if "RANK" in os.environ:  # torchrun: one folder for every rank of this host
            args.dir = os.environ.get("HP_DCP_BENCH_DIR", "/tmp/hp_dcp_bench")
            os.makedirs(args.dir, exist_ok=True)
            if args.device == "cuda":  # torch's async_save needs a CPU backend beside NCCL
                args.backend = "cpu:gloo,cuda:nccl"
            launch(_run, _report, args)
            return 0
        for world in (int(w) for w in args.worlds.split(",")):
            launch(_run, _report, args, world=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
