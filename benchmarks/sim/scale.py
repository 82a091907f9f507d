"""How long ``dtrain simulate train``'s step function takes as the cluster grows.

DGX H100 servers (8 GPUs, 8 x 400G NICs) in scalable units of 32 on a rail-optimised fabric (preset
``h100-rail``), GPT-3 175B with tp 8, pp 8 and dp growing with the GPU count, split pipeline sends. Each size
times building its topology (:func:`dtrain.cluster.presets.preset`) and :func:`dtrain.sim.step.simulate_step`
once (no cache: every route and replay is computed), the placement between them untimed: wall-clock seconds and
the process's CPU seconds of each and of both (what the simulation itself costs on a shared machine), and the
one-minute load average before and after. Each size runs ``--repeat`` times (default 3), each in a fresh
interpreter, in rounds over the sizes, and keeps the run of the median total CPU seconds with every run's CPU
seconds beside it: on a shared machine one run of the same work can take half as long again as another. One JSON
line per size, written atomically.

    python benchmarks/sim/scale.py --gpus 64,512,2048,4096,10240,16384 --out benchmarks/results/sim_scale-cpu2.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from dtrain.cluster.presets import preset
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, simulate_step

SERVERS_PER_UNIT = 32


def run(gpus: int, tp: int, pp: int, flow_limit: int | None) -> dict:
    servers = gpus // 8
    units = max(1, -(-servers // SERVERS_PER_UNIT))
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    topology = preset("h100-rail", racks=units, servers_per_rack=min(servers, SERVERS_PER_UNIT))
    build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    dp = gpus // (tp * pp)
    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch=1, global_batch=dp * 16)
    placement = place(topology, layout)
    config = StepConfig(split_pipeline=True, flow_limit=flow_limit)
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate_step(MODELS["gpt3-175b"], layout, topology, placement, config)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "gpus": layout.world_size, "layout": layout.describe(), "topology": f"h100-rail x{units} units",
        "flow_limit": flow_limit, "build_s": round(build, 3), "build_cpu_s": round(build_cpu, 3),
        "simulate_s": round(seconds, 3), "simulate_cpu_s": round(cpu, 3), "total_s": round(build + seconds, 3),
        "total_cpu_s": round(build_cpu + cpu, 3), "load_before": load, "load_after": os.getloadavg()[0],
        "step_s": result.step_s, "tp_s": result.tp_s, "pp_s": result.pp_s, "dp_s": result.dp_s,
        "machine": platform.machine(), "cpus": os.cpu_count(),
    }  # fmt: skip


def one(gpus: int, tp: int, pp: int, flow_limit: int | None) -> dict:
    """:func:`run` in a fresh interpreter: nothing cached from another run or size."""
    command = [sys.executable, __file__, "--one", str(gpus), "--tp", str(tp), "--pp", str(pp),
               "--flow-limit", str(flow_limit or 0)]  # fmt: skip
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def median_row(runs: list[dict]) -> dict:
    """The run of the median total CPU seconds, with every run's build, simulate and total CPU seconds."""
    runs = sorted(runs, key=lambda r: r["total_cpu_s"])
    row = dict(runs[(len(runs) - 1) // 2])
    row["repeat"] = len(runs)
    row["runs_cpu_s"] = [[r["build_cpu_s"], r["simulate_cpu_s"], r["total_cpu_s"]] for r in runs]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,512,2048,4096,10240", help="comma-separated GPU counts")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--flow-limit", type=int, default=50_000, help="0: replay every message")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes a size; the median's row is kept")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one run of one size, its row on stdout
    parser.add_argument("--out", default="benchmarks/results/sim_scale-cpu2.jsonl")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run(args.one, args.tp, args.pp, args.flow_limit or None)))
        return
    sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    if any(n % (8 * args.tp * args.pp) and n % (args.tp * args.pp) for n in sizes):
        raise ValueError(f"--gpus: each count must be a multiple of tp x pp = {args.tp * args.pp}, got {sizes}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be a whole number >= 1, got {args.repeat}")
    runs: dict[int, list[dict]] = {gpus: [] for gpus in sizes}
    for _ in range(args.repeat):  # in rounds over the sizes: a slow spell of the machine spreads over all of them
        for gpus in sizes:
            runs[gpus].append(one(gpus, args.tp, args.pp, args.flow_limit or None))
    rows = [median_row(runs[gpus]) for gpus in sizes]
    for row in rows:
        print(json.dumps(row), flush=True)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
