"""Usage: python benchmarks/emulation/validate.py [--data benchmarks/results] [--out FILE] [--plot PNG]

Compare the simulator with what the emulated leaf-spine cluster measured (benchmarks/emulation/measure.py).

For every measured all-reduce the simulator replays the same schedule (dtrain's algorithms; Gloo's own
all-reduce as a ring, which is what Gloo runs for it) on the network the emulation built
(:func:`dtrain.emulate.model.emulated_topology`: the shaped rates times the payload share of a frame, the
spines merged as the bridge merges them), with the ranks placed as they ran. Two variants:

- ``network``: wire time only (software costs zero);
- ``fitted``: plus a call's start-up, a round's and each further peer's, fitted with :mod:`dtrain.sim.fit`
  on the 4 KiB points of ONE case (1:1, packed) and tested on every point of 256 KiB and more of all three.

A training step (``measure.py``'s ``dtrain train`` run, dp=4) is predicted as the same training on 4 local
ranks over loopback (compute, CPU contention, Gloo's host costs; measured) plus the simulated wire time of its
two all-reduces (the gradients, one bucket of float32, and the loss); the gradient bytes are those each row
records for the model it trained.
Errors are ``predicted / measured - 1``; the tables give median and worst |error|.

    python benchmarks/emulation/validate.py [--data benchmarks/results] [--out FILE] [--plot PNG]   (no root needed)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from measure import cluster  # the sibling script (this script's folder is on sys.path)

from dtrain.comm.ir import algorithms
from dtrain.comm.ir.schedule import Collective
from dtrain.emulate.model import emulated_topology
from dtrain.emulate.plan import plan_emulation
from dtrain.sim.collective import SoftwareCost, replay
from dtrain.sim.fit import Measurement, fit_software

FIT_CASE, FIT_BYTES, TEST_MIN_BYTES = "1to1-packed", 4096, 256 * 1024


def _network(case: dict):
    """The emulated topology of a measured case and its device placement."""
    topology = cluster(case["oversubscription"])
    plan = plan_emulation(topology, scale=case["scale"], tag="sim", placement=case["servers"])
    return emulated_topology(topology, plan), [f"{s}/gpu0" for s in case["servers"]]


def _schedule(algorithm: str, world: int, local_size: int | None):
    name = "ring" if algorithm == "native" else algorithm
    local = local_size if algorithms.needs_local_size(name) else None
    return algorithms.build(Collective.ALL_REDUCE, name, world, local_size=local)


def predict(record: dict, cost: SoftwareCost) -> float:
    topology, placement = _network(record)
    schedule = _schedule(record["algorithm"], record["world_size"], record["hierarchy_local_size"])
    return replay(schedule, record["nbytes"], topology, placement, cost=cost).time_s


def fit(records: list[dict]) -> SoftwareCost:
    """Software costs from the small messages of the fitting case (dtrain's algorithms only)."""
    small = [r for r in records if r["case"] == FIT_CASE and r["nbytes"] == FIT_BYTES and r["algorithm"] != "native"]
    if not small:
        raise ValueError(f"no {FIT_BYTES}-byte points of case {FIT_CASE} to fit software costs on")
    topology, _ = _network(small[0])
    measurements = [
        Measurement(collective="all_reduce", algorithm=r["algorithm"], nbytes=r["nbytes"], world_size=r["world_size"],
                    seconds=r["time_us"] * 1e-6, local_size=r["hierarchy_local_size"])
        for r in small
    ]  # fmt: skip
    return fit_software(measurements, topology, SoftwareCost())


def _train_predictions(train: list[dict]) -> list[dict]:
    loopback = next(r for r in train if r["case"] == "loopback")["median_step_s"]
    rows = []
    for row in (r for r in train if r["case"] != "loopback"):
        grad_bytes = row["gradient_bytes"]  # float32 gradients of the model the row trained
        wire = sum(predict({**row, "algorithm": "ring", "nbytes": n, "world_size": 4, "hierarchy_local_size": None},
                           SoftwareCost()) for n in (grad_bytes, 4))  # fmt: skip
        predicted = loopback + wire
        rows.append({"case": row["case"], "kind": "train", "gradient_bytes": grad_bytes, "loopback_step_s": loopback,
                     "measured_s": row["median_step_s"], "predicted_s": predicted,
                     "error": predicted / row["median_step_s"] - 1})  # fmt: skip
    return rows


def _summary(rows: list[dict], key: str) -> str:
    errors = defaultdict(list)
    for r in rows:
        errors[r[key]].append(abs(r["error"]))
    lines = [f"| {key} | points | median abs error | worst abs error |", "| --- | ---: | ---: | ---: |"]
    for name, errs in sorted(errors.items()):
        lines.append(f"| {name} | {len(errs)} | {statistics.median(errs):.1%} | {max(errs):.1%} |")
    every = [abs(r["error"]) for r in rows]
    lines.append(f"| all | {len(every)} | {statistics.median(every):.1%} | {max(every):.1%} |")
    return "\n".join(lines)


def _placement_table(rows: list[dict]) -> str:
    """1:4, per size: aware (packed hierarchical, packed ring) against the oblivious (interleaved) ring."""
    at = {(r["case"], r["algorithm"], r["nbytes"]): r for r in rows}
    lines = [
        "| size | oblivious ring (interleaved) | aware ring (packed) | aware hierarchical (packed) | "
        "speed-up of hierarchical, measured | predicted |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for nbytes in sorted({r["nbytes"] for r in rows}):
        keys = [("1to4-interleaved", "ring"), ("1to4-packed", "ring"), ("1to4-packed", "hierarchical")]
        got = [at.get((c, a, nbytes)) for c, a in keys]
        if None in got:
            continue
        cells = [f"{g['measured_s'] * 1e3:.0f} ms (sim {g['predicted_s'] * 1e3:.0f})" for g in got]
        speed = got[0]["measured_s"] / got[2]["measured_s"]
        speed_sim = got[0]["predicted_s"] / got[2]["predicted_s"]
        lines.append(f"| {nbytes >> 10} KiB | {' | '.join(cells)} | {speed:.2f}x | {speed_sim:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], exchange: list[dict], path: Path) -> None:
    """Predicted against measured, one marker per algorithm; hollow: the receives-first transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    for algorithm in sorted({r["algorithm"] for r in rows}):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        ax.scatter([r["measured_s"] for r in mine], [r["predicted_s"] for r in mine], label=algorithm, s=22)
    first = [r for r in exchange if r["order"] == "receives-first"]
    if first:
        ax.scatter([r["seconds"] for r in first], [r["predicted_s"] for r in first], facecolors="none",
                   edgecolors="black", s=40, label="receives posted first (1:4)")  # fmt: skip
    low, high = 0.02, 5.0
    for factor, style in ((1.0, "-"), (1.1, ":"), (1 / 1.1, ":")):
        ax.plot([low, high], [low * factor, high * factor], style, color="grey", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured (s)",
           ylabel="simulated (s)", title="all-reduce on the emulated 2x2 leaf-spine (dotted: +-10%)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="benchmarks/results")
    parser.add_argument("--out", default=None, help="default: DATA/sim_validation-emulation.jsonl")
    parser.add_argument("--plot", default=None, help="also draw measured against predicted to this PNG")
    args = parser.parse_args()
    data = Path(args.data)
    bench = [json.loads(x) for x in (data / "emulation-collectives.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (data / "emulation-train.jsonl").read_text().splitlines()]
    cost = fit(bench)
    print(f"fitted software costs on {FIT_CASE} at {FIT_BYTES} B: {cost}")
    rows = []
    for r in (r for r in bench if r["nbytes"] >= TEST_MIN_BYTES):
        measured = r["time_us"] * 1e-6
        network, fitted = predict(r, SoftwareCost()), predict(r, cost)
        rows.append({"case": r["case"], "kind": "all_reduce", "algorithm": r["algorithm"], "nbytes": r["nbytes"],
                     "measured_s": measured, "predicted_s": fitted, "predicted_network_s": network,
                     "error": fitted / measured - 1, "error_network": network / measured - 1})  # fmt: skip
    train_rows = _train_predictions(train)
    out = Path(args.out) if args.out else data / "sim_validation-emulation.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows + train_rows))
    exchange_path = data / "emulation-exchange.jsonl"
    exchange = [json.loads(x) for x in exchange_path.read_text().splitlines()] if exchange_path.exists() else []
    if args.plot:
        plot(rows, exchange, Path(args.plot))
    print(f"wrote {len(rows) + len(train_rows)} records to {out}\n")
    print("all-reduce, fitted software costs, by algorithm:\n" + _summary(rows, "algorithm") + "\n")
    print("all-reduce, fitted, by case:\n" + _summary(rows, "case") + "\n")
    net = [{**r, "error": r["error_network"]} for r in rows]
    print("all-reduce, network only, by algorithm:\n" + _summary(net, "algorithm") + "\n")
    print("training step (dp=4, ring):\n" + _summary(train_rows, "case") + "\n")
    for r in train_rows:
        print(f"  {r['case']}: measured {r['measured_s'] * 1e3:.0f} ms, predicted {r['predicted_s'] * 1e3:.0f} ms")
    print("\nplacement under 1:4:\n" + _placement_table(rows))


if __name__ == "__main__":
    main()
