"""``dtrain bench compute``: time this device's matrix products, attention and memory-bound operations
(:mod:`dtrain.bench.compute`) and write the efficiency curves the simulator loads."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compute", help="time matmuls, attention and memory-bound ops; write the simulator's curves")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds on a CPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each operation (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--kinds", default=",".join(("matmul", "matmul-fp8", "attention", "attention-full", "memory")),
                   help="comma-separated kinds to time: matmul, matmul-fp8 (where the device has FP8), attention "
                        "(causal), attention-full (no mask), memory (default: all)")  # fmt: skip
    p.add_argument("--timing", default="device", choices=("device", "launch"),
                   help="a GPU call's time: the device's pace, issued behind a sleep kernel (default), or with the "
                        "host's launch counted, events around a call the GPU waits for")  # fmt: skip
    p.add_argument("--attention-backend", default="default",
                   choices=("default", "flash", "cudnn", "efficient", "math"),
                   help="attention's kernels: torch's choice (default), or forced: flash (FlashAttention-2), cudnn, "
                        "efficient, math; each row names the one that ran")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON lines, one row per operation and shape")
    p.add_argument("--write-curves", default=None, metavar="PATH",
                   help="merge this device's efficiency curves into PATH (the simulator's: "
                        "dtrain/sim/compute_curves.json)")  # fmt: skip
    p.set_defaults(handler=run)
    return p


def _check_device(name: str | None) -> None:
    """``--device``: the CPU or a CUDA device this machine has (ValueError naming the flag if not)."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name}: not a torch device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: bench compute times the CPU or CUDA devices; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def run(args: argparse.Namespace) -> int:
    from dtrain.bench import compute
    from dtrain.cli.paths import check_file_out

    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    for flag, path in (("--out", args.out), ("--write-curves", args.write_curves)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path}: its directory does not exist")
        if path:
            check_file_out(flag, path)
    if args.write_curves:
        compute.read_curves(args.write_curves, "--write-curves")  # one the run would merge into is a curve file
    _check_device(args.device)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    rows = compute.run(device_name=args.device, quick=args.quick, repeats=args.repeats, warmup=args.warmup,
                       kinds=kinds, timing=args.timing, attention_backend=args.attention_backend)  # fmt: skip
    if not rows:
        raise ValueError(f"--kinds {args.kinds}: this device runs none of them (FP8 needs compute capability 8.9)")
    for kind in compute.KINDS:
        if not any(r["kind"] == kind for r in rows):
            continue
        best = max((r for r in rows if r["kind"] == kind), key=lambda r: r["efficiency"])
        print(f"{kind:10} best {best['op']:14} efficiency {best['efficiency']:.2f}")
    if args.out:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.out)), delete=False) as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f.name, args.out)
    if args.write_curves:
        import torch

        note = f"dtrain bench compute{' --quick' if args.quick else ''}, torch {torch.__version__}"
        compute.write_curves(args.write_curves, rows[0]["device"], compute.curves_from_rows(rows), note)
    return 0
