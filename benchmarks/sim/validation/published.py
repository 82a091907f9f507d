"""The training-step simulator against published iteration times of large GPT runs (benchmarks/sim/published.toml).

Each row is simulated with the techniques it used (recomputation, sequence parallelism, schedule) on a DGX A100
SuperPOD like the papers' Selene: scalable units of 20 DGX A100 servers (8 A100 80 GB on NVSwitch, 8 HDR NICs),
rail-optimised (NVIDIA DGX SuperPOD reference architecture), compute priced per operation from device specs and
published microbenchmarks (dtrain.sim.compute). Nothing is fitted to these rows.

    python benchmarks/sim/validate.py published [--out benchmarks/results/sim_validation-cpu2.jsonl] [--plan]

``--plan``: also run ``dtrain plan``'s search on each row's cluster and batch, and report where the published
layout ranks and whether the best plan is at least as fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

from dtrain.cluster.presets import preset
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.placement import place
from dtrain.sim.classes import DEFAULT_FLOW_LIMIT
from dtrain.sim.step import StepConfig, simulate_step

DATA = Path(__file__).resolve().parents[1] / "published.toml"
SERVERS_PER_UNIT = 20  # DGX SuperPOD (A100) scalable unit
PRESETS = {"a100-sxm": "dgx-a100", "h100-sxm": "h100-node"}
MEDIAN_TARGET, WORST_TARGET = 0.10, 0.20
SETS = ("validation", "held-out")
MEASURES = {"time": "iteration_s", "tflops": "tflops_per_gpu"}
_FIELDS = ("name", "source", "set", "device", "layers", "hidden", "heads", "sequence", "vocab", "dp", "tp", "pp",
           "micro_batch", "global_batch", "recompute", "sequence_parallel", "measure")  # fmt: skip


def iteration_flops(row: dict) -> float:
    """FLOPs of one iteration with full recomputation, Narayanan et al. 2021, equation 3:
    ``F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``."""
    b, s, layers, h, v = row["global_batch"], row["sequence"], row["layers"], row["hidden"], row["vocab"]
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def load(path: Path = DATA) -> list[dict]:
    """The published runs, each checked for its fields; ``iteration_s`` derived from ``tflops_per_gpu`` where a
    row publishes throughput (:func:`iteration_flops` over ``GPUs x TFLOP/s``)."""
    rows = tomllib.loads(path.read_text())["run"]
    for row in rows:
        missing = [f for f in _FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: run {row.get('name', '?')!r} lacks {', '.join(missing)}")
        if row["device"] not in PRESETS:
            raise ValueError(f"{path}: run {row['name']!r}: device {row['device']!r}; accepted: {', '.join(PRESETS)}")
        if row["set"] not in SETS:
            raise ValueError(f"{path}: run {row['name']!r}: set {row['set']!r}; accepted: {', '.join(SETS)}")
        if row["measure"] not in MEASURES or MEASURES[row["measure"]] not in row:
            raise ValueError(f"{path}: run {row['name']!r}: measure {row['measure']!r} needs its value; accepted: "
                             + ", ".join(f"{m} (with {k})" for m, k in MEASURES.items()))  # fmt: skip
        if row["measure"] == "tflops":
            gpus = row["dp"] * row["tp"] * row["pp"]
            row["iteration_s"] = iteration_flops(row) / (gpus * row["tflops_per_gpu"] * 1e12)
    return rows


def model_of(row: dict) -> ModelSpec:
    """The GPT of a row: ``12 L h^2 (1 + 13 / 12 h) + V h`` parameters (Narayanan et al. 2021, appendix)."""
    h, layers, vocab = row["hidden"], row["layers"], row["vocab"]
    params = 12 * layers * h * h * (1 + 13 / (12 * h)) + vocab * h
    return ModelSpec(name=row["name"], parameters=params, layers=layers, hidden=h, heads=row["heads"],
                     sequence=row["sequence"], vocab=vocab, ffn_hidden=row.get("ffn_hidden", 0),
                     kv_heads=row.get("kv_heads", 0), gated_mlp=row.get("gated_mlp", False))  # fmt: skip


def layout_of(row: dict) -> Layout:
    return Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], micro_batch=row["micro_batch"],
                  global_batch=row["global_batch"], zero_stage=row.get("zero_stage", 0),
                  schedule=row.get("schedule", "1f1b"), chunks=row.get("chunks", 1), recompute=row["recompute"],
                  sequence_parallel=row["sequence_parallel"], attention=row.get("attention", "unfused"))  # fmt: skip


def cluster_of(row: dict):
    gpus = row["dp"] * row["tp"] * row["pp"]
    servers = math.ceil(gpus / 8)
    if servers == 1:
        return preset(PRESETS[row["device"]])
    units = math.ceil(servers / SERVERS_PER_UNIT)
    return preset(PRESETS[row["device"]], racks=units, servers_per_rack=min(servers, SERVERS_PER_UNIT),
                  fabric="rail", nic_affinity="rail", spines=8)  # fmt: skip


def config_of(row: dict, flow_limit: int | None = DEFAULT_FLOW_LIMIT) -> StepConfig:
    """How a row's software ran: Megatron-LM's scatter-gather pipeline sends (on by default from 2021-02,
    Megatron-LM commit 72e4230), and the backward's tensor-parallel collective under the weight gradient only where
    the row's code had it (``async_tp_allreduce``: Megatron-LM's asynchronous all-reduce, first in commit 16c9044
    of 2021-09-02). ``flow_limit``: replay collectives of more messages than that in lock-step rounds
    (:func:`dtrain.sim.classes.replay_jobs`)."""
    return StepConfig(split_pipeline=True, overlap_tp_backward=row.get("async_tp_allreduce", True),
                      flow_limit=flow_limit)  # fmt: skip


def simulate(row: dict, config: StepConfig | None = None) -> dict:
    """Predicted against published seconds of one row."""
    model, layout, topo = model_of(row), layout_of(row), cluster_of(row)
    result = simulate_step(model, layout, topo, place(topo, layout), config or config_of(row))
    error = result.step_s / row["iteration_s"] - 1
    return {
        "name": row["name"], "source": row["source"], "set": row["set"], "layout": layout.describe(), "gpus": layout.world_size,
        "published_s": row["iteration_s"], "measure": row["measure"], "predicted_s": result.step_s,
        "error": error, "compute_s": result.compute_s, "tp_s": result.tp_s, "pp_s": result.pp_s,
        "dp_exposed_s": result.dp_exposed_s, "optimizer_s": result.optimizer_s, "bubble": result.bubble,
        "memory_gb": result.memory.total / 1e9, "fits": result.fits,
    }  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """Median and worst |error| of ``rows``, and of each set among them."""
    errors = [abs(r["error"]) for r in rows]
    out = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors), "rows": len(rows)}
    for name in SETS:
        part = [abs(r["error"]) for r in rows if r.get("set") == name]
        if part:
            out[name] = {"median_abs_error": statistics.median(part), "worst_abs_error": max(part), "rows": len(part)}
    return out


def plan_check(row: dict) -> dict:
    """Where ``dtrain plan``'s search puts the published layout on the row's cluster and batch."""
    from dtrain.sim.planner import plan

    model, layout, topo = model_of(row), layout_of(row), cluster_of(row)
    plans, _ = plan(model, topo, global_batch=row["global_batch"], devices=layout.world_size, placements=("aware",),
                    micro_batches=(row["micro_batch"],), zero_stages=(0,), max_tp=8,
                    config=config_of(row))  # fmt: skip
    published = simulate_step(model, layout, topo, place(topo, layout), config_of(row))
    same = [
        i for i, p in enumerate(plans) if (p.layout.dp, p.layout.tp, p.layout.pp) == (layout.dp, layout.tp, layout.pp)
    ]
    best = plans[0] if plans else None
    return {
        "name": row["name"], "best": best.layout.describe() if best else None,
        "best_s": best.result.step_s if best else None, "published_layout_s": published.step_s,
        "at_least_as_fast": bool(best and best.result.step_s <= published.step_s * (1 + 1e-9)),
        "published_rank": same[0] + 1 if same else None, "plans": len(plans),
    }  # fmt: skip


def _write(path: str, lines: list[dict]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(f.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON lines: one per row, then the summary")
    parser.add_argument("--plan", action="store_true", help="also check dtrain plan's search on each row")
    args = parser.parse_args()
    rows = load()
    start = time.perf_counter()
    results = [simulate(row) for row in rows]
    print(f"{'run':34} {'layout':46} {'published':>10} {'predicted':>10} {'error':>7}")
    for r in results:
        print(f"{r['name']:34} {r['layout']:46} {r['published_s']:10.2f} {r['predicted_s']:10.2f} {r['error']:+7.1%}")
    s = summary(results)
    print(f"median |error| {s['median_abs_error']:.1%} (target {MEDIAN_TARGET:.0%}), worst {s['worst_abs_error']:.1%} "
          f"(target {WORST_TARGET:.0%}), {time.perf_counter() - start:.1f} s")  # fmt: skip
    checks = []
    if args.plan:
        for row in rows:
            c = plan_check(row)
            checks.append(c)
            print(f"plan {c['name']:34} best {c['best']} {c['best_s']:.2f} s; published layout "
                  f"{c['published_layout_s']:.2f} s, rank {c['published_rank']} of {c['plans']}")  # fmt: skip
    if args.out:
        _write(args.out, [*results, *({"plan": c} for c in checks), {"summary": s}])


if __name__ == "__main__":
    main()
