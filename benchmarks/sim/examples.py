"""Usage: python benchmarks/sim/examples.py [--out benchmarks/results/sim_examples-4rack.jsonl]

What the simulator predicts for the 4-rack preset (128 A100s, 16 DGX-A100-like servers, 2 spines): the
all-reduce algorithms and placements at 1:1 and 1:4 oversubscription, and a training step's placements.

    python benchmarks/sim/examples.py [--out benchmarks/results/sim_examples-4rack.jsonl]

Predictions only (no cluster was measured); the emulator's measurements are the check.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dtrain.cluster.presets import preset
from dtrain.comm.ir.algorithms import build
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.collective import replay
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import place
from dtrain.sim.step import simulate_step

NBYTES = 256 * 2**20
CASES = [("ring", "aware"), ("ring", "oblivious"), ("halving_doubling", "aware"), ("hierarchical", "aware")]
LAYOUTS = [Layout(dp=16, tp=8, global_batch=512, zero_stage=1), Layout(dp=8, tp=8, pp=2, global_batch=512)]


def collectives() -> list[dict]:
    rows = []
    for ratio in (1, 4):
        topo = preset("4-rack", oversubscription=ratio)
        ranks = len(topo.devices())
        for algorithm, how in CASES:
            placement = place(topo, Layout(dp=ranks, global_batch=ranks), how)
            schedule = build(Collective.ALL_REDUCE, algorithm, ranks, local_size=8)
            result = replay(schedule, NBYTES, topo, placement, itemsize=4)
            rows.append({"kind": "all_reduce", "oversubscription": ratio, "algorithm": algorithm, "placement": how,
                         "nbytes": NBYTES, "ranks": ranks, "time_s": result.time_s,
                         "bottleneck": result.bottleneck.link.name, "bottleneck_kind": result.bottleneck.link.kind,
                         "bottleneck_utilisation": result.bottleneck.utilisation})  # fmt: skip
    return rows


def steps() -> list[dict]:
    rows = []
    model = MODELS["llama-13b"]
    for ratio in (1, 4):
        topo = preset("4-rack", oversubscription=ratio)
        for layout in LAYOUTS:
            for how in ("aware", "oblivious"):
                r = simulate_step(model, layout, topo, place(topo, layout, how))
                rows.append({"kind": "train_step", "oversubscription": ratio, "model": model.name,
                             "layout": layout.describe(), "placement": how, "step_s": r.step_s,
                             "tp_comm_s": r.tp_s, "dp_comm_s": r.dp_s, "compute_s": r.compute_s,
                             "bottleneck": r.bottleneck.link.name, "memory_gb": r.memory.total / 1e9})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_examples-4rack.jsonl"))
    args = parser.parse_args()
    rows = collectives() + steps()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = Table(title="4-rack predictions")
    for column in ("ratio", "what", "placement", "time", "bottleneck"):
        table.add_column(column)
    for r in rows:
        what = r.get("algorithm") or r["layout"]
        time_s = r.get("time_s") or r["step_s"]
        table.add_row(f"1:{r['oversubscription']}", what, r["placement"], f"{time_s * 1e3:.1f} ms", r["bottleneck"])
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
