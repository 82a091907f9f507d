"""Usage: (a module: imported by benchmarks/training/piece_products.py and ring_attention.py)

The command line those one-GPU benchmarks share: ``--out`` and ``--repeats``, a check for a CUDA GPU, the report
printed, and the rows written as JSON lines, atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def main(script: str, doc: str, run: Callable[[int], list[dict]], report: Callable[[list[dict]], str], *,
         repeats: int, counted: str) -> None:  # fmt: skip
    """Parse the command line of ``script`` (its docstring ``doc``), run ``run(repeats)`` on the GPU, print
    ``report`` of its rows and write them to ``--out``; ``counted`` names what ``--repeats`` counts."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON lines, one a row (written atomically)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed calls {counted} (default {repeats})")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"{script}: --repeats must be at least 1, got {args.repeats}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU")
    rows = run(args.repeats)
    print(report(rows))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f.name, path)
