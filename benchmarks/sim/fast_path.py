"""The lock-step fast path against the exact replay: one training step and its data-parallel all-reduce.

    python benchmarks/sim/fast_path.py [--out benchmarks/results/sim_fast_path-cpu2.jsonl]

llama-7b, split pipeline sends where pp > 1, the aware placement; the fast path at a flow limit of 100 messages
(every part in lock-step rounds), the exact replay with none. docs/simulator-scale.md quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from dtrain.cluster.presets import preset
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, simulate_step

CASES = [
    ("h100-rail, 2 units x 16 servers (256 GPUs)", lambda: preset("h100-rail", racks=2, servers_per_rack=16),
     Layout(dp=16, tp=8, pp=2, global_batch=32)),
    ("4-rack (1:4 oversubscribed, 2 spines), rail affinity", lambda: preset("4-rack"),
     Layout(dp=16, tp=8, global_batch=16)),
    ("dgx-a100-superpod, 2 units x 8 servers, 1:1",
     lambda: preset("dgx-a100-superpod", racks=2, servers_per_rack=8, spines=4, cores=8),
     Layout(dp=16, tp=8, global_batch=16)),
    ("fat-tree-k8 (128 single-GPU servers)", lambda: preset("fat-tree-k8"), Layout(dp=32, pp=4, global_batch=128)),
    ("h100-rail, 1 unit x 4 servers, NCCL's 8 rail-aligned rings", lambda: preset("h100-rail", racks=1,
     servers_per_rack=4), Layout(dp=32, global_batch=32)),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON lines, one per case")
    args = parser.parse_args()
    model = MODELS["llama-7b"]
    lines = []
    print(f"{'topology':55} {'layout':32} {'step fast/exact':>16} {'dp fast/exact':>14}")
    for name, build, layout in CASES:
        topo = build()
        placement = place(topo, layout)
        start = time.perf_counter()
        exact = simulate_step(model, layout, topo, placement, StepConfig(flow_limit=None, split_pipeline=True))
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        fast = simulate_step(model, layout, topo, placement, StepConfig(flow_limit=100, split_pipeline=True))
        fast_s = time.perf_counter() - start
        step = fast.step_s / exact.step_s - 1
        dp = fast.dp_s / exact.dp_s - 1 if exact.dp_s else 0.0
        print(f"{name:55} {layout.describe():32} {step:+16.3%} {dp:+14.3%}")
        lines.append({"topology": name, "layout": layout.describe(), "exact_step_s": exact.step_s,
                      "fast_step_s": fast.step_s, "exact_dp_s": exact.dp_s, "fast_dp_s": fast.dp_s,
                      "step_error": step, "dp_error": dp, "exact_wall_s": exact_s, "fast_wall_s": fast_s})  # fmt: skip
    if args.out:
        directory = os.path.dirname(os.path.abspath(args.out))
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        os.replace(f.name, args.out)


if __name__ == "__main__":
    main()
