"""Usage: sudo python benchmarks/sim/ps_validate.py [--out DIR] [--mbit 100] [--queue-ms MS] [--only CASES]

dtrain.sim.ps against the real parameter server (dtrain.ps) on an emulated cluster (dtrain.emulate); as root.

One rack of six emulated machines (network namespaces on one bridge), one 100 GbE NIC each, scaled by
``--mbit`` / 100,000 (default 100 Mbit/s, shaped by tc tbf). Parameter servers run on machines s0 and s1 (the
coordinator on s0), workers on s2-s5, one a machine ("spread"), or two on s2 sharing its NIC ("packed"). Each
step every worker pulls and pushes the whole dense model (the ``synthetic`` task with every key, sync mode):
the case where the simulator's prediction is a closed form of link rates, so a miss is the real system's cost
(CPU, protocol, TCP) and not a modelling choice. Each case runs ``--repeats`` times; a run's step time is the
median over its steps (after ``--warmup``) of the time between two consecutive steps' last worker finishing.
The same jobs also run on loopback (no shaping): that step time is the host's own cost (HMAC, copies,
optimizer, process switching on 2 cores). Two predictions: the network alone, and the network plus each
process's work on its messages (``PSStep.host_s_per_byte``), fitted once on the loopback 1 x 1 step, where
the network is nearly free and a step is four pieces of such work on the whole model (the worker sends its
push, the server receives it, sends the pull reply, the worker receives it): h = step / (4 x model bytes).

Every namespace is removed when the script ends, also on an error or Ctrl-C (:class:`dtrain.emulate.Emulation`);
every process it starts runs in its own process session and is killed with it.

    sudo python benchmarks/sim/ps_validate.py --out benchmarks/results   # ~5 minutes; sim_validation-ps-emulated.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dtrain.cluster.presets import preset
from dtrain.emulate.build import SERVER_INTERFACE, Emulation
from dtrain.emulate.links import tbf_args
from dtrain.emulate.model import emulated_topology
from dtrain.emulate.netns import in_ns, run_tool
from dtrain.emulate.plan import EmulationPlan, plan_emulation
from dtrain.emulate.verify import verify
from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.run import run_job
from dtrain.ps.train import TaskConfig
from dtrain.sim.ps import PSStep, simulate_ps

MACHINE = "this 2-core CPU machine, shared with other jobs"
ROOT = Path(__file__).resolve().parents[2]
WIDTH = 1024  # floats a row: the key list a request carries is 8 B a row, 0.2% of the row's 4 KiB


@dataclass(frozen=True)
class Case:
    servers: int
    workers: int
    packed: bool = False  # two workers a machine (sharing its NIC) instead of one

    @property
    def name(self) -> str:
        return f"{self.servers}s x {self.workers}w{' packed' if self.packed else ''}"

    def worker_nodes(self) -> list[str]:
        return [f"s{2 + w // 2}/gpu{w % 2}" if self.packed else f"s{2 + w}/gpu0" for w in range(self.workers)]

    def server_nodes(self) -> list[str]:
        return [f"s{i}/cpu0" for i in range(self.servers)]


CASES = [Case(1, 1), Case(1, 2), Case(1, 4), Case(2, 1), Case(2, 2), Case(2, 4), Case(2, 2, packed=True)]


def cluster_topology():
    """Six machines with two GPUs and one 100 GbE NIC each under one top-of-rack switch."""
    return preset("4-rack", racks=1, servers_per_rack=6, gpus=2, nics=1, nic="ethernet100")


def _job(case: Case, model_bytes: int) -> JobConfig:
    return JobConfig(num_keys=model_bytes // (4 * WIDTH), width=WIDTH, num_servers=case.servers,
                     num_workers=case.workers, mode="sync", dead_after_s=30.0, timeout_s=120.0)  # fmt: skip


def _task(steps: int, out: str) -> TaskConfig:
    return TaskConfig(task="synthetic", steps=steps, width=WIDTH, keys_per_step=0, out=out)


def step_times(out: Path, workers: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds between consecutive steps' last worker finishing (the sync step), after ``warmup`` steps; and
    per step, how far apart the workers' pulls completed (0 if the network shared the server fairly)."""
    done, pulled = [], []
    for rank in range(workers):
        records = [json.loads(x) for x in (out / f"worker-{rank}.jsonl").read_text().splitlines()]
        done.append([r["mono"] for r in records if "step" in r])
        pulled.append([r["pulled_at"] for r in records if "step" in r])
    last = [max(ends) for ends in zip(*done, strict=True)]
    stagger = [max(p) - min(p) for p in zip(*pulled, strict=True)][warmup + 1 :]
    return [b - a for a, b in zip(last[warmup:], last[warmup + 1 :], strict=False)], stagger


TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes")


def tcp_counters(plan: EmulationPlan) -> dict[str, int]:
    """TCP's retransmission counters summed over the machines' namespaces (each has its own /proc/net)."""
    total = dict.fromkeys(TCP_COUNTERS, 0)
    for server in plan.servers:
        text = subprocess.run(in_ns(server.namespace, ["cat", "/proc/net/snmp", "/proc/net/netstat"]),
                              capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
        for names, values in zip(text[::2], text[1::2], strict=False):
            for name, value in zip(names.split()[1:], values.split()[1:], strict=False):
                if name in total:
                    total[name] += int(value)
    return total


def set_queues(plan: EmulationPlan, queue_ms: float) -> None:
    """Give every machine's shaped links (both directions) a ``queue_ms`` queue instead of the emulator's 10 ms:
    the experiment that tells incast losses (flows converging on one shaped port) from the model's own error."""
    for s in plan.servers:
        for namespace, device, rate in ((s.namespace, SERVER_INTERFACE, s.up_bit_per_s),
                                        (plan.fabric, s.port, s.down_bit_per_s)):  # fmt: skip
            args = tbf_args(rate)
            args[args.index("latency") + 1] = f"{queue_ms:g}ms"
            run_tool(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *args])


class Processes:
    """Roles started inside namespaces, each in its own process session; all killed (SIGTERM, then SIGKILL) on exit."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, namespace: str, env: dict[str, str], log: Path) -> subprocess.Popen:
        full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
        with open(log, "w") as f:
            proc = subprocess.Popen(in_ns(namespace, [sys.executable, "-m", "dtrain.ps"]), env=full, cwd=ROOT,
                                    stdout=subprocess.PIPE if name == "coordinator" else f, stderr=f,
                                    start_new_session=True)  # fmt: skip
        self.procs.append((name, proc))
        return proc

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            for _, proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
            deadline = time.monotonic() + grace
            for _, proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for _, proc in self.procs:
            if proc.stdout:
                proc.stdout.close()


def run_emulated(plan: EmulationPlan, case: Case, model_bytes: int, steps: int, warmup: int, tmp: Path
                 ) -> tuple[list[float], list[float]]:  # fmt: skip
    """One job of ``case`` across the emulated machines; its step times and pull staggers (:func:`step_times`)."""
    where = {s.server: s for s in plan.servers}
    secret = wire.local_secret().hex()
    job, out = _job(case, model_bytes), tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    with Processes() as procs:
        s0 = where["s0"]
        coordinator = procs.start("coordinator", s0.namespace, {
            "DTRAIN_PS_ROLE": "coordinator", "DTRAIN_PS_SECRET": secret, "DTRAIN_PS_JOB": json.dumps(job.to_dict()),
            "DTRAIN_PS_COORDINATOR": f"tcp://{s0.ip}:0"}, tmp / "coordinator.log")  # fmt: skip
        line = coordinator.stdout.readline().decode().strip()
        if not line.startswith("DTRAIN_PS_COORDINATOR="):
            raise RuntimeError(f"coordinator did not start: {line!r}; {(tmp / 'coordinator.log').read_text()[-800:]}")
        common = {"DTRAIN_PS_SECRET": secret, "DTRAIN_PS_COORDINATOR": line.split("=", 1)[1]}
        for rank, node in enumerate(case.server_nodes()):
            host = where[node.split("/")[0]]
            procs.start(f"server{rank}", host.namespace, {**common, "DTRAIN_PS_ROLE": "server",
                        "DTRAIN_PS_RANK": str(rank), "DTRAIN_PS_HOST": host.ip}, tmp / f"server{rank}.log")  # fmt: skip
        task = json.dumps(_task(steps, str(out)).to_dict())
        workers = []
        for rank, node in enumerate(case.worker_nodes()):
            workers.append(procs.start(f"worker{rank}", where[node.split("/")[0]].namespace, {
                **common, "DTRAIN_PS_ROLE": "worker", "DTRAIN_PS_RANK": str(rank), "DTRAIN_PS_TASK": task},
                tmp / f"worker{rank}.log"))  # fmt: skip
        for rank, proc in enumerate(workers):
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"worker {rank} of {case.name} exited {proc.returncode}: "
                                   f"{(tmp / f'worker{rank}.log').read_text()[-1500:]}")  # fmt: skip
    return step_times(out, case.workers, warmup)


def run_loopback(case: Case, model_bytes: int, steps: int, warmup: int, tmp: Path) -> list[float]:
    """The same job on this machine's loopback (no shaping): the host's own cost of a step."""
    run_job(_job(case, model_bytes), _task(steps, ""), tmp)
    return step_times(tmp, case.workers, warmup)[0]


def predict(plan: EmulationPlan, case: Case, model_bytes: int, host_s_per_byte: float = 0.0):
    """The simulator on the network the emulation built (payload rates, the same nodes)."""
    topology = emulated_topology(cluster_topology(), plan)
    step = PSStep(workers=case.worker_nodes(), servers=case.server_nodes(), dense_bytes=float(model_bytes),
                  mode="sync", host_s_per_byte=host_s_per_byte)  # fmt: skip
    return simulate_ps(topology, step)


def calibrate_host(model_bytes: int, steps: int, warmup: int, tmp: Path, runs: int = 3) -> float:
    """Seconds a process spends per byte of a message it sends or receives, from loopback 1 x 1 steps (the
    module docstring says why a step is four such pieces of work)."""
    step_s = statistics.median(
        statistics.median(run_loopback(Case(1, 1), model_bytes, steps, warmup, tmp / f"calibrate{i}"))
        for i in range(runs)
    )
    return step_s / (4 * model_bytes)


def measure(args: argparse.Namespace) -> list[dict]:
    scale = args.mbit * 1e6 / 100e9
    plan = plan_emulation(cluster_topology(), scale=scale, tag="psval")
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        host = calibrate_host(args.model_bytes, args.steps, args.warmup, Path(tmp))
    print(f"host work: {host * 1e9:.2f} ns a byte ({1 / host / 1e9:.2f} GB/s) from loopback 1 x 1 steps", flush=True)
    with Emulation(plan), tempfile.TemporaryDirectory() as tmp:
        if args.queue_ms:
            set_queues(plan, args.queue_ms)
        check = verify(plan)
        print(f"emulated at {args.mbit} Mbit/s; path check {check['measured_bit_per_s'] / 1e6:.1f} Mbit/s "
              f"(configured {check['configured_bit_per_s'] / 1e6:.1f})", flush=True)  # fmt: skip
        for case in cases:
            result = predict(plan, case, args.model_bytes)
            hosted = predict(plan, case, args.model_bytes, host).time_s
            for repeat in range(args.repeats):
                run_dir = Path(tmp) / f"{case.name.replace(' ', '_')}-{repeat}"
                before = tcp_counters(plan)
                emulated, stagger = run_emulated(plan, case, args.model_bytes, args.steps, args.warmup, run_dir)
                tcp = {name: value - before[name] for name, value in tcp_counters(plan).items()}
                loopback = run_loopback(case, args.model_bytes, args.steps, args.warmup, run_dir / "lo")
                row = {"bench": "ps_step", "case": case.name, "servers": case.servers, "workers": case.workers,
                       "packed": case.packed, "repeat": repeat, "mbit_per_s": args.mbit,
                       "queue_ms": args.queue_ms or 10,
                       "model_bytes": args.model_bytes, "measured_step_s": statistics.median(emulated),
                       "steps_s": emulated, "pull_stagger_s": statistics.median(stagger), "tcp": tcp,
                       "loopback_step_s": statistics.median(loopback),
                       "predicted_step_s": result.time_s, "bottleneck": result.bottleneck.link.name,
                       "host_s_per_byte": host, "predicted_host_step_s": hosted,
                       "path_check_bit_per_s": check["measured_bit_per_s"], "load_average": os.getloadavg()[0],
                       "machine": MACHINE}  # fmt: skip
                row["error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
                row["error_host"] = hosted / row["measured_step_s"] - 1
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "steps_s"}), flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per case: the median of the repeats' step times, their spread, and the prediction's error against it."""
    out = []
    for name in dict.fromkeys(r["case"] for r in rows):
        runs = [r for r in rows if r["case"] == name]
        measured = statistics.median(r["measured_step_s"] for r in runs)
        spread = (max(r["measured_step_s"] for r in runs) - min(r["measured_step_s"] for r in runs)) / measured
        out.append({"bench": "ps_summary", "case": name, "mbit_per_s": runs[0]["mbit_per_s"],
                    "queue_ms": runs[0]["queue_ms"], "repeats": len(runs),
                    "measured_step_s": measured, "spread": spread, "predicted_step_s": runs[0]["predicted_step_s"],
                    "error": runs[0]["predicted_step_s"] / measured - 1,
                    "predicted_host_step_s": runs[0]["predicted_host_step_s"],
                    "error_host": runs[0]["predicted_host_step_s"] / measured - 1,
                    "loopback_step_s": statistics.median(r["loopback_step_s"] for r in runs),
                    "bottleneck": runs[0]["bottleneck"], "machine": MACHINE})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--mbit", type=float, default=100.0, help="emulated NIC rate, Mbit/s")
    parser.add_argument("--model-bytes", type=int, default=4 << 20, help="dense model pulled and pushed a step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (worker 0's init, connections)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--queue-ms", type=float, default=0, help="shaped queue depth (default: the emulator's)")
    parser.add_argument("--only", default="", help="comma-separated case names, e.g. '1s x 1w,2s x 2w packed'")
    args = parser.parse_args()
    rows = measure(args)
    summary = summarize(rows)
    print("\n| case | measured step (median of runs) | run-to-run spread | network alone | error "
          "| network + host | error | loopback step |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summary:
        print(f"| {s['case']} | {s['measured_step_s'] * 1e3:.0f} ms | {s['spread']:.1%} | "
              f"{s['predicted_step_s'] * 1e3:.0f} ms | {s['error']:+.1%} | {s['predicted_host_step_s'] * 1e3:.0f} ms "
              f"| {s['error_host']:+.1%} | {s['loopback_step_s'] * 1e3:.0f} ms |")  # fmt: skip
    for key, label in (("error", "network alone"), ("error_host", "network + host")):
        errors = sorted(abs(s[key]) for s in summary)
        print(f"{label}: median |error| {statistics.median(errors):.1%}, worst {errors[-1]:.1%} ({MACHINE})")
    suffix = "" if args.mbit == 100 else f"-{args.mbit:g}mbit"
    suffix += f"-queue{args.queue_ms:g}ms" if args.queue_ms else ""
    path = Path(args.out) / f"sim_validation-ps-emulated{suffix}.jsonl"
    with open(path, "w") as f:
        for row in rows + summary:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
