"""Usage: python benchmarks/sim/validate.py peer-h100 [--out FILE]

Validate the peer-transport model (dtrain.sim.peer_model) against 4 x H100 runs of dtrain's defaults.

    python benchmarks/sim/validate.py peer-h100 --out benchmarks/results/sim_validation-peer-h100x4.jsonl

A CUDA group of one host runs dtrain's algorithms on the peer transport with graph replays, in
the push form from ``PUSH_FROM_BYTES`` (64 MiB) where the schedule has one. Every GPU figure of the model comes
from the micro-benchmarks of that machine, read from their output in benchmarks/results (``_calibration`` names the
line of each); none from the sweeps tested here:

- ``probe-symm-h100x4.txt`` (benchmarks/collectives/probe.py symm): the pull rate and a kernel's fixed GPU time from
  "pull add 1 peer (chunk)" at 64 MiB and 1 GiB (a 16 MiB and a 256 MiB read), the local copy rate from "local
  copy" at 16 MiB and 256 MiB, the fan-in rate from "pull sum4 triton" at 64 MiB (3 x 16 MiB read at once);
- ``probe-pull-kernel-h100x4.txt`` (benchmarks/collectives/probe.py pull-kernel): the push rate from "push 4096/ 4"
  (the runtime's block of 4096 and Triton's 4 warps) at 16 MiB and 256 MiB;
- ``probe-peer-host-h100x4.txt`` (benchmarks/collectives/probe.py peer-host): the device barrier, fitted to the four
  "+graph 16 KiB" replays (GPU time, nearly no bytes); the host's time for a torch operation, a Triton launch,
  a barrier and NCCL's own call. Its "+graph 65536 KiB" replays are held out.

A pass of ``b`` bytes costs ``gpu_op_s + b / rate`` (``PeerCost.gpu_op_s``): the probes' times at two sizes give
both, and a 16 MiB pass runs 8-19% below the rate of a 256 MiB one ("two sizes"). The "one size" variant
prices with the rates of 16 MiB passes and no ``gpu_op_s``, as ``validate.py peer-h200`` calibrates 4 x H200.

Fitted: only the host time of a replayed call (``host_replay_s``), on the <= 1 MiB replays of ONE sweep, the
default all-reduce's (``all_reduce-h100x4.jsonl``: 3 all-reduces of 1 MiB). Held out: every other point
of the eight sweeps (all-reduce, all-gather, reduce-scatter, all-to-all, 1 MiB-1 GiB, replayed, and one eager
all-reduce sweep), each priced as the runtime ran it, with the API's own operations (dtrain.sim.api_passes).
``auto`` rows are priced as the algorithm they resolved to and reported apart.

NCCL's own (``native``) points, those of the eight sweeps and of five runs that timed reduce-scatter and
all-reduce at 4-64 MiB (``NATIVE_ONLY``), are priced with dtrain.sim.nccl: its four figures fitted with
``fit_nccl`` on ONE run, run 3's first launch (``NCCL_FIT_SWEEP``: all-reduce, all-gather and reduce-scatter,
1 MiB-1 GiB), the local copy at ``LOCAL_OVER_CONNECTION`` times the connection rate. Two variants show what
each part does: the same fit without the copy, and a fit without the copy on the fit sweep's
all-reduce alone. All three are tested on the native points that neither
fit run holds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.peer.push import has_push_form
from dtrain.comm.peer.window import PUSH_FROM_BYTES
from dtrain.sim.api_passes import api_passes
from dtrain.sim.nccl import LOCAL_OVER_CONNECTION, NcclParams, simulate_nccl
from dtrain.sim.nccl_fit import NcclPoint, fit_nccl
from dtrain.sim.peer_model import PeerCost, fit_peer_cost, peer_time
from dtrain.sim.transports import Transport

DATA = Path(__file__).resolve().parents[2] / "results"
MIB = 1 << 20
FIT_SWEEP = "all_reduce-h100x4.jsonl"
SWEEPS = {  # file: what it is
    "all_reduce-model-h100x4.jsonl": "run 1, all-reduce, no rules",
    "all_reduce-rules-h100x4.jsonl": "run 2, all-reduce, rules of run 1",
    "ar_ag_rs-h100x4-run1.jsonl": "run 3, launch 1, three collectives",
    "ar_ag_rs-h100x4-run2.jsonl": "run 3, launch 2, three collectives",
    "rs_ag_a2a-h100x4.jsonl": "run 2, reduce-scatter, all-gather, all-to-all",
    "all_reduce-builtin_rule-h100x4.jsonl": "run 4, all-reduce, built-in rule",
    FIT_SWEEP: "all-reduce, built-in rule, the fit sweep",
    "all_reduce-eager-h100x4.jsonl": "run 1, all-reduce, eager (PERSISTENT=0)",
}
NCCL_FIT_SWEEP = "ar_ag_rs-h100x4-run1.jsonl"
NATIVE_ONLY = ("rs_ar-h100x4.jsonl", "reduce_scatter-h100x4-run1.jsonl", "reduce_scatter-h100x4-run2.jsonl",
               "all_reduce-pull-h100x4.jsonl", "all_reduce-push-h100x4.jsonl")  # fmt: skip
ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling", "direct")
BANDS = (("< 16 MiB", 0, 16 * MIB), (">= 16 MiB", 16 * MIB, 1 << 62), (">= 64 MiB", 64 * MIB, 1 << 62))


def _line(name: str, pattern: str, group: int = 1) -> float:
    """The number ``pattern``'s group captures on the first line of ``benchmarks/results/name`` it matches."""
    for line in (DATA / name).read_text().splitlines():
        found = re.search(pattern, line)
        if found:
            return float(found.group(group))
    raise ValueError(f"no line of {name} matches {pattern!r}")


def _symm(mib: int, label: str) -> float:
    return _line("probe-symm-h100x4.txt", rf"^\s*{mib} MiB\s+{re.escape(label)}\s+([\d.]+) us") * 1e-6


def _host_probe(label: str, gpu: bool = False) -> float:
    pattern = rf"^{re.escape(label)}\s+host\s+([\d.]+) us/call\s+gpu\s+([\d.]+) us/call"
    return _line("probe-peer-host-h100x4.txt", pattern, 2 if gpu else 1) * 1e-6


def _two_sizes(nbytes_a: float, seconds_a: float, nbytes_b: float, seconds_b: float) -> tuple[float, float]:
    """(rate, fixed time) of a pass timed at two sizes: ``seconds = fixed + nbytes / rate``."""
    rate = (nbytes_b - nbytes_a) / (seconds_b - seconds_a)
    return rate, seconds_a - nbytes_a / rate


def _calibration(one_size: bool = False) -> tuple[PeerCost, dict]:
    """The H100 node's PeerCost from the micro-benchmarks alone, and the fixed times a pass showed."""
    push_line = r"^\s*{} MiB push\s+4096/\s*4\s+([\d.]+) us"
    push_16, push_256 = (_line("probe-pull-kernel-h100x4.txt", push_line.format(m)) * 1e-6 for m in (16, 256))
    pull_16, pull_256 = _symm(64, "pull add 1 peer (chunk)"), _symm(1024, "pull add 1 peer (chunk)")  # 1/4 read
    pull = _two_sizes(16 * MIB, pull_16, 256 * MIB, pull_256)
    push = _two_sizes(16 * MIB, push_16, 256 * MIB, push_256)
    local = _two_sizes(16 * MIB, _symm(16, "local copy"), 256 * MIB, _symm(256, "local copy"))
    op_s = statistics.median([pull[1], push[1], local[1]])
    if one_size:  # one pass of 16 MiB (a copy of 64 MiB), fixed time included: validate.py peer-h200's way
        pull, push, local, op_s = (
            (16 * MIB / pull_16,),
            (16 * MIB / push_16,),
            (64 * MIB / _symm(64, "local copy"),),
            0.0,
        )
    cost = PeerCost(
        pair_bytes_per_s=pull[0],
        fanin_bytes_per_s=48 * MIB / (_symm(64, "pull sum4 triton") - op_s),  # 3 x 16 MiB read at once
        local_bytes_per_s=local[0],
        push_bytes_per_s=push[0],
        gpu_op_s=op_s,
        barrier_s=0.0,
        host_call_s=_host_probe("native all_reduce 65536 KiB"),  # NCCL's own call, as for 4 x H200
        host_barrier_s=_host_probe("symm barrier"),
        host_launch_s=_host_probe("torch.add(out=)"),
        host_kernel_s=_host_probe("triton pull_kernel launch"),
    )
    cost = replace(cost, barrier_s=_fit_barrier(cost))
    return cost, {} if one_size else {"pull": pull[1], "push": push[1], "local copy": local[1]}


def _probe_replays(kib: int) -> list[tuple[str, int, float]]:
    """probe.py peer-host's graph replays of the all-reduce at ``kib``: (algorithm, bytes, GPU seconds)."""
    return [(a, kib << 10, _host_probe(f"{a}+graph {kib} KiB", gpu=True)) for a in ALGORITHMS]


def _fit_barrier(cost: PeerCost) -> float:
    """The device barrier that best prices the 16 KiB replays (least squared log error, 0-20 us by 10 ns)."""
    replays = [(registry.build(Collective.ALL_REDUCE, a, 4), n, t) for a, n, t in _probe_replays(16)]

    def loss(barrier_s: float) -> float:
        c = replace(cost, barrier_s=barrier_s)
        return sum(np.log(peer_time(s, n, c, replayed=True).gpu_s / t) ** 2 for s, n, t in replays)

    return min(np.arange(0.0, 20e-6, 1e-8), key=loss).item()


def _points(name: str) -> list[dict]:
    """dtrain's calls of the sweep ``name`` (not native), as the runtime ran them: the schedule of the
    algorithm (``auto``: the one it resolved to), replayed unless the sweep was eager, pushed from
    ``PUSH_FROM_BYTES`` where the schedule has a push form, with the API's operations (contiguous, op "sum")."""
    out = []
    for line in (DATA / name).read_text().splitlines():
        r = json.loads(line)
        if r["algorithm"] == "native":
            continue
        schedule = registry.build(Collective(r["collective"]), r["resolved_algorithm"], r["world_size"])
        n = r["nbytes"]
        push = n >= PUSH_FROM_BYTES and has_push_form(schedule)
        fit = name == FIT_SWEEP and n <= MIB and r["persistent"]
        record = {"sweep": name, "collective": r["collective"], "algorithm": r["algorithm"],
                  "resolved": r["resolved_algorithm"], "nbytes": n, "replayed": r["persistent"], "push": push,
                  "measured_us": r["time_us"], "fit": fit}  # fmt: skip
        out.append({**record, "schedule": schedule, "api": api_passes(schedule, n)})
    return out


def _price(points: list[dict], cost: PeerCost) -> list[dict]:
    rows = []
    for p in points:
        t = peer_time(p["schedule"], p["nbytes"], cost, replayed=p["replayed"], push=p["push"], api=p["api"])
        row = {k: v for k, v in p.items() if k not in ("schedule", "api")}
        rows.append({**row, "predicted_us": t.time_s * 1e6, "gpu_us": t.gpu_s * 1e6, "host_us": t.host_s * 1e6,
                     "error": t.time_s * 1e6 / p["measured_us"] - 1})  # fmt: skip
    return rows


def _cell(rows: list[dict]) -> str:
    if not rows:
        return "-"
    errs = [abs(r["error"]) for r in rows]
    return f"{statistics.median(errs):.1%} / {max(errs):.1%} ({len(rows)})"


def _table(title: str, rows: list[dict], key, keys: list[str]) -> None:
    """Median / worst |error| (points) of ``rows`` per ``key(row)`` in ``keys`` and of them all, per size band."""
    print(f"\n{title}\n\n| | " + " | ".join(b[0] for b in BANDS) + " |\n|" + "---|" * (len(BANDS) + 1))
    for k, sub in [(k, [r for r in rows if key(r) == k]) for k in keys] + [("all", rows)]:
        print(f"| {k} | " + " | ".join(_cell([r for r in sub if lo <= r["nbytes"] < hi]) for _, lo, hi in BANDS) + " |")


def _report(label: str, rows: list[dict], brief: bool = False) -> None:
    held = [r for r in rows if not r["fit"]]
    replayed = [r for r in held if r["replayed"]]
    colls = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    _table(f"{label}: replayed calls, held out, per collective (median / worst |error| (points))", replayed,
           lambda r: r["collective"], colls)  # fmt: skip
    big = [r for r in replayed if r["nbytes"] >= 16 * MIB]
    print(f"\n{label}: every held-out replayed call: {_cell(replayed)}; >= 16 MiB: {_cell(big)}; "
          f"the same, auto left out: {_cell([r for r in big if r['algorithm'] != 'auto'])}")  # fmt: skip
    if brief:
        return
    algos = list(ALGORITHMS) + ["auto"]
    _table(f"{label}: replayed calls, held out, per algorithm", replayed,
           lambda r: "auto" if r["algorithm"] == "auto" else r["resolved"], algos)  # fmt: skip
    _table(f"{label}: per sweep (the fit points left out)", held, lambda r: SWEEPS[r["sweep"]], list(SWEEPS.values()))


def _worst(rows: list[dict], count: int = 8) -> None:
    """The largest held-out misses from 16 MiB, and how auto compares with the algorithm it resolved to."""
    held = sorted((r for r in rows if not r["fit"] and r["nbytes"] >= 16 * MIB), key=lambda r: -abs(r["error"]))
    print("\nlargest misses from 16 MiB: " + "; ".join(
        f"{r['collective']} {r['algorithm']} {r['nbytes'] >> 20} MiB ({SWEEPS[r['sweep']]}) {r['measured_us']:.0f} us "
        f"{r['error']:+.0%}" for r in held[:count]))  # fmt: skip
    named = {(r["sweep"], r["collective"], r["nbytes"], r["algorithm"]): r["measured_us"] for r in rows}
    extra = {}
    for r in rows:
        key = (r["sweep"], r["collective"], r["nbytes"], r["resolved"])
        if r["algorithm"] == "auto" and key in named:
            extra.setdefault(r["nbytes"] >= 16 * MIB, []).append(r["measured_us"] - named[key])
    print("auto against the algorithm it resolved to, same launch and size (us more): median "
          + ", ".join(f"{'>= 16 MiB' if big else '< 16 MiB'} {statistics.median(v):+.1f} ({len(v)})"
                      for big, v in sorted(extra.items())))  # fmt: skip


def _probe_rows(cost: PeerCost) -> list[dict]:
    """probe.py peer-host's 64 MiB graph replays (GPU time, no API call around them), held out."""
    rows = []
    for a, n, t in _probe_replays(65536):
        s = registry.build(Collective.ALL_REDUCE, a, 4)
        pred = peer_time(s, n, cost, replayed=True, push=n >= PUSH_FROM_BYTES and has_push_form(s)).gpu_s
        record = {"sweep": "probe.py peer-host", "collective": "all_reduce", "algorithm": a, "resolved": a}
        rows.append({**record, "nbytes": n, "measured_us": t * 1e6, "predicted_us": pred * 1e6, "error": pred / t - 1})
    return rows


def _native(sweeps: list[str]) -> tuple[dict[str, NcclParams], list[dict]]:
    """NCCL's own calls, priced by three fits of the NCCL model (module docstring); ``fit`` marks the points of
    either fit set, which no variant is tested on."""
    topo = Transport(name="nvlink").topology(4)  # NVLink 4 through NVSwitch, 450 GB/s a direction: H100 and H200
    rows = [{**json.loads(line), "sweep": name} for name in sweeps for line in (DATA / name).read_text().splitlines()]
    rows = [r for r in rows if r["algorithm"] == "native"]
    colls = [r for r in rows if r["sweep"] == NCCL_FIT_SWEEP]
    final = [r for r in rows if r["sweep"] == FIT_SWEEP and r["collective"] == "all_reduce"]
    fits = {"copy, fitted on run 3 launch 1": (colls, LOCAL_OVER_CONNECTION),
            "no copy, fitted on run 3 launch 1": (colls, None),
            "no copy, fitted on the fit sweep's all-reduce": (final, None)}  # fmt: skip
    params, out = {}, []
    for variant, (fit_set, local) in fits.items():
        points = [NcclPoint(collective=r["collective"], nbytes=r["nbytes"], seconds=r["time_us"] * 1e-6)
                  for r in fit_set]  # fmt: skip
        params[variant] = fit_nccl(points, topo, local_per_connection=local)
        for r in rows:
            pred = simulate_nccl(topo, r["collective"], r["nbytes"], params=params[variant]).time_s * 1e6
            out.append({"variant": variant, "sweep": r["sweep"], "collective": r["collective"],
                        "algorithm": "native", "resolved": "native", "nbytes": r["nbytes"], "replayed": False,
                        "push": False, "measured_us": r["time_us"], "fit": r in colls or r in final,
                        "predicted_us": pred, "error": pred / r["time_us"] - 1})  # fmt: skip
    return params, out


# 4 x H200's figures in benchmarks/sim/validate.py peer-h200 (calibrated; the replay's host time fitted on the H200's
# presized sweep), to set beside this node's
H200 = {"pair_bytes_per_s": 307e9, "fanin_bytes_per_s": 216e9, "local_bytes_per_s": 1.83e12, "push_bytes_per_s": 333e9,
        "gpu_op_s": 0.0, "barrier_s": 6e-6, "host_call_s": 25e-6, "host_barrier_s": 4.8e-6, "host_launch_s": 5.6e-6,
        "host_kernel_s": 18e-6, "host_replay_s": 91e-6}  # fmt: skip


def _figures(costs: dict[str, PeerCost]) -> None:
    print("| figure | " + " | ".join(costs) + " | 4 x H200 |\n|" + "---|" * (len(costs) + 2))
    for name, h200 in H200.items():
        unit, scale = ("GB/s", 1e-9) if name.endswith("per_s") else ("us", 1e6)
        cells = [f"{getattr(c, name) * scale:.4g}" for c in costs.values()]
        print(f"| {name} ({unit}) | " + " | ".join(cells) + f" | {h200 * scale:.4g} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    points = [p for name in SWEEPS for p in _points(name)]
    fit_set = [(p["schedule"], p["nbytes"], p["measured_us"] * 1e-6, True, p["push"], p["api"])
               for p in points if p["fit"]]  # fmt: skip
    costs, rows = {}, {}
    for variant, one_size in (("two sizes", False), ("one size", True)):
        calibrated, fixed = _calibration(one_size)
        costs[variant] = fit_peer_cost(fit_set, calibrated, gpu=False)
        rows[variant] = [{"variant": variant, **r} for r in _price(points, costs[variant])]
        if fixed:
            print("fixed time of a pass, from its times at two sizes (us): "
                  + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in fixed.items()))  # fmt: skip
    print(f"host_replay_s fitted on the {len(fit_set)} replays of <= 1 MiB of {FIT_SWEEP}; the rest calibrated\n")
    _figures(costs)
    cost = costs["two sizes"]
    for a, n, t in _probe_replays(16):
        s = registry.build(Collective.ALL_REDUCE, a, 4)
        print(f"16 KiB {a} replay (the barrier's fit): {t * 1e6:.1f} us, model {peer_time(s, n, cost).gpu_s * 1e6:.1f}")
    _report("two sizes", rows["two sizes"])
    _report("one size (16 MiB passes, no gpu_op_s)", rows["one size"], brief=True)
    probe = _probe_rows(cost)
    print("\nprobe.py peer-host 64 MiB replays (held out): " + ", ".join(
        f"{r['algorithm']} {r['measured_us']:.0f} us {r['error']:+.1%}" for r in probe))  # fmt: skip
    _worst(rows["two sizes"])
    params, native = _native(list(SWEEPS) + list(NATIVE_ONLY))
    for variant, p in params.items():
        local = "none" if p.local_bytes_per_s is None else f"{p.local_bytes_per_s / 1e9:.1f} GB/s"
        print(f"\nNCCL model, {variant}: connection {p.connection_cap / 1e9:.1f} GB/s, launch "
              f"{p.launch_s * 1e6:.1f} us, step {p.step_latency_s * 1e6:.2f} us, host {p.host_s * 1e6:.1f} us, "
              f"local copy {local}")  # fmt: skip
        _table(f"NCCL (native), {variant}, held out from both fits, per collective",
               [r for r in native if r["variant"] == variant and not r["fit"]], lambda r: r["collective"],
               ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])  # fmt: skip
    if args.out:
        with args.out.open("w") as f:
            nccl = {"nccl": {k: p.__dict__ for k, p in params.items()}}
            f.write(json.dumps({k: c.__dict__ for k, c in costs.items()} | nccl) + "\n")
            for r in rows["two sizes"] + rows["one size"] + probe + native:
                f.write(json.dumps({"model": "nccl" if r["algorithm"] == "native" else "peer", **r}) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
