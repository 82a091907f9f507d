"""Usage: python benchmarks/sim/validate.py captured [--out benchmarks/results/sim_validation-captured.jsonl]

The simulator against calls captured whole as CUDA graphs (the devices' time): every collective and algorithm,
dtrain's and NCCL's, 1 MiB-1 GiB, on 4 x H200 (four processes, two launches) and 4 x H100 (one process).

- dtrain's algorithms: ``PeerCost.port_bytes_per_s`` (what one GPU's port carries, one direction, shared by
  every transfer through it between two barriers), ``lone_fanin_bytes_per_s`` (a pass reading three peers while
  nobody reads this rank) and ``fanin_curve`` (every rank reading every peer: the rate by the bytes read). The
  port and lone fan-in rates come from ``benchmarks/collectives/probe.py port`` on 4 x H100 (two runs of one
  launch); the H200 takes them too, having the same NVLink 4 switch fabric (18 links a GPU). The H200's fan-in
  curve is its symm probe's (``pull sum4 triton``), the H100's the port probe's (``sum 3 all``).
- NCCL: gather and scatter (grouped point-to-point) and reduce (a ring chain ending at the root) have their own
  model in dtrain.sim.nccl.
- 4 x H100 is priced with nothing fitted on it: the H100's rates from its micro-benchmarks, and the GPU fixed
  times and NCCL's figures fitted on the H200's fit process.

Fitted: the GPU fixed times on the fit process's calls of 256 KiB or less, NCCL's figures on its NCCL calls;
the other three H200 processes and the H100 run are held out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import captured_base as s6  # noqa: E402
import peer_h100 as h100  # noqa: E402

from dtrain.sim.nccl import LOCAL_OVER_CONNECTION, NcclParams, simulate_nccl  # noqa: E402
from dtrain.sim.nccl_fit import NcclPoint, fit_nccl  # noqa: E402
from dtrain.sim.peer_model import PeerCost  # noqa: E402
from dtrain.sim.transports import Transport  # noqa: E402

DATA = s6.DATA
MIB = s6.MIB
PORT_RUNS = ("port-h100x4-run1.jsonl", "port-h100x4-run2.jsonl")  # benchmarks/collectives/probe.py port, 4 x H100
H100_RUNS = {"captured-symmetric-h100x4.jsonl": "H100, launch 1", "captured-rooted-h100x4.jsonl": "H100, launch 1"}
#: NCCL's collectives the NCCL model prices (all eight)
NCCL_PRICED = s6.COLLS


def _port_records() -> list[dict]:
    return [json.loads(line) for name in PORT_RUNS for line in (DATA / name).read_text().splitlines()]


def port_figures(min_flow: int = 16 * MIB) -> dict[str, float]:
    """The port rate (three readers of one GPU, three pushes into one: the median over flows of ``min_flow`` or
    more) and the lone fan-in rate (one rank summing three peers' blocks), in bytes per second."""
    recs = [r for r in _port_records() if r["flow_bytes"] >= min_flow]
    port = statistics.median(r["port_gbps"] for r in recs if r["pattern"] in ("fan-out read", "fan-in push"))
    lone = statistics.median(r["port_gbps"] for r in recs if r["pattern"] == "sum 3 lone")
    return {"port_bytes_per_s": port * 1e9, "lone_fanin_bytes_per_s": lone * 1e9}


def h100_fanin_curve(min_flow: int = 16 * MIB) -> tuple[tuple[float, float], ...]:
    """Every rank summing three peers' blocks at once: (bytes one rank reads, the rate), the median of the runs."""
    by: dict[int, list[float]] = {}
    for r in _port_records():
        if r["pattern"] == "sum 3 all" and r["flow_bytes"] >= min_flow:
            by.setdefault(3 * r["flow_bytes"], []).append(r["port_gbps"] * 1e9)
    return tuple((float(b), statistics.median(v)) for b, v in sorted(by.items()))


def h200_fanin_curve() -> tuple[tuple[float, float], ...]:
    """The H200's symm probe, every rank summing three peers' quarters of a buffer: (bytes read, rate) from a
    64 MiB buffer up (below, a pass's fixed time, priced apart, would be counted twice)."""
    points = []
    for mib in (64, 256, 1024):
        read = 3 * mib * MIB // 4
        us = h100._line(s6.PROBE_H200, rf"^\s*{mib} MiB\s+pull sum4 triton\s+([\d.]+) us")
        points.append((float(read), read / (us * 1e-6)))
    return tuple(points)


def with_ports(cost: PeerCost, curve: tuple[tuple[float, float], ...]) -> PeerCost:
    return replace(cost, **port_figures(), fanin_curve=curve)


def nccl_rows(records: list[dict], runs: dict[str, str], fit_process: str | None, copy_bytes_per_s: float,
              params: NcclParams | None = None, base: NcclParams | None = None,
              ) -> tuple[NcclParams, list[dict]]:  # fmt: skip
    """NCCL's own calls captured as graphs (``native+graph``), every collective priced by dtrain.sim.nccl in the
    protocol NCCL chose (its tuning log; gather and scatter, point-to-point, in Simple from 1 MiB). ``params``:
    given, priced with them; else fitted on ``fit_process``'s calls, and then the reduce's
    efficiency on its reduces in Simple. ``copy_bytes_per_s``: the node's device-to-device copy (the peer
    calibration's local rate), for torch's copy of a gather's or scatter's root block."""
    topo = Transport(name="nvlink").topology(4)
    table = s6.nccl_protocols()
    native = [r for r in records if r["algorithm"] == "native+graph" and r["collective"] in NCCL_PRICED]
    for r in native:
        r["protocol"] = s6._protocol(table, r["collective"], r["nbytes"])

    def price(r: dict, p: NcclParams) -> float:
        proto = r["protocol"] if r["nbytes"] >= MIB else "simple"
        return simulate_nccl(topo, r["collective"], r["nbytes"], params=p, protocol=proto, root=0).time_s

    if params is None:
        fitting = [r for r in native if runs[r["run"]] == fit_process]
        ring = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")  # the fit set
        simple = [NcclPoint(collective=r["collective"], nbytes=r["nbytes"], seconds=r["time_us"] * 1e-6)
                  for r in fitting
                  if r["collective"] in ring and (r["protocol"] == "simple" or r["nbytes"] <= 64 << 10)]  # fmt: skip
        params = fit_nccl(simple, topo, base=base or NcclParams(chunk_depth=4), host_max_bytes=64 << 10,
                          local_per_connection=LOCAL_OVER_CONNECTION)  # fmt: skip
        params = replace(params, self_copy_bytes_per_s=copy_bytes_per_s)
        for proto, field in (("ll", "ll_launch_s"), ("ll128", "ll128_launch_s")):
            points = [r for r in fitting if r["protocol"] == proto and r["nbytes"] >= MIB and r["collective"] in ring]
            if points:
                grid = np.arange(0.0, 40e-6, 0.5e-6)
                loss = [sum(np.log(price(r, replace(params, **{field: g})) / (r["time_us"] * 1e-6)) ** 2
                            for r in points) for g in grid]  # fmt: skip
                params = replace(params, **{field: float(grid[int(np.argmin(loss))])})
        ll = [r for r in fitting if r["protocol"] == "ll" and r["nbytes"] >= MIB and r["collective"] in ring]
        grid2 = [(a, e) for a in np.arange(0.0, 30e-6, 1e-6) for e in np.linspace(0.1, 0.5, 41)]
        loss = [sum(np.log(price(r, replace(params, ll_launch_s=float(a), ll_efficiency=float(e)))
                           / (r["time_us"] * 1e-6)) ** 2 for r in ll) for a, e in grid2]  # fmt: skip
        a, e = grid2[int(np.argmin(loss))]
        params = replace(params, ll_launch_s=float(a), ll_efficiency=float(e))
        p2p = [r for r in fitting if r["collective"] in ("gather", "scatter", "all_to_all") and r["nbytes"] >= MIB
               and r["protocol"] == "simple"]  # fmt: skip
        grid = np.arange(0.0, 40e-6, 0.5e-6)
        loss = [sum(np.log(price(r, replace(params, p2p_launch_s=float(g))) / (r["time_us"] * 1e-6)) ** 2
                    for r in p2p) for g in grid]  # fmt: skip
        params = replace(params, p2p_launch_s=float(grid[int(np.argmin(loss))]))
        points = [
            r for r in fitting if r["collective"] == "reduce" and r["protocol"] == "simple" and r["nbytes"] >= MIB
        ]
        grid = np.linspace(0.5, 1.0, 51)
        loss = [sum(np.log(price(r, replace(params, reduce_efficiency=float(g))) / (r["time_us"] * 1e-6)) ** 2
                    for r in points) for g in grid]  # fmt: skip
        params = replace(params, reduce_efficiency=float(grid[int(np.argmin(loss))]))
    else:
        params = replace(params, self_copy_bytes_per_s=copy_bytes_per_s)
    rows = []
    for r in native:
        pred = price(r, params) * 1e6
        rows.append({"run": r["run"], "process": runs[r["run"]], "collective": r["collective"],
                     "algorithm": "native+graph", "resolved": "native", "protocol": r["protocol"],
                     "nbytes": r["nbytes"], "measured_us": r["time_us"], "predicted_us": pred,
                     "error": pred / r["time_us"] - 1})  # fmt: skip
    return params, rows


def _ours(records: list[dict], cost: PeerCost, runs: dict[str, str]) -> list[dict]:
    return [{**s6._peer_row(r, cost, graph=True), "process": runs[r["run"]]} for r in records
            if r["algorithm"].endswith("+graph") and not r["algorithm"].startswith("native")]  # fmt: skip


def _rates(cost: PeerCost) -> str:
    names = ("pair_bytes_per_s", "peer_copy_bytes_per_s", "fanin_bytes_per_s", "local_bytes_per_s",
             "push_bytes_per_s", "port_bytes_per_s", "lone_fanin_bytes_per_s")  # fmt: skip
    out = ", ".join(f"{k.removesuffix('_bytes_per_s')} {getattr(cost, k) / 1e9:.0f}" for k in names
                    if getattr(cost, k) is not None)  # fmt: skip
    curve = ", ".join(f"{b / MIB:.0f} MiB {r / 1e9:.0f}" for b, r in cost.fanin_curve)
    return f"{out} GB/s; fan-in curve (read: rate) {curve or '-'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    h200_records = [r for name in s6.GRAPH_RUNS for r in s6._records(name)]
    h100_records = [r for name in H100_RUNS for r in s6._records(name)]
    ours_h200 = [
        r for r in h200_records if r["algorithm"].endswith("+graph") and not r["algorithm"].startswith("native")
    ]

    h200 = with_ports(s6.h200_calibration(), h200_fanin_curve())
    fit_set = [r for r in ours_h200 if s6.GRAPH_RUNS[r["run"]] == s6.FIT_PROCESS and r["nbytes"] <= 256 << 10]
    h200 = s6.fit_fixed(fit_set, h200)
    print(f"4 x H200: {_rates(h200)}")
    print(f"fitted on {len(fit_set)} +graph calls of <= 256 KiB ({s6.FIT_PROCESS}): barrier {h200.barrier_s * 1e6:.2f}"
          f" us, operation {h200.gpu_op_s * 1e6:.2f} us, peer copy {h200.gpu_peer_copy_s * 1e6:.2f} us")  # fmt: skip
    rows = _ours(h200_records, h200, s6.GRAPH_RUNS)
    held = [r for r in rows if r["process"] != s6.FIT_PROCESS]
    s6._table("dtrain's algorithms, +graph, 4 x H200, the three held-out processes, per collective", held,
              lambda r: r["collective"], s6.COLLS)  # fmt: skip
    algos = ["direct", "recursive_doubling", "halving_doubling", "tree", "hierarchical", "ring", "star"]
    s6._table("the same, per algorithm", held, lambda r: r["resolved"], algos)
    worst = sorted(held, key=lambda r: -abs(r["error"]))[:10]
    print("\nlargest: " + "; ".join(f"{r['collective']} {r['resolved']} {r['nbytes'] >> 20} MiB {r['measured_us']:.0f}"
                                    f" us {r['error']:+.0%}" for r in worst))  # fmt: skip

    h100_cost, _ = h100._calibration()
    fixed = {k: getattr(h200, k) for k in ("barrier_s", "gpu_op_s", "gpu_peer_copy_s")}
    h100_cost = replace(with_ports(h100_cost, h100_fanin_curve()), **fixed)
    print(f"\n4 x H100: {_rates(h100_cost)}; the H200's fixed times")
    rows_h100 = _ours(h100_records, h100_cost, H100_RUNS)
    s6._table("dtrain's algorithms, +graph, 4 x H100 (nothing fitted on it), per collective", rows_h100,
              lambda r: r["collective"], s6.COLLS)  # fmt: skip
    s6._table("the same, per algorithm", rows_h100, lambda r: r["resolved"], algos)

    params, native = nccl_rows(h200_records, s6.GRAPH_RUNS, s6.FIT_PROCESS, h200.local_bytes_per_s)
    print(f"\nNCCL model fitted on {s6.FIT_PROCESS}'s native+graph calls: connection "
          f"{params.connection_cap / 1e9:.1f} GB/s, launch {params.launch_s * 1e6:.1f} us, step "
          f"{params.step_latency_s * 1e6:.2f} us, floor {params.host_s * 1e6:.1f} us, LL launch "
          f"{params.ll_launch_s * 1e6:.1f} us, LL efficiency {params.ll_efficiency:.2f}, LL128 launch "
          f"{params.ll128_launch_s * 1e6:.1f} us, point-to-point launch {params.p2p_launch_s * 1e6:.1f} us, reduce "
          f"efficiency {params.reduce_efficiency:.2f}")  # fmt: skip
    held_native = [r for r in native if r["process"] != s6.FIT_PROCESS]
    s6._table("NCCL, native+graph, 4 x H200, the three held-out processes, per collective", held_native,
              lambda r: r["collective"], NCCL_PRICED)  # fmt: skip
    _, native_h100 = nccl_rows(h100_records, H100_RUNS, None, h100_cost.local_bytes_per_s, params=params)
    s6._table("NCCL, native+graph, 4 x H100, the H200's NCCL figures, per collective", native_h100,
              lambda r: r["collective"], NCCL_PRICED)  # fmt: skip
    if args.out:
        with args.out.open("w") as f:
            for r in rows + rows_h100 + native + native_h100:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
