"""Usage: python benchmarks/collectives/summarize.py FILE.jsonl [--collective C] [--algorithms A,B] [--model]

Markdown tables from ``dtrain bench comm`` JSON lines.

    python benchmarks/collectives/summarize.py runs/gpu/gpu-all_reduce.jsonl --algorithms native,ring,direct,auto
    python benchmarks/collectives/summarize.py runs/gpu/gpu-all_reduce.jsonl --model

The first prints busbw per size and algorithm with each one's ratio to ``native`` measured in the same run;
the second, the cost model's error per algorithm: median and worst of ``|predicted / measured - 1|``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def busbw_table(rows: list[dict], collective: str, algorithms: list[str]) -> str:
    rows = [r for r in rows if r["collective"] == collective]
    head = "| size | " + " | ".join(algorithms) + " |"
    lines = [head, "|" + " --- |" * (len(algorithms) + 1)]
    for nbytes in sorted({r["nbytes"] for r in rows}):
        at = {r["algorithm"]: r for r in rows if r["nbytes"] == nbytes}
        native = at.get("native", {}).get("busbw_gbps")
        cells = []
        for a in algorithms:
            if a not in at:
                cells.append("-")
                continue
            bw = at[a]["busbw_gbps"]
            picked = f" ({at[a]['resolved_algorithm']})" if a == "auto" else ""
            ratio = f" ({bw / native:.2f}x)" if native and a != "native" else ""
            cells.append(f"{bw:.3g}{ratio}{picked}")
        lines.append(f"| {_size(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_table(rows: list[dict]) -> str:
    errors: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("predicted_us") is None or r["algorithm"] == "auto" or r["time_us"] <= 0:
            continue
        errors.setdefault((r["collective"], r["algorithm"]), []).append(abs(r["predicted_us"] / r["time_us"] - 1))
    lines = ["| collective | algorithm | points | median error | worst error |", "| --- | --- | --- | --- | --- |"]
    for (coll, alg), errs in sorted(errors.items()):
        lines.append(f"| {coll} | {alg} | {len(errs)} | {statistics.median(errs):.0%} | {max(errs):.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--collective", default=None)
    parser.add_argument("--algorithms", default=None, help="comma-separated columns (default: all)")
    parser.add_argument("--model", action="store_true", help="the cost model's error table instead")
    args = parser.parse_args()
    rows = _load(args.jsonl)
    if args.model:
        print(model_table(rows))
        return
    collectives = [args.collective] if args.collective else list(dict.fromkeys(r["collective"] for r in rows))
    for coll in collectives:
        present = list(dict.fromkeys(r["algorithm"] for r in rows if r["collective"] == coll))
        algorithms = args.algorithms.split(",") if args.algorithms else present
        print(f"\n{coll} busbw GB/s (ratio to native in the same run)\n")
        print(busbw_table(rows, coll, [a for a in algorithms if a in present]))


if __name__ == "__main__":
    main()
