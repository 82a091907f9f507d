"""Usage: python benchmarks/training/dp_summary.py DIR   (every dp_vs_ddp-*.jsonl in it)

Summarise ``training/dp_zero.py --sections dp --sizes 4 1`` files: per launch, each variant's ratio to DDP and
its scaling efficiency from one GPU to four (tokens/s per GPU over the one-GPU step of the same launch, run the
same way: a recorded variant against ``single-graph``) and, for recorded variants, against ``single``.
"""

from __future__ import annotations

import glob
import json
import sys


def main() -> None:
    for path in sorted(glob.glob(sys.argv[1] + "/dp_vs_ddp-*.jsonl")):
        with open(path) as f:
            rows = [r for r in map(json.loads, f) if r.get("section") == "dp"]  # dp_zero.py's records only
        if not any(r["ranks"] == 1 for r in rows):
            continue
        cells = []
        for r in rows:
            if r["ranks"] == 1:
                continue
            cell = f"{r['variant']} {r['ratio_vs_ddp'] or 0:.3f}x {r.get('scaling_efficiency') or 0:.3f}"
            if "scaling_vs_eager_single" in r:
                cell += f" ({r['scaling_vs_eager_single']:.3f} vs single)"
            cells.append(cell)
        print(path.rsplit("/", 1)[-1], " ".join(cells))


if __name__ == "__main__":
    main()
