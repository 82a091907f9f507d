"""Usage: python benchmarks/sim/validate.py peer-h200 [--out FILE] [--schedule-only]

Validate the peer-transport model (dtrain.sim.peer_model) against 4 x H200 measurements.

    python benchmarks/sim/validate.py peer-h200 --out benchmarks/results/sim_validation-peer-h200x4.jsonl

Fit run: the eager all-reduce sweep on the peer transport (benchmarks/results/all_reduce-peer-eager-h200x4.jsonl: ring,
halving-doubling, direct and auto, 16 KiB-1 GiB); every figure of the model is fitted there
(:func:`fit_peer_cost`; the local copy rate is fixed at the probe's 64 MiB copy, 1.83 TB/s). Held out: the
other four collectives with graph-replayed calls (``collectives-peer-graphs-h200x4.jsonl``: all-gather,
reduce-scatter, broadcast, all-to-all, 1-256 MiB, no host time), and the all-reduce graph replays of
``benchmarks/collectives/probe.py peer-host`` (16 KiB and 64 MiB, copied below from its output).
Prints the median and worst relative error, |predicted / measured - 1|, per set and per algorithm.

Also held out, none of it fitted: the pull and push forms of the all-reduce, eager and replayed, from
``benchmarks/gpu/run.sh push`` (``all_reduce-{pull,push}-{eager,graphs}-h200x4.jsonl``, 1 MiB-1 GiB, ring and
halving-doubling) and the repeated eager sweeps (``all_reduce-{pull,push}-eager-h200x4-run2.jsonl``), priced with the
same figures plus the push rate of ``benchmarks/collectives/probe.py pull-kernel`` (333 GB/s, a 16 MiB push).

Every call is priced with the public API's own operations around its schedule (:mod:`dtrain.sim.api_passes`:
reduce-scatter's and all-to-all's clone and copy out, all-gather's copy in), at the local copy rate and the host
launch term of each variant; ``--schedule-only`` prices the schedules alone, as a variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dtrain.comm.cost import model as comm_cost
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.api_passes import api_passes
from dtrain.sim.peer_model import PeerCost, fit_peer_cost, peer_time

DATA = Path(__file__).resolve().parents[2] / "results"
ROOTED = {"broadcast": 0, "reduce": 0, "gather": 0, "scatter": 0}
# probe.py peer-host, 4 x H200, graph replays: (algorithm, bytes, GPU microseconds per call)
PROBE_GRAPHS = [
    ("ring", 16 << 10, 34.6),
    ("halving_doubling", 16 << 10, 29.4),
    ("direct", 16 << 10, 24.9),
    ("recursive_doubling", 16 << 10, 24.4),
    ("ring", 64 << 20, 352.4),
    ("halving_doubling", 64 << 20, 352.3),
    ("direct", 64 << 20, 569.8),
    ("recursive_doubling", 64 << 20, 487.1),
]


def _schedule(coll: str, algorithm: str, world: int, nbytes: int):
    pipeline = 1
    if algorithm == "ring" and coll in ("broadcast", "reduce"):  # the runtime's choice (api._pipeline)
        pipeline = comm_cost.optimal_pipeline(nbytes, world, comm_cost.default_params("cuda").intra)
    return registry.build(Collective(coll), algorithm, world, root=ROOTED.get(coll), pipeline=pipeline)


def _points(path: Path, replayed: bool, push: bool = False, *, api: bool = True) -> list[dict]:
    """The measured calls of ``path`` (not native, not auto), each with its schedule and, with ``api``, its
    API operations (the bench passes contiguous tensors and op "sum")."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        if r["algorithm"] in ("native", "auto"):  # auto repeats one of the others
            continue
        schedule = _schedule(r["collective"], r["resolved_algorithm"], r["world_size"], r["nbytes"])
        passes = api_passes(schedule, r["nbytes"]) if api else None
        point = {"schedule": schedule, "seconds": r["time_us"] * 1e-6, "replayed": replayed, "push": push}
        out.append({**r, **point, "api": passes})
    return out


def _errors(points: list[dict], cost: PeerCost) -> list[dict]:
    rows = []
    for p in points:
        push = p.get("push", False)
        pred = peer_time(p["schedule"], p["nbytes"], cost, replayed=p["replayed"], push=push, api=p.get("api"))
        rows.append(
            {
                "collective": p["collective"],
                "algorithm": p["resolved_algorithm"],
                "nbytes": p["nbytes"],
                "replayed": p["replayed"],
                "push": p.get("push", False),
                "measured_us": p["seconds"] * 1e6,
                "predicted_us": pred.time_s * 1e6,
                "gpu_us": pred.gpu_s * 1e6,
                "host_us": pred.host_s * 1e6,
                "api_launches": pred.api_launches,
                "error": pred.time_s / p["seconds"] - 1,
            }
        )
    return rows


def _summary(name: str, rows: list[dict]) -> str:
    errs = [abs(r["error"]) for r in rows]
    return f"| {name} | {len(rows)} | {statistics.median(errs):.1%} | {max(errs):.1%} |"


def _by_collective(label: str, rows: list[dict]) -> None:
    """Median and worst per collective, all sizes and from 64 MiB, then per (collective, algorithm)."""
    for coll in sorted({r["collective"] for r in rows}):
        sub = [r for r in rows if r["collective"] == coll]
        print(_summary(f"{label} | {coll}, all sizes", sub))
        print(_summary(f"{label} | {coll}, >= 64 MiB", [r for r in sub if r["nbytes"] >= 64 << 20]))
        for algo in sorted({r["algorithm"] for r in sub}):
            print(_summary(f"{label} | {coll} {algo}, all sizes", [r for r in sub if r["algorithm"] == algo]))


def _ring_broadcast_pieces(points: list[dict]) -> str:
    """The ring broadcast's pieces at each measured size, from the defaults the peer run had (no calibration
    was made or named in benchmarks/gpu/run.sh peer) and from the recorded calibration: where they agree, which
    calibration the runtime read does not matter."""
    calibration = comm_cost.load_params(DATA / "calibration-h200x4.json").intra
    defaults = comm_cost.default_params("cuda").intra
    sizes = sorted(
        {p["nbytes"] for p in points if p["collective"] == "broadcast" and p["resolved_algorithm"] == "ring"}
    )
    pieces = {
        n >> 20: (comm_cost.optimal_pipeline(n, 4, defaults), comm_cost.optimal_pipeline(n, 4, calibration))
        for n in sizes
    }
    same = all(a == b for a, b in pieces.values())
    return (
        f"ring broadcast pieces k by MiB (defaults, calibration file): {pieces}; {'the same' if same else 'DIFFERENT'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--schedule-only", action="store_true", help="price the schedules without the API's operations")
    args = ap.parse_args()
    api = not args.schedule_only
    fit_set = _points(DATA / "all_reduce-peer-eager-h200x4.jsonl", replayed=False, api=api)
    held = _points(DATA / "collectives-peer-graphs-h200x4.jsonl", replayed=True, api=api)
    probe = [
        {
            "collective": "all_reduce",
            "resolved_algorithm": a,
            "nbytes": n,
            "schedule": _schedule("all_reduce", a, 4, n),
            "seconds": us * 1e-6,
            "replayed": True,
            "api": None,  # the probe times the replayed graph alone, with no API call around it
        }
        for a, n, us in PROBE_GRAPHS
    ]
    # calibrated: every figure from the micro-benchmarks (probe.py symm, probe.py peer-host), none from these runs
    calibrated = PeerCost(
        pair_bytes_per_s=307e9,  # a 16 MiB pull-add from one peer, 54.7 us
        fanin_bytes_per_s=216e9,  # 3 x 16 MiB read from all peers at once, 233 us
        local_bytes_per_s=1.83e12,  # a 64 MiB copy, 36.7 us
        barrier_s=6e-6,  # 5.0-7.0 us measured
        host_call_s=25e-6,  # a call's checks and plan look-up (NCCL's own call: 25 us)
        host_barrier_s=4.8e-6,
        host_launch_s=5.6e-6,  # a torch operation
        host_kernel_s=18e-6,  # a launch of the fused Triton kernel (peer_kernels.wants_kernel says where)
    )
    # host-fitted: the same GPU figures, the three host terms fitted on the eager points of at most 1 MiB
    small = [
        (p["schedule"], p["nbytes"], p["seconds"], False, False, p["api"]) for p in fit_set if p["nbytes"] <= 1 << 20
    ]
    fitted = fit_peer_cost(small, calibrated, gpu=False)
    sets: dict[str, list[dict]] = {}
    print("| variant | set | points | median error | worst |\n| --- | --- | --- | --- | --- |")
    for variant, cost in (("calibrated", calibrated), ("host-fitted", fitted)):
        rows = {
            "all-reduce eager, all sizes": _errors(fit_set, cost),
            "other collectives, replayed": _errors(held, cost),
            "all-reduce replayed (probe)": _errors(probe, cost),
        }
        eager = rows["all-reduce eager, all sizes"]
        rows["all-reduce eager, >= 64 MiB"] = [r for r in eager if r["nbytes"] >= 64 << 20]
        rows["all-reduce eager, <= 1 MiB"] = [r for r in eager if r["nbytes"] <= 1 << 20]
        replayed = rows["other collectives, replayed"]
        rows["other collectives, replayed, >= 64 MiB"] = [r for r in replayed if r["nbytes"] >= 64 << 20]
        rows["... the same without direct"] = [
            r for r in rows["other collectives, replayed, >= 64 MiB"] if r["algorithm"] != "direct"
        ]
        for name, sub in rows.items():
            print(_summary(f"{variant} | {name}", sub))
            sets[f"{variant}: {name}"] = sub
        if variant == "calibrated":
            held_rows = rows["other collectives, replayed"]
            for coll in sorted({r["collective"] for r in held_rows}):
                for algo in sorted({r["algorithm"] for r in held_rows if r["collective"] == coll}):
                    sub = [r for r in held_rows if r["collective"] == coll and r["algorithm"] == algo]
                    print(_summary(f"calibrated | replayed {coll} {algo}", sub))
    # the pull and push forms, eager and replayed, all held out
    forms = {}
    for form in ("pull", "push"):
        for graphs in (0, 1):
            path = DATA / f"all_reduce-{form}-{'graphs' if graphs else 'eager'}-h200x4.jsonl"
            forms[f"{form}, {'replayed' if graphs else 'eager'}"] = _points(path, bool(graphs), form == "push", api=api)
        repeat = DATA / f"all_reduce-{form}-eager-h200x4-run2.jsonl"
        forms[f"{form}, eager (repeat)"] = _points(repeat, False, form == "push", api=api)
    for variant, cost in (("calibrated", calibrated), ("host-fitted", fitted)):
        cost = PeerCost(**{**cost.__dict__, "push_bytes_per_s": 333e9})  # a 16 MiB push, probe.py pull-kernel
        for name, points in forms.items():
            rows = _errors(points, cost)
            for label, sub in (
                ("all sizes", rows),
                (">= 64 MiB", [r for r in rows if r["nbytes"] >= 64 << 20]),
                ("16 MiB and up", [r for r in rows if r["nbytes"] >= 16 << 20]),
            ):
                if sub:
                    print(_summary(f"{variant} | pull and push, {name}, {label}", sub))
                    sets[f"{variant}: pull and push, {name}, {label}"] = sub
    # eager, pull form (held out): all-gather and all-to-all with the direct
    # algorithm's passes rotated, as the plan runs them, beside all-reduce
    rotated = _points(DATA / "collectives-direct-h200x4.jsonl", False, api=api)
    for variant, cost in (("calibrated", calibrated), ("host-fitted", fitted)):
        rows = _errors(rotated, cost)
        others = [r for r in rows if r["collective"] != "all_reduce"]
        for label, sub in (
            ("all-gather and all-to-all, all sizes", others),
            ("all-gather and all-to-all, >= 64 MiB", [r for r in others if r["nbytes"] >= 64 << 20]),
            ("all-reduce, all sizes", [r for r in rows if r["collective"] == "all_reduce"]),
        ):
            print(_summary(f"{variant} | eager, direct rotated, {label}", sub))
            sets[f"{variant}: eager, direct rotated, {label}"] = sub
        if variant == "host-fitted":
            _by_collective("host-fitted | eager, direct rotated", others)
    # replays of every size: the host time of a replayed call fitted on the small replays of one sweep (the
    # presized-window sweep, <= 1 MiB), tested on the others (window grown, pull and push forms, push from 64 MiB)
    presized = _points(DATA / "all_reduce-replay-presized-h200x4.jsonl", True, api=api)
    fit_small = [
        (p["schedule"], p["nbytes"], p["seconds"], True, False, p["api"]) for p in presized if p["nbytes"] <= 1 << 20
    ]
    replay_cost = PeerCost(**{**fitted.__dict__, "push_bytes_per_s": 333e9})
    replay_cost = fit_peer_cost(fit_small, replay_cost, gpu=False)
    held_replays = {
        "window grown (pull)": _points(DATA / "all_reduce-replay-growing-h200x4.jsonl", True, api=api),
        "pull form": _points(DATA / "all_reduce-pull-graphs-h200x4.jsonl", True, api=api),
        "push form": _points(DATA / "all_reduce-push-graphs-h200x4.jsonl", True, push=True, api=api),
        "push from 64 MiB": [
            {**p, "push": p["nbytes"] >= 64 << 20}
            for p in _points(DATA / "all_reduce-peer-graphs-h200x4.jsonl", True, api=api)
        ],
    }
    held_replays["the other collectives (pull)"] = held
    for name, points in held_replays.items():
        rows = _errors(points, replay_cost)
        print(_summary(f"replay-fitted | replays, {name}, all sizes", rows))
        sets[f"replay-fitted: replays, {name}, all sizes"] = rows
    held_rows = sets["replay-fitted: replays, the other collectives (pull), all sizes"]
    print(
        _summary(
            "replay-fitted | the other collectives, >= 64 MiB",
            [r for r in held_rows if r["nbytes"] >= 64 << 20],
        )
    )
    _by_collective("replay-fitted | the other collectives", held_rows)
    print(_ring_broadcast_pieces(held))
    print(f"replay-fitted: {replay_cost.host_replay_s * 1e6:.1f} us of host time a replayed call")
    print(
        f"host-fitted: {fitted.host_call_s * 1e6:.1f} us a call + {fitted.host_barrier_s * 1e6:.1f} us a barrier + "
        f"{fitted.host_launch_s * 1e6:.1f} us a launch"
    )
    if args.out:
        with args.out.open("w") as f:
            f.write(json.dumps({"calibrated": calibrated.__dict__, "host_fitted": fitted.__dict__}) + "\n")
            for name, rows in sets.items():
                for r in rows:
                    f.write(json.dumps({"set": name, **r}) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
