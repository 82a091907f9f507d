"""Usage: python benchmarks/sim/validate.py transports [--data DIR] [--out-prefix PREFIX] [--plot PNG]

Validate the NCCL model and the transport topologies against collectives measured on 4 x NVIDIA H200.

Two questions, both answered from JSON lines that ``dtrain bench comm`` wrote on the GPU machine (no GPU here):

1. **NCCL's own collectives** (``algorithm="native"``) against :mod:`dtrain.sim.nccl`: the model's four
   figures (host time per call, one ring connection's rate, the kernel's launch, a step's latency; the local
   copy at ``LOCAL_OVER_CONNECTION`` times the connection rate) are fitted on ONE run,
   ``collectives-direct-h200x4.jsonl`` (all-reduce and all-gather, 1-256 MiB; its all-to-all is
   not fitted on), through the simulator. Every other native point is held out: the all-reduce sweeps (eager
   and CUDA-graph), the other collectives, the all-to-all, and the NVLink transport run.
   A fit without the local copy on ``all_reduce-p2p-h200x4.jsonl``'s eager all-reduce is priced beside it as
   variant ``before``; the tables compare both on the points neither fit holds.
2. **The hardware comparison**: NVLink against host shared memory (``NCCL_P2P_DISABLE=1``)
   against sockets (``NCCL_SHM_DISABLE=1`` as well), measured in one launch
   (``transport-{nvlink,shm,socket}-h200x4.jsonl``: native, ring and direct all-reduce). Each transport is a
   topology (:mod:`dtrain.sim.transports`); native is the NCCL model above, ring and direct are dtrain's
   schedules replayed with the eager runtime's host costs fitted in ``benchmarks/sim/validate.py p2p-h200`` (read from
   ``sim_validation-p2p-summary-h200x4.jsonl``). NVLink gets no new figure. Shared memory and sockets get two
   each, fitted on
   every other size (1, 16, 256 MiB) and tested on the rest (4, 64, 1024 MiB):
   - shm: what host DRAM really delivers, and one connection's rate;
   - socket: one point-to-point connection's rate and one NCCL-kernel connection's rate (DRAM is far from
     full at socket rates, so a memory figure could not be fitted).
   A ``catalogue`` variant uses no fitted transport figure at all: what the data sheets alone predict.

Writes ``<prefix>-h200x4.jsonl`` (every point) and ``<prefix>-summary-h200x4.jsonl`` (fits, medians, worst
errors, orderings); ``--plot PNG`` draws busbw by transport.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dtrain.sim.api import simulate_collective
from dtrain.sim.collective import SoftwareCost
from dtrain.sim.nccl import LOCAL_OVER_CONNECTION, NcclParams, simulate_nccl
from dtrain.sim.nccl_fit import NcclPoint, coordinate_fit, fit_nccl
from dtrain.sim.transports import Transport

FIT_RUN = "collectives-direct-h200x4.jsonl"
BEFORE_RUN = "all_reduce-p2p-h200x4.jsonl"  # the previous figures' fit run (eager all-reduce)
NATIVE_RUNS = (FIT_RUN, BEFORE_RUN, "all_reduce-p2p-graphs-h200x4.jsonl", "collectives-p2p-h200x4.jsonl",
               "collectives-peer-graphs-h200x4.jsonl", "transport-nvlink-h200x4.jsonl")  # fmt: skip
TRANSPORT_ALGORITHMS = ("native", "ring", "direct")
KERNEL_BYTES = 16 << 20  # from here up the native kernel outlasts the host's call (measured: time > host time)
FIT_SIZES = {1 << 20, 16 << 20, 256 << 20}  # the transports' fit half; 4, 64 and 1024 MiB are held out
WORLD = 4


def rows(data: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]


def _record(part: str, variant: str, source: str, row: dict, algorithm: str, simulated_s: float, held_out: bool):
    return {
        "part": part,
        "variant": variant,
        "source": source,
        "held_out": held_out,
        "collective": row["collective"],
        "algorithm": algorithm,
        "nbytes": row["nbytes"],
        "measured_us": row["time_us"],
        "simulated_us": simulated_s * 1e6,
        "relative_error": simulated_s * 1e6 / row["time_us"] - 1,
        "device_name": row["device_name"],
    }


# ------------------------------------------------------------------------------------- 1: NCCL on NVLink


def _fit_rows(data: Path, name: str, collectives: tuple[str, ...]) -> list[dict]:
    return [r for r in rows(data, name) if r["algorithm"] == "native" and r["collective"] in collectives]


def fit_native(data: Path) -> dict[str, NcclParams]:
    """The model fitted on FIT_RUN's all-reduce and all-gather, and the previous figures (``before``)."""
    topo = Transport(name="nvlink").topology(WORLD)
    fits = {"fitted": (_fit_rows(data, FIT_RUN, ("all_reduce", "all_gather")), LOCAL_OVER_CONNECTION),
            "before": (_fit_rows(data, BEFORE_RUN, ("all_reduce",)), None)}  # fmt: skip
    return {variant: fit_nccl([NcclPoint(collective=r["collective"], nbytes=r["nbytes"], seconds=r["time_us"] * 1e-6)
                               for r in fit_rows], topo, local_per_connection=local)
            for variant, (fit_rows, local) in fits.items()}  # fmt: skip


def validate_native(data: Path, params: dict[str, NcclParams]) -> list[dict]:
    """Every native point (eager and CUDA-graph) of every run, simulated with each variant's figures; held out
    where neither fit holds it."""
    topo = Transport(name="nvlink").topology(WORLD)
    fitted = {(name, r["collective"], r["nbytes"], r["algorithm"], r["time_us"])
              for name, colls in ((FIT_RUN, ("all_reduce", "all_gather")), (BEFORE_RUN, ("all_reduce",)))
              for r in _fit_rows(data, name, colls)}  # fmt: skip
    out = []
    for variant, p in params.items():
        for name in NATIVE_RUNS:
            for r in rows(data, name):
                if r["algorithm"] not in ("native", "native+graph"):
                    continue
                sim = simulate_nccl(topo, r["collective"], r["nbytes"], params=p).time_s
                held = (name, r["collective"], r["nbytes"], r["algorithm"], r["time_us"]) not in fitted
                out.append(_record("nccl", variant, name, r, r["algorithm"], sim, held))
    return out


BANDS = (("1-16 MiB", 1 << 20, 16 << 20), (">= 16 MiB", 16 << 20, 1 << 62), (">= 64 MiB", 64 << 20, 1 << 62))


def print_native(records: list[dict], console: Console) -> None:
    """Median / worst |error| (points) per collective and size band, held-out native points, per variant."""
    for variant in ("fitted", "before"):
        table = Table(title=f"NCCL native, 4 x H200, held out from both fits: {variant}")
        for column in ("collective", *(b[0] for b in BANDS)):
            table.add_column(column)
        for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            sub = [r for r in records if r["part"] == "nccl" and r["variant"] == variant and r["held_out"]
                   and r["collective"] == coll]  # fmt: skip
            cells = []
            for _, lo, hi in BANDS:
                errs = [abs(r["relative_error"]) for r in sub if lo <= r["nbytes"] < hi]
                cells.append(f"{statistics.median(errs):.1%} / {max(errs):.1%} ({len(errs)})" if errs else "-")
            table.add_row(coll, *cells)
        console.print(table)


# ------------------------------------------------------------------------------------- 2: the transports


def eager_figures(data: Path) -> tuple[float, SoftwareCost]:
    """The NVLink link rate and the eager runtime's software costs fitted by benchmarks/sim/validate.py p2p-h200."""
    fit = json.loads((data / "sim_validation-p2p-summary-h200x4.jsonl").read_text().splitlines()[0])["fit"][
        "fitted-by-size"
    ]
    caps = tuple(tuple(pair) for pair in fit["message_caps"])
    cost = SoftwareCost(call_s=fit["call_s"], alpha_s=fit["alpha_s"], alpha_peer_s=fit["alpha_peer_s"],
                        gamma_s_per_byte=fit["gamma_s_per_byte"], message_caps=caps)  # fmt: skip
    return fit["link_bytes_per_s"], cost


def simulate_point(transport: Transport, algorithm: str, nbytes: int, native: NcclParams, eager: SoftwareCost):
    """One all-reduce on ``transport``: NCCL's kernel (native) or a dtrain schedule replayed (ring, direct)."""
    topo = transport.topology(WORLD)
    if algorithm == "native":
        if transport.kernel_cap is not None:
            native = replace(native, channel_bytes_per_s=transport.kernel_cap / native.channels)
        return simulate_nccl(topo, "all_reduce", nbytes, params=native).time_s
    if transport.name != "nvlink":  # NVLink's size-dependent caps are NCCL's P2P channels, not this transport's
        eager = replace(eager, message_caps=(), flow_cap_bytes_per_s=transport.connection_bytes_per_s)
    return simulate_collective(topo, "all_reduce", algorithm, nbytes, cost=eager, itemsize=4).time_s


def transport_rows(data: Path, name: str) -> list[dict]:
    return [r for r in rows(data, f"transport-{name}-h200x4.jsonl") if r["algorithm"] in TRANSPORT_ALGORITHMS]


def fit_transport(data: Path, name: str, native: NcclParams, eager: SoftwareCost) -> Transport:
    """Two figures of ``name`` fitted on the fit half of its sizes, every algorithm together."""
    fit_rows = [r for r in transport_rows(data, name) if r["nbytes"] in FIT_SIZES]
    fields = {"shm": ("memory_bytes_per_s", "connection_bytes_per_s"),
              "socket": ("connection_bytes_per_s", "kernel_connection_bytes_per_s")}[name]  # fmt: skip

    def loss(values: dict[str, float]) -> float:
        transport = Transport(name=name, **values)
        errors = [simulate_point(transport, r["algorithm"], r["nbytes"], native, eager) / (r["time_us"] * 1e-6)
                  for r in fit_rows]  # fmt: skip
        return sum(math.log(e) ** 2 for e in errors)

    # a grid of 16 (x1.58 a step): with 10 the shm fit settled in a worse valley (loss 0.48 against 0.43)
    values = coordinate_fit(loss, {f: 30e9 for f in fields}, {f: (1e9, 1e12) for f in fields}, grid=16)
    return Transport(name=name, **values)


def validate_transports(data: Path, native: NcclParams) -> tuple[list[dict], dict[str, dict[str, Transport]]]:
    link_rate, eager = eager_figures(data)
    models = {
        "nvlink": {"catalogue": Transport(name="nvlink"),
                   "fitted": Transport(name="nvlink", nvlink_bytes_per_s=link_rate)},
        "shm": {"catalogue": Transport(name="shm"), "fitted": fit_transport(data, "shm", native, eager)},
        "socket": {"catalogue": Transport(name="socket"), "fitted": fit_transport(data, "socket", native, eager)},
    }  # fmt: skip
    uncapped = replace(native, channel_bytes_per_s=None)
    out = []
    for name, variants in models.items():
        for variant, transport in variants.items():
            for r in transport_rows(data, name):
                # NVLink: the native figures were fitted on another run; catalogue: links only
                nccl = uncapped if variant == "catalogue" else native
                sim = simulate_point(transport, r["algorithm"], r["nbytes"], nccl, eager)
                held = name == "nvlink" or r["nbytes"] not in FIT_SIZES
                out.append(_record(f"transport-{name}", variant, name, r, r["algorithm"], sim, held))
    return out, models


# ------------------------------------------------------------------------------------- summaries


def _stats(errors: list[float]) -> dict:
    errors = [abs(e) for e in errors]
    return {"points": len(errors), "median_error": statistics.median(errors), "worst_error": max(errors)}


def summarise(records: list[dict]) -> list[dict]:
    """Median and worst |error| per (part, variant, source, collective, algorithm, band, fit/held)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        bands = ["all sizes"] + ([f">= {KERNEL_BYTES >> 20} MiB"] if r["nbytes"] >= KERNEL_BYTES else [])
        for band in bands:
            for alg in (r["algorithm"], "all"):
                key = (r["part"], r["variant"], r["source"], r["collective"], alg, band, r["held_out"])
                groups[key].append(r["relative_error"])
    keys = ("part", "variant", "source", "collective", "algorithm", "sizes", "held_out")
    return [{**dict(zip(keys, k, strict=True)), **_stats(v)} for k, v in sorted(groups.items(), key=str)]


def orderings(records: list[dict]) -> list[dict]:
    """For each size and algorithm measured on every transport: the transports fastest first, measured and
    simulated (fitted); and for each transport and size, the algorithms fastest first."""
    fitted = [r for r in records if r["part"].startswith("transport-") and r["variant"] == "fitted"]
    by_point = {(r["source"], r["algorithm"], r["nbytes"]): r for r in fitted}
    out = []
    for alg in TRANSPORT_ALGORITHMS:
        for nbytes in sorted({k[2] for k in by_point}):
            pts = [by_point[(t, alg, nbytes)] for t in ("nvlink", "shm", "socket") if (t, alg, nbytes) in by_point]
            if len(pts) > 1:
                out.append(_order("transports", alg, nbytes, pts, "source"))
    for transport in ("nvlink", "shm", "socket"):
        for nbytes in sorted({k[2] for k in by_point}):
            pts = [by_point[(transport, a, nbytes)] for a in TRANSPORT_ALGORITHMS if (transport, a, nbytes) in by_point]
            if len(pts) > 1:
                out.append(_order("algorithms", transport, nbytes, pts, "algorithm"))
    return out


def _order(kind: str, of: str, nbytes: int, pts: list[dict], field: str) -> dict:
    measured = [p[field] for p in sorted(pts, key=lambda p: p["measured_us"])]
    simulated = [p[field] for p in sorted(pts, key=lambda p: p["simulated_us"])]
    return {"order": kind, "of": of, "nbytes": nbytes, "measured": measured, "simulated": simulated,
            "same": measured == simulated}  # fmt: skip


def figures(params: dict[str, NcclParams], models: dict[str, dict[str, Transport]]) -> dict:
    out = {}
    for variant, key in (("fitted", "native"), ("before", "native/before")):
        out[key] = {k: v for k, v in vars(params[variant]).items() if v is not None}
        out[key]["connection_bytes_per_s"] = params[variant].connection_cap
    for name, variants in models.items():
        for variant, t in variants.items():
            out[f"{name}/{variant}"] = {**{k: v for k, v in vars(t).items() if v is not None},
                                        "host_hop_bytes_per_s": t.host_bytes_per_s}  # fmt: skip
    return out


def print_summary(summary: list[dict], console: Console) -> None:
    table = Table(title="simulated vs measured, 4 x H200: |simulated / measured - 1|")
    for column in ("part", "variant", "run", "collective", "algorithm", "sizes", "held out", "n", "median", "worst"):
        table.add_column(column)
    for s in summary:
        run = s["source"].removesuffix(".jsonl").removesuffix("-h200x4")
        table.add_row(s["part"], s["variant"], run, s["collective"], s["algorithm"], s["sizes"], str(s["held_out"]),
                      str(s["points"]), f"{s['median_error']:.1%}", f"{s['worst_error']:.0%}")  # fmt: skip
    console.print(table)


def plot(records: list[dict], path: Path) -> None:
    """Bus bandwidth against size per transport: measured points, simulated (fitted) lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, transport in zip(axes, ("nvlink", "shm", "socket"), strict=True):
        for alg, colour in zip(TRANSPORT_ALGORITHMS, ("C0", "C1", "C2"), strict=True):
            pts = sorted((r for r in records if r["part"] == f"transport-{transport}" and r["variant"] == "fitted"
                          and r["algorithm"] == alg), key=lambda r: r["nbytes"])  # fmt: skip
            if not pts:
                continue
            sizes = [r["nbytes"] for r in pts]
            bus = [1.5 * n / 1e9 for n in sizes]  # all-reduce busbw factor 2(n-1)/n on 4 ranks, in GB
            ax.plot(sizes, [b / (r["measured_us"] * 1e-6) for b, r in zip(bus, pts, strict=True)], "o", color=colour,
                    label=f"{alg} measured")  # fmt: skip
            ax.plot(sizes, [b / (r["simulated_us"] * 1e-6) for b, r in zip(bus, pts, strict=True)], "-", color=colour,
                    label=f"{alg} simulated")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="all-reduce bytes", title=transport)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("bus bandwidth (GB/s)")
    fig.suptitle("4 x H200 all-reduce by transport: measured (points) and dtrain.sim (lines)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--out-prefix", default="benchmarks/results/sim_validation-transports")
    parser.add_argument("--plot", type=Path, default=None, help="also draw busbw by transport to this PNG")
    args = parser.parse_args()
    console = Console(width=160)
    params = fit_native(args.data)
    native = params["fitted"]
    records = validate_native(args.data, params)
    transport_records, models = validate_transports(args.data, native)
    records += transport_records
    summary = summarise(records)
    order = orderings(records)
    fit = figures(params, models)
    Path(f"{args.out_prefix}-h200x4.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = [{"fit": fit}, *summary, *order]
    Path(f"{args.out_prefix}-summary-h200x4.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines))
    if args.plot:
        plot(records, args.plot)
    print_summary(summary, console)
    print_native(records, console)
    console.print(json.dumps(fit, indent=1))
    for o in order:
        console.print(f"{o['order']} for {o['of']} at {o['nbytes'] >> 20} MiB: measured {o['measured']}, "
                      f"simulated {o['simulated']}{'' if o['same'] else '  <- differs'}")  # fmt: skip


if __name__ == "__main__":
    main()
