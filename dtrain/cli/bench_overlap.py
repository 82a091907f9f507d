"""``dtrain bench overlap``: a matrix product beside a collective on the same device, each slowed by the other
(:mod:`dtrain.bench.overlap`); the factors the simulator prices overlapped communication with."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from dtrain.cli.units import parse_bytes

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("overlap", help="time a matrix product beside a collective and each alone")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    p.add_argument("--collectives", default="all-reduce,reduce-scatter,all-gather",
                   help="comma-separated, from all-reduce, reduce-scatter, all-gather (default: all)")  # fmt: skip
    p.add_argument("--bytes", type=parse_bytes, default=128 << 20,
                   help="each collective's buffer, e.g. 4096, 64K, 1M (default 128M)")  # fmt: skip
    p.add_argument("--hidden", type=int, default=12288, help="the layer's hidden width (default 12288)")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks the layer is split over (default 4)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of a micro-batch (default 2048)")
    p.add_argument("--seconds", type=float, default=0.5, help="length of the shorter loop of each pair")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each pair (the median is kept)")
    p.add_argument("--out", default=None, help="JSON lines, one row per product kind and collective")
    p.add_argument(
        "--write-curves",
        default=None,
        metavar="PATH",
        help="store the median factors by path in PATH (the simulator's: dtrain/sim/compute_curves.json)",
    )
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    from dtrain.cli.paths import check_file_out

    for flag, path in (("--out", args.out), ("--write-curves", args.write_curves)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path}: its directory does not exist")
        if path:
            check_file_out(flag, path)
    if args.write_curves:
        from dtrain.bench.compute import read_curves

        read_curves(args.write_curves, "--write-curves")  # one the run would merge into is a curve file
    from dtrain.bench import overlap  # torch, after the flags are checked

    config = overlap.OverlapConfig(
        nproc=args.nproc, nbytes=args.bytes, hidden=args.hidden, tp=args.tp, tokens=args.tokens,
        seconds=args.seconds, rounds=args.rounds,
        collectives=tuple(c.strip() for c in args.collectives.split(",") if c.strip()),
    )  # fmt: skip
    rows = overlap.run(config)
    if not rows:  # a rank other than 0 under torchrun
        return 0
    print(f"{'product':8} {'collective':15} {'path':8} {'product alone':>14} {'collective':>11} "
          f"{'product x':>10} {'collective x':>13}")  # fmt: skip
    for r in rows:
        print(
            f"{r['product']:8} {r['collective']:15} {r['path']:8} {r['product_tflops']:9.1f} TF/s "
            f"{r['collective_gbps']:6.1f} GB/s {r['product_slowdown']:10.3f} {r['collective_slowdown']:13.3f}"
        )
    if args.out:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.out)), delete=False) as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f.name, args.out)
    if args.write_curves:
        import torch

        from dtrain.bench.compute import device_key, read_curves, write_curves

        key = device_key(rows[0]["device"])
        # the other paths' factors stay
        beside = read_curves(args.write_curves, "--write-curves")["devices"].get(key, {}).get("beside", {})
        paths = ", ".join(sorted({r["path"] for r in rows}))
        note = f"dtrain bench overlap, {rows[0]['world']} ranks, {paths}, torch {torch.__version__}"
        write_curves(args.write_curves, key, {"beside": {**beside, **overlap.factors(rows)}}, note)
    return 0
