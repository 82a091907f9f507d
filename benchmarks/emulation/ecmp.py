"""Usage: sudo python benchmarks/emulation/ecmp.py [--trials 60] [--bridged-trials 12] [--out FILE]

ECMP hash collisions on the routed emulated leaf-spine, next to the bridged fabric and the simulator (as root).

The cluster: the ``4-rack`` preset cut to 2 racks x 2 servers, one 100 Gb/s NIC a server, 2 spines, 1:1, at
``--scale`` (default 1e-3): NICs at 100 Mb/s and every ToR-spine link at 100 Mb/s. Each trial opens one TCP
connection from each server of rack 0 to its partner in rack 1 (s0 -> s2, s1 -> s3) at the same moment, each
from a source port no earlier trial used, and measures what each gets. On two spines each flow runs at its
NIC's rate; when the ToR hashes both onto one spine they share its link and get about half. With a uniform
hash over P equal paths, N flows all get paths of their own with probability P!/((P-N)! P^N): for 2 flows on 2
spines, 1/2, so half the trials should collide. The bridged fabric (spines merged into one 200 Mb/s veth) never
collides; the simulator hashes flow ids onto paths (``Topology.route``) and shares links max-min fairly.

Which spine each flow took is read from ToR 0's uplink byte counters around every trial, so a collision is
counted from where the bytes went, not inferred from the rates. The senders and receivers are a few lines of
Python sockets started once per namespace (``sink`` and ``send`` roles of this script), every trial at a fixed
wall-clock time, as all namespaces share the host's clock. About two minutes:

    sudo python benchmarks/emulation/ecmp.py [--trials 60] [--bridged-trials 12] [--out runs/emulate-ecmp.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 5301
WARMUP_S = 0.25  # TCP slow start and the token bucket's first burst, left out of every rate
SECONDS = 0.8  # how long each flow sends
GAP_S = 0.3  # between trials: queues drain, counters are read
CHUNK = 64 * 1024
FLOWS = [("s0", "s2"), ("s1", "s3")]  # rack 0 -> rack 1, one flow per server pair


def cluster():
    from dtrain.cluster.presets import preset

    return preset("4-rack", racks=2, servers_per_rack=2, gpus=1, nics=1, nic="ethernet100", oversubscription=1)


# -- the two roles run inside the namespaces (standard library only) ------------------------------------------


def sink(bind: str, trials: int, timeout_s: float) -> list[dict]:
    """Accept ``trials`` connections one after another; each one's rate (bit/s) after the warm-up."""
    results = []
    with socket.create_server((bind, PORT)) as listener:
        listener.settimeout(timeout_s)
        for _ in range(trials):
            conn, (_, sport) = listener.accept()
            with conn:
                conn.settimeout(timeout_s)
                results.append({"sport": sport, **_receive(conn)})
    return results


def _receive(conn: socket.socket) -> dict:
    buffer = bytearray(CHUNK)
    trial = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "big")
    total, start, mark = 0, None, None
    while n := conn.recv_into(buffer):
        now = time.perf_counter()
        start = start if start is not None else now
        total += n
        if mark is None and now - start >= WARMUP_S:
            mark = (now, total)
    end = time.perf_counter()
    rate = (total - mark[1]) * 8 / (end - mark[0]) if mark is not None and end > mark[0] else math.nan
    return {"trial": trial, "bytes": total, "bit_per_s": rate}


def send(src: str, dst: str, trials: int, start: float, period_s: float, first_sport: int) -> None:
    """Trial j: at ``start + j * period_s`` (wall clock) connect from port ``first_sport + j`` and send for
    ``SECONDS``."""
    payload = b"\0" * CHUNK
    for j in range(trials):
        time.sleep(max(0.0, start + j * period_s - time.time()))
        with socket.socket() as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            conn.bind((src, first_sport + j))
            conn.connect((dst, PORT))
            conn.sendall(j.to_bytes(4, "big"))
            end = time.perf_counter() + SECONDS
            while time.perf_counter() < end:
                conn.send(payload)


# -- the orchestrator ------------------------------------------------------------------------------------------


def _role(namespace: str, args: list[str]) -> subprocess.Popen:
    from dtrain.emulate.netns import in_ns

    argv = in_ns(namespace, [sys.executable, str(Path(__file__).resolve()), *args])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _sample(counters: dict[str, list[str]]) -> tuple[float, dict[str, int]]:
    """Bytes sent so far by each ``{namespace: [device, ...]}``, keyed ``"namespace/device"``, and when (the
    middle of the reads, one ``ip`` call per namespace)."""
    from dtrain.emulate.netns import ip

    before = time.perf_counter()
    sent = {}
    for namespace, devices in counters.items():
        stats = {
            d["ifname"]: d["stats64"]["tx"]["bytes"] for d in json.loads(ip("-s", "-j", "link", namespace=namespace))
        }
        sent |= {f"{namespace}/{device}": stats[device] for device in devices}
    return (before + time.perf_counter()) / 2, sent


def _counters(plan) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """What to read: the switch port each flow's receiver hangs from (its delivered bytes, counted where the
    shaper sends them, so a stalled receiving process cannot skew them) and, routed, ToR 0's spine uplinks.
    A veth counts a GSO packet once with one set of headers, so these bytes are the TCP payload plus well
    under 1% (the shaper, which counts every segment's headers, is what holds 1448/1514 of its rate)."""
    servers = {s.server: s for s in plan.servers}
    counters: dict[str, list[str]] = {}
    ports = []
    for _, dst in FLOWS:
        counters.setdefault(servers[dst].switch_namespace, []).append(servers[dst].port)
        ports.append(f"{servers[dst].switch_namespace}/{servers[dst].port}")
    uplinks = []
    if plan.fabric_kind == "routed":
        tor = plan.routers[0].namespace
        counters.setdefault(tor, []).extend(x.tor_end for x in plan.router_links if x.tor_namespace == tor)
        uplinks = [f"{tor}/{x.tor_end}" for x in plan.router_links if x.tor_namespace == tor]
    return counters, ports, uplinks


def run_trials(plan, trials: int) -> list[dict]:
    """Every trial's flows (delivered rate in the steady window, source port, the receiver's own figure) and,
    routed, the bytes ToR 0 sent up each spine in that window."""
    servers = {s.server: s for s in plan.servers}
    period = SECONDS + GAP_S
    start = time.time() + 2.0  # every role is up by then, even on a busy host
    sinks = [_role(servers[dst].namespace, ["sink", "--bind", servers[dst].ip, "--trials", str(trials),
                                            "--timeout", str(trials * period + 30)]) for _, dst in FLOWS]  # fmt: skip
    senders = [
        _role(servers[src].namespace, ["send", "--bind", servers[src].ip, "--to", servers[dst].ip, "--trials",
                                       str(trials), "--start", repr(start), "--period", repr(period),
                                       "--sport", str(20000 + 1000 * k)])
        for k, (src, dst) in enumerate(FLOWS)
    ]  # fmt: skip
    counters, ports, uplinks = _counters(plan)
    windows = []
    for j in range(trials):  # the steady part of every trial: after the warm-up, before the senders stop
        samples = []
        for offset in (WARMUP_S, SECONDS - 0.05):
            time.sleep(max(0.0, start + j * period + offset - time.time()))
            samples.append(_sample(counters))
        windows.append(samples)
    outputs = [_finish(p, trials * period + 60) for p in senders + sinks][len(senders) :]
    records = []
    for j, ((t0, a), (t1, b)) in enumerate(windows):
        flows = []
        for k, (src, dst) in enumerate(FLOWS):
            receiver = next(r for r in outputs[k] if r["trial"] == j)
            delivered = (b[ports[k]] - a[ports[k]]) * 8 / (t1 - t0)
            flows.append({"src": src, "dst": dst, "sport": receiver["sport"], "delivered_bit_per_s": delivered,
                          "receiver_bit_per_s": receiver["bit_per_s"]})  # fmt: skip
        record = {"fabric": plan.fabric_kind, "trial": j, "window_s": t1 - t0, "flows": flows}
        if uplinks:
            record["uplink_bytes"] = {u.split("/")[1]: b[u] - a[u] for u in uplinks}
        records.append(record)
    return records


def _finish(proc: subprocess.Popen, timeout_s: float) -> list[dict]:
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"a flow role failed ({proc.returncode}): {err.strip()[-800:]}")
    return json.loads(out) if out.strip() else []


def collided(record: dict) -> bool:
    """Did both flows leave ToR 0 on one spine? Read from the uplink counters: one spine carried >= 90%."""
    sent = list(record["uplink_bytes"].values())
    return max(sent) >= 0.9 * sum(sent)


def simulated(plan, topology, trials: int) -> list[list[float]]:
    """The simulator's per-flow rates (bit/s) on the network ``plan`` builds, flow ids 2j and 2j + 1 in trial j
    (reproducible). ``Topology.route`` hashes with BLAKE2b, which mixes such ids (50.8% of pairs collide over
    20,000 pairs, as a uniform hash should); the recorded run hashed each flow's identity with Python's hash."""
    from dtrain.emulate.model import emulated_topology
    from dtrain.sim.flows import max_min_rates

    network = emulated_topology(topology, plan)
    rates = []
    for j in range(trials):
        paths = [network.route(f"{src}/gpu0", f"{dst}/gpu0", len(FLOWS) * j + i)
                 for i, (src, dst) in enumerate(FLOWS)]  # fmt: skip
        rates.append([8 * r for r in max_min_rates(paths)])
    return rates


def no_collision_probability(flows: int, paths: int) -> float:
    """All ``flows`` on distinct paths under a uniform hash: P! / ((P - N)! P^N)."""
    return math.perm(paths, flows) / paths**flows if flows <= paths else 0.0


def _summary(name: str, rates: list[list[float]], solo: float, collisions: list[bool] | None = None) -> dict:
    flat = [r for trial in rates for r in trial]
    halved = [sum(trial) < 1.5 * solo for trial in rates]  # the pair got one link's worth, however split
    row = {"case": name, "trials": len(rates), "median_mbit_per_s": statistics.median(flat) / 1e6,
           "p10_mbit_per_s": _quantile(flat, 0.1) / 1e6, "p90_mbit_per_s": _quantile(flat, 0.9) / 1e6,
           "halved_fraction": sum(halved) / len(rates)}  # fmt: skip
    row["per_flow_histogram_mbit_per_s"] = _histogram(flat, width_bit_per_s=10e6)
    if collisions is not None:
        row["collided_fraction"] = sum(collisions) / len(rates)
        row["collided_but_not_halved"] = sum(c and not h for c, h in zip(collisions, halved, strict=True))
        row["halved_but_not_collided"] = sum(h and not c for c, h in zip(collisions, halved, strict=True))
        row["collided_median_mbit_per_s"] = _median([r for t, c in zip(rates, collisions, strict=True) if c for r in t])
        row["apart_median_mbit_per_s"] = _median(
            [r for t, c in zip(rates, collisions, strict=True) if not c for r in t]
        )
    return row


def _histogram(values: list[float], width_bit_per_s: float) -> dict[str, int]:
    """Counts per bin, labelled by the bin's lower edge in Mb/s."""
    counts: dict[int, int] = {}
    for value in values:
        edge = int(value // width_bit_per_s * width_bit_per_s / 1e6)
        counts[edge] = counts.get(edge, 0) + 1
    return {f"{edge}-{edge + int(width_bit_per_s / 1e6)}": counts[edge] for edge in sorted(counts)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) / 1e6 if values else None


def measure(args: argparse.Namespace) -> None:
    from dtrain.emulate.build import Emulation
    from dtrain.emulate.model import PAYLOAD_FRACTION
    from dtrain.emulate.plan import plan_emulation
    from dtrain.emulate.verify import verify

    topology = cluster()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, records = [], []
    for fabric, trials in (("routed", args.trials), ("bridged", args.bridged_trials)):
        plan = plan_emulation(topology, scale=args.scale, tag=f"ecmp{fabric[0]}", fabric=fabric)
        with Emulation(plan):
            check = verify(plan)
            print(f"{fabric}: built and checked, one flow s0->s3 at {check['measured_bit_per_s'] / 1e6:.1f} Mb/s")
            measured = run_trials(plan, trials)
        solo = plan.servers[0].up_bit_per_s * PAYLOAD_FRACTION
        rates = [[f["delivered_bit_per_s"] for f in r["flows"]] for r in measured]
        collisions = [collided(r) for r in measured] if fabric == "routed" else None
        rows.append(_summary(f"{fabric}, measured", rates, solo, collisions))
        rows.append(_summary(f"{fabric}, simulated", simulated(plan, topology, args.sim_trials), solo))
        records += measured
    expected = 1 - no_collision_probability(len(FLOWS), 2)
    n = rows[0]["trials"]
    p = rows[0]["collided_fraction"]
    rows[0]["collided_95ci"] = [p - 1.96 * math.sqrt(p * (1 - p) / n), p + 1.96 * math.sqrt(p * (1 - p) / n)]
    summary = {"summary": rows, "expected_collided_fraction": expected, "scale": args.scale,
               "solo_payload_mbit_per_s": solo / 1e6}  # fmt: skip
    with out.open("w") as f:
        for record in [*records, summary]:
            f.write(json.dumps(record) + "\n")
    print(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="measure", choices=["measure", "sink", "send"])
    parser.add_argument("--trials", type=int, default=60, help="routed trials (measure), or this role's trials")
    parser.add_argument("--bridged-trials", type=int, default=12)
    parser.add_argument("--sim-trials", type=int, default=10_000, help="flow pairs the simulator hashes")
    parser.add_argument("--scale", type=float, default=1e-3)
    parser.add_argument("--out", default="runs/emulate-ecmp.jsonl")
    parser.add_argument("--bind")
    parser.add_argument("--to")
    parser.add_argument("--start", type=float)
    parser.add_argument("--period", type=float)
    parser.add_argument("--sport", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if args.role == "sink":
        print(json.dumps(sink(args.bind, args.trials, args.timeout)))
    elif args.role == "send":
        send(args.bind, args.to, args.trials, args.start, args.period, args.sport)
    else:
        measure(args)


if __name__ == "__main__":
    main()
