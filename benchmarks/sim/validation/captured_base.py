"""Usage: (a module: imported by the ``captured`` suite, ``python benchmarks/sim/validate.py captured``)

The shared part of the ``captured`` suite: records, the 4 x H200 calibration, pricing and fitting of the
captured calls (``benchmarks/sim/validate.py captured`` runs it).

Runs (``benchmarks/gpu/run.sh captured``): on 4 x H200, four processes of two launches that time every
collective (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, reduce, gather, scatter) and every
algorithm, NCCL's included, each call also captured whole as a CUDA graph and replayed (``+graph``: the
devices' time, the API's Python out of the loop): ``captured-{symmetric,rooted}-h200x4-run{1..4}.jsonl``.

dtrain's algorithms are priced by dtrain.sim.peer_model with each node's calibration from its micro-benchmarks
(H100: ``peer_h100._calibration``; H200: :func:`h200_calibration`, from ``probe-symm-h200x4.txt`` and
``probe-pull-kernel-h200x4.txt``), with the API's own operations (dtrain.sim.api_passes) and, from 64 MiB, the
push form where the runtime takes it. A ``+graph`` call costs the larger of its GPU time and the host's bare
``graph.replay()``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_h100 as h100  # noqa: E402

from dtrain.comm.cost import model as comm_cost  # noqa: E402
from dtrain.comm.ir import algorithms as registry  # noqa: E402
from dtrain.comm.ir.schedule import Collective  # noqa: E402
from dtrain.comm.peer.push import has_push_form, writes_own_block_only  # noqa: E402
from dtrain.comm.peer.window import PUSH_FROM_BYTES  # noqa: E402
from dtrain.sim.api_passes import api_passes  # noqa: E402
from dtrain.sim.nccl import LOCAL_OVER_CONNECTION, NcclParams, simulate_nccl  # noqa: E402
from dtrain.sim.nccl_fit import NcclPoint, fit_nccl  # noqa: E402
from dtrain.sim.peer_model import PeerCost, peer_time  # noqa: E402
from dtrain.sim.transports import Transport  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "results"
MIB = 1 << 20
COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter")
ROOTED = {"broadcast": 0, "reduce": 0, "gather": 0, "scatter": 0}
GRAPH_RUNS = {  # file: (launch, process) on 4 x H200
    "captured-symmetric-h200x4-run1.jsonl": "launch 1, process 1",
    "captured-rooted-h200x4-run1.jsonl": "launch 1, process 1",
    "captured-symmetric-h200x4-run2.jsonl": "launch 1, process 2",
    "captured-symmetric-h200x4-run3.jsonl": "launch 2, process 1",
    "captured-rooted-h200x4-run3.jsonl": "launch 2, process 1",
    "captured-symmetric-h200x4-run4.jsonl": "launch 2, process 2",
    "captured-rooted-h200x4-run4.jsonl": "launch 2, process 2",
}  # fmt: skip
FIT_PROCESS = "launch 1, process 1"
TUNING_LOG = "nccl_tuning-h200x4.txt"  # NCCL 2.28.9's picks on this node (the H100's log is the same)
PROBE_H200 = "probe-symm-h200x4.txt"  # benchmarks/collectives/probe.py symm, 4 x H200
PUSH_H200 = "probe-pull-kernel-h200x4.txt"  # benchmarks/collectives/probe.py pull-kernel, 4 x H200
BANDS = (("1-16 MiB", MIB, 16 * MIB), (">= 16 MiB", 16 * MIB, 1 << 62), ("1 MiB-1 GiB", MIB, 1 << 62))
#: host time of a bare ``graph.replay()`` (probe.py replay-host, 4 x H100): what a ``+graph`` call
#: costs the host
BARE_REPLAY_S = 8.6e-6
#: NCCL's collectives the NCCL model prices, and as what
NCCL_PRICED = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
               "all_to_all": "all_to_all", "broadcast": "broadcast", "reduce": "broadcast"}  # fmt: skip


def _schedule(coll: str, algorithm: str, world: int, nbytes: int):
    pipeline = 1
    if algorithm == "ring" and coll in ("broadcast", "reduce"):  # the runtime's choice (api._pipeline)
        pipeline = comm_cost.optimal_pipeline(nbytes, world, comm_cost.default_params("cuda").intra)
    local = world if registry.needs_local_size(algorithm) else None  # torchrun's LOCAL_WORLD_SIZE: one node
    return registry.build(Collective(coll), algorithm, world, root=ROOTED.get(coll), pipeline=pipeline,
                          local_size=local)  # fmt: skip


def h200_calibration() -> PeerCost:
    """4 x H200's rates from its micro-benchmarks, each the slope between two sizes of one probe line
    (a pass's fixed time is left to the fit of :func:`fit_fixed`): the pull (a reduction) and the plain copy out
    of one peer, the push, the local copy; the fan-in at 64 MiB (3 x 16 MiB read at once)."""

    def symm(mib: int, label: str) -> float:
        return h100._line(PROBE_H200, rf"^\s*{mib} MiB\s+{re.escape(label)}\s+([\d.]+) us") * 1e-6

    def push(mib: int) -> float:
        return h100._line(PUSH_H200, rf"^\s*{mib} MiB push\s+4096/\s*4\s+([\d.]+) us") * 1e-6

    def slope(label: str, small: int = 64, large: int = 1024, read: float = 0.25) -> tuple[float, float]:
        a, b = symm(small, label), symm(large, label)
        rate = (large - small) * read * MIB / (b - a)
        return rate, a - small * read * MIB / rate

    pull, copy = slope("pull add 1 peer (chunk)"), slope("pull copy 1 peer (chunk)")
    local = slope("local copy", 16, 256, 1.0)
    push_rate = (256 - 16) * MIB / (push(256) - push(16))
    return PeerCost(
        pair_bytes_per_s=pull[0],
        peer_copy_bytes_per_s=copy[0],
        fanin_bytes_per_s=48 * MIB / (symm(64, "pull sum4 triton") - pull[1]),
        local_bytes_per_s=local[0],
        push_bytes_per_s=push_rate,
        barrier_s=0.0,
    )


def _records(name: str) -> list[dict]:
    return [{**json.loads(line), "run": name} for line in (DATA / name).read_text().splitlines()]


def _peer_row(r: dict, cost: PeerCost, graph: bool) -> dict:
    coll, n = r["collective"], r["nbytes"]
    algorithm = r["resolved_algorithm"].removesuffix("+graph")
    schedule = _schedule(coll, algorithm, r["world_size"], n)
    push = n >= PUSH_FROM_BYTES and has_push_form(schedule)
    own = coll == "reduce_scatter" and push and writes_own_block_only(schedule, n // 4)
    t = peer_time(schedule, n, cost, replayed=True, push=push, api=api_passes(schedule, n, out_of_place=own))
    predicted = max(t.gpu_s, BARE_REPLAY_S) if graph else t.time_s
    return {"run": r["run"], "collective": coll, "algorithm": r["algorithm"], "resolved": algorithm, "nbytes": n,
            "measured_us": r["time_us"], "host_measured_us": r.get("host_us"), "predicted_us": predicted * 1e6,
            "gpu_us": t.gpu_s * 1e6, "error": predicted * 1e6 / r["time_us"] - 1}  # fmt: skip


def fit_fixed(records: list[dict], cost: PeerCost) -> PeerCost:
    """The GPU's fixed times, ``barrier_s``, ``gpu_op_s`` and ``gpu_peer_copy_s``, by least squares on the
    relative error of ``+graph`` calls (whose bytes hardly count): the model is linear in them (each phase's
    slowest rank aside), so four evaluations give each point's coefficients."""
    zero = replace(cost, barrier_s=0.0, gpu_op_s=0.0, gpu_peer_copy_s=0.0)
    terms = ("barrier_s", "gpu_op_s", "gpu_peer_copy_s")
    a, b = [], []
    for r in records:
        base = _peer_row(r, zero, graph=True)["gpu_us"]
        t = r["time_us"]
        a.append([(_peer_row(r, replace(zero, **{k: 1e-6}), graph=True)["gpu_us"] - base) / t for k in terms])
        b.append((t - base) / t)
    coef, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return replace(cost, **{k: max(float(c), 0.0) * 1e-6 for k, c in zip(terms, coef, strict=True)})


def nccl_protocols(name: str = TUNING_LOG) -> dict[tuple[str, int], str]:
    """NCCL's protocol per (collective, bytes NCCL counts), read from its ``NCCL_DEBUG_SUBSYS=TUNING`` lines
    ("AllReduce: 1048576 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..23}")."""
    names = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
             "Broadcast": "broadcast", "Reduce": "reduce"}  # fmt: skip
    out = {}
    for line in (DATA / name).read_text().splitlines():
        found = re.search(r"(\w+): (\d+) Bytes -> Algo \w+ proto (\w+)", line)
        if found and found.group(1) in names:
            out[(names[found.group(1)], int(found.group(2)))] = found.group(3).lower()
    return out


def _protocol(table: dict, collective: str, nbytes: int) -> str:
    counted = nbytes // 4 if collective in ("all_gather", "reduce_scatter") else nbytes  # NCCL counts a rank's part
    return table.get((collective, counted), "simple")  # all-to-all: grouped point-to-point, Simple from 1 MiB


def nccl_rows(graphs: list[dict]) -> tuple[NcclParams, list[dict]]:
    """NCCL's own calls captured as graphs (``native+graph``), priced by dtrain.sim.nccl in the protocol NCCL
    chose for each (its tuning log): ``fit_nccl`` on the fit process's Simple calls, then the LL and LL128
    kernels' start on its LL / LL128 calls of 1 MiB and more (full channels). A reduce is priced as the
    broadcast's chain run backwards (the same sends); gather and scatter are not modelled."""
    topo = Transport(name="nvlink").topology(4)
    table = nccl_protocols()
    native = [r for r in graphs if r["algorithm"] == "native+graph" and r["collective"] in NCCL_PRICED]
    for r in native:
        r["protocol"] = _protocol(table, r["collective"], r["nbytes"])
    fitting = [r for r in native if GRAPH_RUNS[r["run"]] == FIT_PROCESS]
    simple = [NcclPoint(collective=NCCL_PRICED[r["collective"]], nbytes=r["nbytes"], seconds=r["time_us"] * 1e-6)
              for r in fitting if r["protocol"] == "simple" or r["nbytes"] <= 64 << 10]  # fmt: skip
    base = NcclParams(chunk_depth=4)  # NCCL's smaller chunks for smaller calls
    params = fit_nccl(simple, topo, base=base, host_max_bytes=64 << 10, local_per_connection=LOCAL_OVER_CONNECTION)

    def price(r: dict, p: NcclParams) -> float:
        proto = r["protocol"] if r["nbytes"] >= MIB else "simple"  # below 1 MiB NCCL also cuts channels: unmodelled
        return simulate_nccl(topo, NCCL_PRICED[r["collective"]], r["nbytes"], params=p, protocol=proto).time_s

    for proto, field in (("ll", "ll_launch_s"), ("ll128", "ll128_launch_s")):
        points = [r for r in fitting if r["protocol"] == proto and r["nbytes"] >= MIB]
        if points:
            grid = np.arange(0.0, 40e-6, 0.5e-6)
            loss = [sum(np.log(price(r, replace(params, **{field: g})) / (r["time_us"] * 1e-6)) ** 2 for r in points)
                    for g in grid]  # fmt: skip
            params = replace(params, **{field: float(grid[int(np.argmin(loss))])})
    rows = []
    for r in native:
        pred = price(r, params) * 1e6
        rows.append({"run": r["run"], "process": GRAPH_RUNS[r["run"]], "collective": r["collective"],
                     "algorithm": "native+graph", "resolved": "native", "protocol": r["protocol"],
                     "nbytes": r["nbytes"], "measured_us": r["time_us"], "predicted_us": pred,
                     "error": pred / r["time_us"] - 1})  # fmt: skip
    return params, rows


def _cell(rows: list[dict]) -> str:
    if not rows:
        return "-"
    errs = [abs(r["error"]) for r in rows]
    return f"{statistics.median(errs):.1%} / {max(errs):.1%} ({len(rows)})"


def _table(title: str, rows: list[dict], key, keys) -> None:
    print(f"\n{title}\n\n| | " + " | ".join(b[0] for b in BANDS) + " |\n|" + "---|" * (len(BANDS) + 1))
    for k, sub in [(k, [r for r in rows if key(r) == k]) for k in keys] + [("all", rows)]:
        print(f"| {k} | " + " | ".join(_cell([r for r in sub if lo <= r["nbytes"] < hi]) for _, lo, hi in BANDS) + " |")
