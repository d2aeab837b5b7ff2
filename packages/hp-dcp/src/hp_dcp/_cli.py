"""``hp-dcp``: inspect, convert, consolidate, reshard and verify checkpoints from the shell."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import _convert

__all__ = ["main"]


def _name_map(path: str | None):
    if path is None:
        return None
    with open(path) as f:
        m = json.load(f)
    if not isinstance(m, dict):
        raise SystemExit(f"--name-map {path}: expected a JSON object of regex -> name (or null)")
    return m


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _build() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hp-dcp",
        description="Inspect, convert, consolidate, reshard and verify distributed checkpoints "
        "(hp_dcp folders, PyTorch DCP folders, HuggingFace safetensors).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="list tensors (shape, dtype, placements) and values")
    p.add_argument("ckpt")
    p = sub.add_parser("convert", help="to HuggingFace safetensors (--to hf) or hp_dcp (--to dcp)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["hf", "dcp"])
    p.add_argument("--name-map", help="JSON file: {regex: new name or null to drop}")
    p.add_argument("--max-shard-size", default="5G", help="hf only, e.g. 2G (default 5G)")
    p.add_argument("--dtype", help="hf only: cast floating tensors, e.g. bfloat16")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE)
    p = sub.add_parser("consolidate", help="every tensor, unsharded, into one .safetensors file")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--name-map")
    p = sub.add_parser("reshard", help="rewrite offline for a target mesh and placements")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. 4 or 2,2")
    p.add_argument("--placements", default="S(0)", help="default placements, e.g. 'S(0)R'")
    p.add_argument(
        "--rule", action="append", default=[], help="PATTERN=PLACEMENTS (fnmatch), repeatable"
    )
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE)
    p = sub.add_parser("verify", help="read every byte and check the checksums")
    p.add_argument("ckpt")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE)
    return ap


_PICKLE = (
    "read the pickled values of an hp-dcp checkpoint written before values were stored as "
    "data (unpickling can run code: only for a checkpoint you trust)"
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hp-dcp`` command. Returns the exit status."""
    args = _build().parse_args(argv)
    if args.cmd == "inspect":
        print(_convert.inspect(args.ckpt))
    elif args.cmd == "convert":
        kw = {}
        if args.to == "hf":
            kw["max_shard_bytes"] = _size(args.max_shard_size)
            if args.dtype:
                kw["dtype"] = getattr(torch, args.dtype)
        if args.to == "dcp":
            kw["allow_pickle"] = args.allow_pickle
        _convert.convert(
            args.src, args.dst, to=args.to, name_map=_name_map(args.name_map), progress=True, **kw
        )
        print(f"wrote {args.dst}")
    elif args.cmd == "consolidate":
        _convert.consolidate(args.ckpt, args.out, name_map=_name_map(args.name_map), progress=True)
        print(f"wrote {args.out}")
    elif args.cmd == "reshard":
        rules = {}
        for r in args.rule:
            pat, sep, pl = r.partition("=")
            if not sep:
                raise SystemExit(f"--rule {r!r}: write PATTERN=PLACEMENTS, e.g. '*.norm.*=R'")
            rules[pat] = pl
        mesh = [int(s) for s in args.mesh.split(",")]
        _convert.reshard(
            args.src,
            args.dst,
            mesh_shape=mesh,
            placements=args.placements,
            rules=rules,
            progress=True,
            allow_pickle=args.allow_pickle,
        )
        print(f"wrote {args.dst}")
    elif args.cmd == "verify":
        problems = _convert.verify(args.ckpt, progress=True, allow_pickle=args.allow_pickle)
        for line in problems:
            print(line)
        print(f"{args.ckpt}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
