"""Usage: python benchmarks/sim/validate.py p2p-h200 [--data DIR] [--calibration F] [--out F] [--summary F] [--plot PNG]

Validate the simulator against collectives measured on 4 x NVIDIA H200 (one node, NCCL).

The node is built as data: four H200s, each joined to an NVSwitch by one link per direction whose rate is the
calibrated injection bandwidth (``1 / beta``); the calibrated per-round start-up (``alpha``, ``alpha_peer``),
reduction cost (``gamma``) and per-pair limit (``1 / beta_peer``, a cap on each message's rate) are the
simulator's software costs. Every measured point of dtrain's own algorithms (eager runs, not CUDA-graph
replays, which the calibration does not describe) is replayed with the schedule the runtime ran, and the
relative error ``simulated / measured - 1`` is reported per algorithm: median and worst.

Two variants: ``calibrated`` takes every figure from the calibration file as it is; ``fitted`` fits the
simulator's own software costs (a call's start-up, a round's, each further peer's) on the small messages and
the link rate on the large messages of ONE run (all_reduce-p2p-h200x4.jsonl, the run the calibration came
from) with :mod:`dtrain.sim.fit`, and is then tested on the two other runs (held out: another day's
all-reduce sweep, and the other collectives).

Every variant prices each call with the public API's own operations around its schedule
(:mod:`dtrain.sim.api_passes`: reduce-scatter's and all-to-all's clone and copy out, all-gather's copy in), none
of it fitted here: a torch operation costs ``TORCH_OP_S`` of host time (benchmarks/collectives/probe.py peer-host) and a
local copy goes at ``LOCAL_COPY_BYTES_PER_S`` (benchmarks/collectives/probe.py symm), the figures the
peer-transport model (benchmarks/sim/validate.py peer-h200) uses. ``--schedule-only`` prices the schedules alone.

No GPU is needed: the measurements are read from the JSON lines the GPU benchmark wrote
(benchmarks/results/*-p2p-h200x4.jsonl) and the calibration it used (benchmarks/results/calibration-h200x4.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dtrain.cluster.topology import Device, Topology
from dtrain.comm.cost.model import CostParams, load_params, optimal_pipeline
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.collective import SoftwareCost
from dtrain.sim.fit import (
    Measurement,
    fit_flow_cap,
    fit_link_rate,
    fit_message_cap,
    fit_software,
    simulate_measurement,
)

FIT_RUN = "all_reduce-p2p-h200x4.jsonl"
MEASUREMENTS = (FIT_RUN, "all_reduce-p2p-graphs-h200x4.jsonl", "collectives-p2p-h200x4.jsonl")
WORLD = 4
SMALL_BYTES = 1 << 20  # fit the software costs here: the wire time is a few per cent at most
LARGE_BYTES = 64 << 20  # fit the link rate here: the software costs are a few per cent at most
TORCH_OP_S = 5.6e-6  # host time of one torch operation on 4 H200s (probe.py peer-host)
LOCAL_COPY_BYTES_PER_S = 1.83e12  # a 64 MiB device-to-device copy on an H200, 36.7 us (probe.py symm)


def h200_node(link_bytes_per_s: float) -> Topology:
    """Four H200s on one NVSwitch, every GPU's link at ``link_bytes_per_s`` in both directions."""
    topo = Topology("h200x4")
    topo.add_node("n0/nvswitch", kind="nvswitch", server="n0")
    for i in range(WORLD):
        topo.add_device(
            Device(
                name=f"n0/gpu{i}",
                server="n0",
                peak_flops=989e12,  # H200 dense BF16 (NVIDIA H200 datasheet)
                memory_bytes=141 * 10**9,
                memory_bytes_per_s=4.8e12,
            )
        )
        # the calibrated alpha already holds the hop latency: the links add none
        topo.add_link(
            f"n0/gpu{i}", "n0/nvswitch", bytes_per_s=link_bytes_per_s, latency_s=0.0, kind="nvlink4-calibrated"
        )
    return topo


def api_cost(api: bool) -> dict:
    """The API's own operations' figures (:class:`SoftwareCost` fields): the probes', or free."""
    if not api:
        return {"launch_s": 0.0, "copy_s_per_byte": 0.0}
    return {"launch_s": TORCH_OP_S, "copy_s_per_byte": 1 / LOCAL_COPY_BYTES_PER_S}


def calibrated_cost(params: CostParams, *, api: bool = True) -> SoftwareCost:
    """The calibration's figures as the simulator's: alpha, alpha_peer, gamma, and beta_peer as a message cap;
    with ``api``, the API's own operations at the probes' figures."""
    link = params.intra
    return SoftwareCost(
        alpha_s=link.alpha_s,
        alpha_peer_s=link.alpha_peer_s,
        gamma_s_per_byte=link.gamma_s_per_byte,
        flow_cap_bytes_per_s=1 / link.beta_peer_s_per_byte if link.beta_peer_s_per_byte else None,
        **api_cost(api),
    )


def to_measurement(row: dict, params: CostParams) -> Measurement:
    """A measured row as the call the runtime made: ring broadcast and reduce pipelined as dtrain.comm.api does,
    hierarchical algorithms with LOCAL_WORLD_SIZE=4 (one node)."""
    collective = Collective(row["collective"])
    pipeline = 1
    if row["algorithm"] == "ring" and collective in (Collective.BROADCAST, Collective.REDUCE):
        pipeline = optimal_pipeline(row["nbytes"], WORLD, params.intra)
    return Measurement(
        collective=row["collective"],
        algorithm=row["algorithm"],
        nbytes=row["nbytes"],
        world_size=WORLD,
        seconds=row["time_us"] * 1e-6,
        pipeline=pipeline,
        local_size=WORLD,
    )


def measured_rows(data: Path, name: str, *, graphs: bool = False) -> list[dict]:
    """dtrain's own algorithms (not NCCL's: nothing to replay; not "auto"), eager or CUDA-graph replays."""
    rows = [json.loads(line) for line in (data / name).read_text().splitlines()]
    rows = [r for r in rows if r["algorithm"] not in ("auto", "native", "native+graph")]
    return [
        {**r, "algorithm": r["algorithm"].removesuffix("+graph")}
        for r in rows
        if r["algorithm"].endswith("+graph") == graphs
    ]


def fitted(
    data: Path,
    params: CostParams,
    *,
    graphs: bool,
    network: tuple[float, SoftwareCost] | None = None,
    by_size: bool = False,
    api: bool = True,
) -> tuple[float, SoftwareCost]:
    """Software costs fitted on the fit run's small messages; then, unless ``network`` gives them (link rate and
    the caps of a cost), the link rate and the message cap on its large ones (``by_size``: a cap for messages
    up to a fitted size, larger ones free), alternating twice. ``api``: the API's own operations at the probes'
    figures (the fit run's all-reduces have none, so they change no fitted figure)."""
    rows = [to_measurement(r, params) for r in measured_rows(data, FIT_RUN, graphs=graphs)]
    base = SoftwareCost(gamma_s_per_byte=params.intra.gamma_s_per_byte, **api_cost(api))
    if network is not None:
        rate, caps = network
        base = replace(base, flow_cap_bytes_per_s=caps.flow_cap_bytes_per_s, message_caps=caps.message_caps)
        return rate, fit_software([m for m in rows if m.nbytes <= SMALL_BYTES], h200_node(rate), base)
    cost = fit_software([m for m in rows if m.nbytes <= SMALL_BYTES], h200_node(1 / params.intra.beta_s_per_byte), base)
    large = [m for m in rows if m.nbytes >= LARGE_BYTES]
    rate = fit_link_rate(large, h200_node, cost)
    for _ in range(2):
        if by_size:
            threshold, cap = fit_message_cap(large, h200_node(rate), cost)
            cost = replace(cost, message_caps=((threshold, cap),))
        else:
            cost = replace(cost, flow_cap_bytes_per_s=fit_flow_cap(large, h200_node(rate), cost, high=rate))
        rate = fit_link_rate(large, h200_node, cost)
    return rate, cost


def _record(variant: str, name: str, row: dict, simulated_s: float) -> dict:
    return {
        "variant": variant,
        "source": name,
        "held_out": variant == "calibrated" or name != FIT_RUN,
        "collective": row["collective"],
        "algorithm": row["algorithm"],
        "nbytes": row["nbytes"],
        "world_size": WORLD,
        "measured_us": row["time_us"],
        "simulated_us": simulated_s * 1e6,
        "relative_error": simulated_s * 1e6 / row["time_us"] - 1,
        "device_name": row["device_name"],
    }


def validate(data: Path, calibration: Path, *, api: bool = True) -> tuple[list[dict], dict]:
    """Every measured point under each variant; and the fitted figures. ``api``: price the API's own operations."""
    params = load_params(calibration)
    rate, eager = fitted(data, params, graphs=False, api=api)
    size_rate, by_size = fitted(data, params, graphs=False, by_size=True, api=api)
    # the graph replays run on the same wires: the network figures carry over, the host's share is fitted anew
    _, graph = fitted(data, params, graphs=True, network=(size_rate, by_size), api=api)
    variants = {
        "calibrated": (False, h200_node(1 / params.intra.beta_s_per_byte), calibrated_cost(params, api=api)),
        "fitted": (False, h200_node(rate), eager),
        "fitted-by-size": (False, h200_node(size_rate), by_size),
        "fitted-graph": (True, h200_node(size_rate), graph),
    }
    records = []
    for variant, (graphs, topo, software) in variants.items():
        for name in MEASUREMENTS:
            for row in measured_rows(data, name, graphs=graphs):
                records.append(
                    _record(variant, name, row, simulate_measurement(to_measurement(row, params), topo, software))
                )
    fit = {
        "fitted": {"link_bytes_per_s": rate, **_figures(eager)},
        "fitted-by-size": {"link_bytes_per_s": size_rate, **_figures(by_size)},
        "fitted-graph": {"link_bytes_per_s": size_rate, **_figures(graph)},
    }
    return records, fit


def _figures(cost: SoftwareCost) -> dict:
    return {k: v for k, v in vars(cost).items() if v is not None}


def _run_name(source: str) -> str:
    return source.removesuffix(".jsonl").removesuffix("-h200x4")


def _stats(errors: list[float]) -> dict:
    return {"points": len(errors), "median_error": statistics.median(errors), "worst_error": max(errors)}


def summarise(records: list[dict]) -> list[dict]:
    """Median and worst |relative error| per (variant, run, collective, algorithm), for all sizes and for
    large messages (>= 64 MiB) alone, and the same per (variant, run)."""
    groups: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    for r in records:
        bands = ["all sizes"] + (["large"] if r["nbytes"] >= LARGE_BYTES else [])
        for band in bands:
            for coll, alg in ((r["collective"], r["algorithm"]), ("all", "all")):
                groups[(r["variant"], _run_name(r["source"]), band, coll, alg)].append(abs(r["relative_error"]))
    return [
        {
            "variant": v,
            "run": run,
            "held_out": v == "calibrated" or run != _run_name(FIT_RUN),
            "sizes": band,
            "collective": c,
            "algorithm": a,
            **_stats(errs),
        }
        for (v, run, band, c, a), errs in sorted(groups.items())
    ]


def print_summary(summary: list[dict]) -> None:
    table = Table(title="simulated vs measured on 4 x H200: |simulated / measured - 1| (all sizes | >= 64 MiB)")
    for column in ("variant", "run", "collective", "algorithm", "points", "median", "worst", "median L", "worst L"):
        table.add_column(column, justify="left" if column in ("variant", "run", "collective", "algorithm") else "right")
    large = {(s["variant"], s["run"], s["collective"], s["algorithm"]): s for s in summary if s["sizes"] == "large"}
    for s in summary:
        if s["sizes"] != "all sizes":
            continue
        big = large.get((s["variant"], s["run"], s["collective"], s["algorithm"]))
        run = s["run"] + ("" if s["held_out"] else " (fit)")
        cells = [s["variant"], run, s["collective"], s["algorithm"], str(s["points"])]
        cells += [f"{s['median_error']:.0%}", f"{s['worst_error']:.0%}"]
        cells += [f"{big['median_error']:.0%}", f"{big['worst_error']:.0%}"] if big else ["", ""]
        table.add_row(*cells, end_section=s["collective"] == "all")
    Console(width=140).print(table)


def run_to_run(data: Path) -> dict:
    """How far the two all-reduce runs disagree with each other on the points both measured (the noise floor
    no model can get under): median and worst |t2 / t1 - 1|, small (<= 1 MiB) and large (>= 64 MiB)."""
    first = {(r["algorithm"], r["nbytes"]): r["time_us"] for r in measured_rows(data, FIT_RUN)}
    second = {(r["algorithm"], r["nbytes"]): r["time_us"] for r in measured_rows(data, MEASUREMENTS[1])}
    out = {}
    for band, keep in (("small", lambda n: n <= SMALL_BYTES), ("large", lambda n: n >= LARGE_BYTES)):
        diffs = [abs(second[k] / first[k] - 1) for k in first if k in second and keep(k[1])]
        out[band] = {"points": len(diffs), "median": statistics.median(diffs), "worst": max(diffs)}
    return out


def plot(records: list[dict], path: Path) -> None:
    """Simulated against measured, one panel per variant, log-log, with the 1:1 line and +-10%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted({r["variant"] for r in records})
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4.6), sharey=True)
    for ax, variant in zip(axes, variants, strict=True):
        rows = [r for r in records if r["variant"] == variant]
        for source, marker in zip(MEASUREMENTS, "o^s", strict=True):
            pts = [r for r in rows if r["source"] == source]
            ax.scatter([r["measured_us"] for r in pts], [r["simulated_us"] for r in pts], s=12, marker=marker,
                       alpha=0.6, label=_run_name(source) + ("" if variant == "calibrated" or source != FIT_RUN
                                                             else " (fit)"))  # fmt: skip
        lo, hi = 50, 3e4
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2)
        ax.set(xscale="log", yscale="log", xlabel="measured (us)", title=variant)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("simulated (us)")
    fig.suptitle("dtrain.sim against dtrain's collectives on 4 x H200 (NCCL point-to-point)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--calibration", type=Path, default=Path("benchmarks/results/calibration-h200x4.json"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_validation-p2p-h200x4.jsonl"))
    parser.add_argument(
        "--summary", type=Path, default=Path("benchmarks/results/sim_validation-p2p-summary-h200x4.jsonl")
    )
    parser.add_argument("--schedule-only", action="store_true", help="price the schedules without the API's operations")
    parser.add_argument("--plot", type=Path, default=None, help="also draw measured and simulated busbw to this PNG")
    args = parser.parse_args()
    records, fit = validate(args.data, args.calibration, api=not args.schedule_only)
    summary = summarise(records)
    noise = run_to_run(args.data)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    args.summary.write_text("".join(json.dumps(s) + "\n" for s in [{"fit": fit, "run_to_run": noise}, *summary]))
    if args.plot:
        plot(records, args.plot)
    print_summary(summary)
    Console().print(f"fitted on {FIT_RUN}: {json.dumps(fit)}")
    Console().print(f"run to run (same points, two runs): {json.dumps(noise)}")


if __name__ == "__main__":
    main()
