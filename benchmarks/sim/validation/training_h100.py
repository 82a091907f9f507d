"""The training-step simulator against dtrain's own training runs on 4 x H100 (benchmarks/results/*-h100x4.jsonl).

Every row is a measured run: the Llama 1B benchmark's variants (dtrain, ZeRO-3, with and without full activation
checkpointing, eager), the deepest Llama of 8B width that ZeRO-3 trained, the seven ``dtrain train`` layouts over
100 steps, and the planned run. Each is simulated as dtrain runs it (flash attention, no sequence parallelism,
1F1B) on the ``h100-node`` preset with compute priced per operation on the H100 curves of ``dtrain bench compute``
(dtrain/sim/compute_curves.json), the element-wise work as dtrain.models runs it (``kernels = "dtrain"``; each
row also records the fused layer's prediction). The runs' code differs from dtrain.models' in two ways, and
they are priced as they ran: tensor parallelism summed each column-parallel projection's input gradient over the
group apart, in 32 bits (five all-reduces a layer's backward), as each projection cast its own input, and the
attention repeated the grouped-query keys and values to every head: ``EagerForm(shared_inputs=False,
repeat_kv=True)``. ``predicted_shared_s`` and ``predicted_shared_memory_gib`` record the prices with dtrain.models'
form: each part's input cast once, one 16-bit all-reduce for q, k and v and one for gate and up, the key-value
heads read in place. Nothing is fitted to these rows.

    python benchmarks/sim/validate.py training-h100 [--out benchmarks/results/sim_vs_measured-h100x4.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from dtrain.cluster.presets import preset
from dtrain.models import preset as model_preset
from dtrain.sim.model import EAGER, EagerForm, Layout
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, simulate_step
from dtrain.train.plan import model_spec

RESULTS = Path(__file__).resolve().parents[2] / "results"
#: the layer the runs' code ran: each projection its own input cast and gradient sum, the key-value heads repeated
RUNS_FORM = EagerForm(shared_inputs=False, repeat_kv=True)


def _load(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def _median_step(name: str) -> float:
    """The median step time of a ``dtrain train`` metrics file after its first 20 steps."""
    return statistics.median(r["step_s"] for r in _load(name)[20:])


def rows() -> list[dict]:
    """(what, model, layout, measured seconds) of every measured run."""
    out = []
    one_b = model_spec(model_preset("llama", "1b"), 2048, name="llama-1b")
    bench = {(r["variant"], r.get("activation_checkpointing", "none") or "none"): r for r in _load(
        "llama_1b_zero-h100x4.jsonl") + _load("llama_1b_dp-h100x4.jsonl") + _load("llama_1b_recompute-h100x4.jsonl")
        if not r.get("compile")}  # fmt: skip
    for (variant, recompute), zero in (
        (("dtrain", "none"), 0),
        (("dtrain-zero3", "none"), 3),
        (("dtrain-zero3", "full"), 3),
        (("dtrain", "full"), 0),
    ):
        r = bench[(variant, recompute)]
        layout = Layout(dp=4, micro_batch=4, global_batch=16, zero_stage=zero, recompute=recompute, attention="flash")
        out.append({"run": f"benchmark {variant}, recompute {recompute}", "model": one_b, "layout": layout,
                    "measured_s": r["step_s"], "measured_gib": r.get("peak_memory_gib"),
                    "source": "llama_1b_*-h100x4.jsonl"})  # fmt: skip
    for r in _load("largest_zero3-h100x4.jsonl"):
        if "failed" in r or r["variant"] != "dtrain-zero3":
            continue
        model = model_spec(model_preset("llama", "8b", num_hidden_layers=r["layers"]), 2048, name=f"8b-{r['layers']}")
        layout = Layout(dp=4, micro_batch=1, global_batch=4, zero_stage=3, recompute="full", attention="flash")
        out.append({"run": f"ZeRO-3 + full recompute, {r['layers']} blocks of 8B width", "model": model,
                    "layout": layout, "measured_s": r["step_s"], "measured_gib": r.get("peak_memory_gib"),
                    "source": "largest_zero3-h100x4.jsonl"})  # fmt: skip
    layouts = {
        "dp4": dict(dp=4, micro_batch=4),
        "tp4": dict(tp=4, micro_batch=16),
        "pp4": dict(pp=4, micro_batch=4),
        "dp2tp2": dict(dp=2, tp=2, micro_batch=8),
        "tp2pp2": dict(tp=2, pp=2, micro_batch=4),
        "dp4zero3": dict(dp=4, micro_batch=4, zero_stage=3),
        "dp4zero3ac": dict(dp=4, micro_batch=4, zero_stage=3, recompute="full"),
    }
    for name, fields in layouts.items():
        layout = Layout(global_batch=16, attention="flash", **fields)
        source = f"llama_1b_train_{name}-h100x4.jsonl"
        peak = max(r["peak_memory_gib"] for r in _load(source) if r.get("peak_memory_gib"))
        out.append({"run": f"dtrain train {name}, 100 steps", "model": one_b, "layout": layout,
                    "measured_s": _median_step(source), "source": source, "measured_gib": peak})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="validate.py training-h100", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON lines, one per run")
    parser.add_argument("--kernels", default="dtrain", help="the simulator's kernel set (default: dtrain.models')")
    args = parser.parse_args(argv)
    topo = preset("h100-node")
    records, errors = [], []
    for row in rows():
        layout = row["layout"]
        config = StepConfig(kernels=args.kernels, eager=RUNS_FORM)
        result = simulate_step(row["model"], layout, topo, place(topo, layout), config)
        current = replace(config, eager=EAGER)
        shared = simulate_step(row["model"], layout, topo, place(topo, layout), current)
        fused = simulate_step(row["model"], layout, topo, place(topo, layout), StepConfig(kernels="fused"))
        error = result.step_s / row["measured_s"] - 1
        errors.append(abs(error))
        records.append({"run": row["run"], "layout": layout.describe(), "measured_s": row["measured_s"],
                        "predicted_s": result.step_s, "error": error, "source": row["source"],
                        "predicted_memory_gib": result.memory.total / 2**30, "kernels": args.kernels,
                        "measured_memory_gib": row["measured_gib"], "fused_memory_gib": fused.memory.total / 2**30,
                        "predicted_fused_s": fused.step_s, "predicted_shared_s": shared.step_s,
                        "predicted_shared_memory_gib": shared.memory.total / 2**30})  # fmt: skip
        print(f"{row['run']:48s} {layout.describe():40s} measured {row['measured_s'] * 1e3:8.1f} ms  predicted "
              f"{result.step_s * 1e3:8.1f} ms  {error:+.1%}")  # fmt: skip
    print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} runs")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0
