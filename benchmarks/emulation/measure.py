"""Usage: sudo python benchmarks/emulation/measure.py [--out benchmarks/results] [--scale 1e-3]

Measure collectives and training steps on an emulated leaf-spine cluster (needs root; a few minutes).

The cluster: the ``4-rack`` preset cut to 2 racks x 2 servers, one GPU's worth of ranks and one 100 Gb/s
Ethernet NIC a server, 2 spines, at 1:1 and 1:4 oversubscription, emulated at ``--scale`` (default 1e-3:
NICs at 100 Mb/s, a ToR's uplinks at 200 Mb/s (1:1) or 50 Mb/s (1:4) in all). Rates this low keep the network,
not Gloo's CPU work on this 2-core host, the bottleneck: a 4 MiB all-reduce moves its bytes in about a second,
its reductions take milliseconds.

Per case (oversubscription x placement) it builds the cluster, checks it (ping, one path's throughput), runs
``dtrain bench comm`` (all-reduce: ring, tree, recursive doubling, hierarchical with a rack as its node, and
Gloo's own) over 4 KiB .. 4 MiB and ``dtrain train`` (GPT-2 tiny, dp=4, ring all-reduce), and tears it down.
The same training run on 4 local ranks over loopback (no shaping) is the compute-and-CPU baseline the
prediction starts from. Raw records go to ``<out>/emulation-{collectives,train,checks}.jsonl``;
benchmarks/emulation/validate.py compares them with the simulator.

    sudo python benchmarks/emulation/measure.py [--out benchmarks/results] [--scale 1e-3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dtrain.cluster.presets import preset
from dtrain.emulate.build import Emulation
from dtrain.emulate.placement import placement_order, ranks_per_rack
from dtrain.emulate.plan import plan_emulation
from dtrain.emulate.run import JobConfig, run_job
from dtrain.emulate.verify import verify

#: (name, oversubscription, placement, all-reduce algorithms measured)
CASES = [
    ("1to1-packed", 1, "packed", "ring,tree,recursive_doubling,hierarchical,native"),
    ("1to4-packed", 4, "packed", "ring,tree,recursive_doubling,hierarchical,native"),
    ("1to4-interleaved", 4, "interleaved", "ring,recursive_doubling,native"),
]
TRAIN = ["train", "--model", "gpt2", "--preset", "tiny", "--dp", "4", "--batch-size", "16", "--seq-len", "64",
         "--steps", "8", "--algorithm", "ring", "--precision", "float32", "--no-export",
         "--no-tensorboard"]  # fmt: skip


def _gradient_bytes() -> int:
    """Float32 gradient bytes of the model TRAIN trains (the default dataset's 512-token vocabulary)."""
    from dtrain.models import build, preset

    return 4 * sum(p.numel() for p in build(preset("gpt2", "tiny", vocab_size=512)).parameters())


def cluster(oversubscription: int):
    """The emulated cluster of this benchmark (see the module docstring)."""
    return preset("4-rack", racks=2, servers_per_rack=2, gpus=1, nics=1, nic="ethernet100",
                  oversubscription=oversubscription)  # fmt: skip


def _bench(plan, local_size: int | None, algorithms: str, work: Path) -> list[dict]:
    out = work / "bench.jsonl"
    command = ["bench", "comm", "--collectives", "all_reduce", "--algorithms", algorithms, "--min-bytes", "4K",
               "--max-bytes", "4M", "--factor", "4", "--warmup", "1", "--iters", "2", "--trials", "3",
               "--out", str(out)]  # fmt: skip
    status = run_job(plan, JobConfig(command=command, local_size=local_size, log_dir=work, timeout_s=900))
    if status:
        raise RuntimeError(f"bench comm failed with status {status}; logs in {work}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def _train_steps(metrics: Path) -> list[float]:
    """Step times after the first (which pays for warm-up)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"step_s"' in line]
    return [r["step_s"] for r in rows[1:]]


def _train(plan, work: Path) -> dict:
    out = work / "train"
    command = [*TRAIN, "--algorithm", "ring", "--out", str(out)]
    status = run_job(plan, JobConfig(command=command, log_dir=work, timeout_s=600))
    if status:
        raise RuntimeError(f"train failed with status {status}; logs in {work}")
    steps = _train_steps(out / "metrics.jsonl")
    return {"kind": "train", "algorithm": "ring", "step_s": steps, "median_step_s": statistics.median(steps),
            "gradient_bytes": _gradient_bytes()}  # fmt: skip


def _local_baseline(work: Path) -> dict:
    """The same training on 4 local ranks over loopback: compute, CPU contention and Gloo's host costs."""
    out = work / "train-local"
    command = [sys.executable, "-m", "dtrain", *TRAIN, "--nproc", "4", "--algorithm", "ring", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    steps = _train_steps(out / "metrics.jsonl")
    return {"kind": "train-local", "algorithm": "ring", "step_s": steps, "median_step_s": statistics.median(steps),
            "gradient_bytes": _gradient_bytes()}  # fmt: skip


def measure_case(name: str, oversubscription: int, placement: str, algorithms: str, scale: float, work: Path):
    topology = cluster(oversubscription)
    plan = plan_emulation(topology, scale=scale, tag=f"v{oversubscription}{placement[0]}",
                          placement=placement_order(topology, placement))  # fmt: skip
    local = ranks_per_rack(plan, 1) if placement == "packed" else None
    if local is None:
        algorithms = ",".join(a for a in algorithms.split(",") if a != "hierarchical")
    base = {"case": name, "oversubscription": oversubscription, "placement": placement, "scale": scale,
            "servers": [s.server for s in plan.servers], "hierarchy_local_size": local}  # fmt: skip
    with Emulation(plan):
        check = verify(plan)
        bench = _bench(plan, local, algorithms, work / name)
        train = _train(plan, work / name)
    return {**base, "kind": "check", **check}, [{**base, "kind": "bench", **r} for r in bench], {**base, **train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--scale", type=float, default=1e-3)
    parser.add_argument("--work", default="runs/emulate-validate")
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    checks, bench, train = [], [], []
    started = time.time()
    for name, over, placement, algorithms in CASES:
        if name not in args.cases.split(","):
            continue
        check, records, step = measure_case(name, over, placement, algorithms, args.scale, work)
        checks.append(check)
        bench += records
        train.append(step)
        print(f"{name}: {len(records)} collective points, train step {step['median_step_s']:.3f} s "
              f"({time.time() - started:.0f} s so far)", flush=True)  # fmt: skip
    train.append({"case": "loopback", "scale": None, **_local_baseline(work)})
    machine = "this 2-core CPU machine, shared with other jobs"
    for label, rows in (("checks", checks), ("collectives", bench), ("train", train)):
        path = out / f"emulation-{label}.jsonl"
        path.write_text("".join(json.dumps({**r, "machine": machine}) + "\n" for r in rows))
        print(f"wrote {len(rows)} records to {path}")


if __name__ == "__main__":
    main()
