"""How long ``dtrain plan``'s sweep takes as the cluster grows, and what the branch and bound leaves out.

A 1T-parameter decoder (128 layers, hidden 25,600, 160 heads, sequence 2048) with global batch 1,536 on DGX H100
servers in scalable units of 32 on a rail-optimised fabric (preset ``h100-rail``), ``dtrain plan``'s defaults:
micro-batches 1, 2 and 4, ZeRO 0 and 1, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V, the three placements, the cheapest
recomputation that fits. Each size builds its topology and runs :func:`dtrain.sim.planner.sweep` for the ``--top`` plans
(branch and bound), and with ``--exhaustive`` the whole sweep too: wall-clock seconds, the process's CPU seconds
(what the sweep itself costs on a shared machine), the one-minute load average before and after, how many
(layout, placement) pairs were simulated and bounded out, and the ranked plans. One JSON line per size and
mode, written atomically.

    python benchmarks/sim/plan_scale.py --gpus 768,1536,3072 --out benchmarks/results/plan_scale-cpu2.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from dtrain.cluster.presets import preset
from dtrain.sim.model import ModelSpec
from dtrain.sim.planner import sweep

SERVERS_PER_UNIT = 32
MODEL = ModelSpec(name="1t", parameters=1e12, layers=128, hidden=25600, heads=160, sequence=2048)
GLOBAL_BATCH = 1536


def run(gpus: int, top: int | None) -> dict:
    servers = gpus // 8
    units = max(1, -(-servers // SERVERS_PER_UNIT))
    topology = preset("h100-rail", racks=units, servers_per_rack=min(servers, SERVERS_PER_UNIT))
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    found = sweep(MODEL, topology, global_batch=GLOBAL_BATCH, micro_batches=(1, 2, 4), top=top)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    shown = found.plans[: top or 10]
    return {
        "gpus": len(topology.devices()), "topology": f"h100-rail x{units} units", "model": MODEL.name,
        "global_batch": GLOBAL_BATCH, "top": top, "simulated": found.simulated, "bounded": found.bounded,
        "too_big": found.too_big, "wall_s": round(seconds, 3), "cpu_s": round(cpu, 3), "load_before": load,
        "load_after": os.getloadavg()[0],
        "plans": [[p.layout.describe(), p.placement, p.result.step_s] for p in shown],
        "machine": platform.machine(), "cpus": os.cpu_count(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="768,1536,3072", help="comma-separated GPU counts (multiples of 256)")
    parser.add_argument("--top", type=int, default=10, help="plans wanted (the bound's k)")
    parser.add_argument("--exhaustive", action="store_true", help="also time the whole sweep at each size")
    parser.add_argument("--out", default="benchmarks/results/plan_scale-cpu2.jsonl")
    args = parser.parse_args()
    sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    if any(n % 256 and n > 256 for n in sizes) or any(n % 8 for n in sizes):
        raise ValueError(f"--gpus: each count must be a multiple of 8 and, above 256, of 256; got {sizes}")
    rows = []
    for gpus in sizes:
        for top in [args.top, None] if args.exhaustive else [args.top]:
            row = run(gpus, top)
            print(json.dumps(row), flush=True)
            rows.append(row)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
