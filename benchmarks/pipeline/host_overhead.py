"""Usage: python benchmarks/pipeline/host_overhead.py [--nproc 4] [--schedules 1f1b,...] [--microbatches 16]
[--profile DIR] [--out FILE]

The host time the pipeline runtime spends per action (one F, B or W of one micro-batch on one stage), apart from
the compute itself. On a GPU the host only issues work, and once the micro-batches are small its time per action
sets the pace of a step (``host_issue_ms_per_stage`` of ``dtrain bench pipeline``); this is its CPU proxy.

``--nproc`` Gloo ranks train ``--layers`` x (Linear(width, width) + GELU) with
:class:`~dtrain.parallel.pipeline_parallel.PipelineParallel`, micro-batches of ``--rows`` rows (tiny by default, so
that the compute is small beside the runtime's bookkeeping and messages). Per rank, on the main thread's CPU clock
(``time.thread_time``, which does not count the time the process waits or is descheduled, so other processes on
the machine change it little):

- ``step_cpu_us``: one ``train_step``, the median of ``--repeats`` runs of ``--steps`` steps;
- ``compute_cpu_us``: the same forwards and backwards through the rank's chunks alone, back to back, no messages;
- ``runtime_us_per_action``: (``step_cpu_us`` - ``compute_cpu_us``) / actions of the rank's schedule, per stage.

``--profile DIR`` writes one cProfile file a rank and schedule, ``DIR/<schedule>-m<m>-rank<r>.prof``, of the timed
steps on the CPU clock (read with ``python -m pstats``). Rank 0 prints one JSON line per schedule and appends it
to ``--out``; the row carries the git commit of the code measured.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.launch import run_ranks
from dtrain.parallel.pipeline_parallel import PipelineParallel


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "dtrain"], capture_output=True, text=True).stdout
        return out.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _rank(args: argparse.Namespace, schedule: str, m: int) -> dict | None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)))
    pipe = PipelineParallel(model, dist.group.WORLD, num_microbatches=m, schedule=schedule)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(m * args.rows, args.width, generator=gen), torch.randn(m * args.rows, args.width, generator=gen)

    def step() -> None:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
        for q in pipe.parameters():
            q.grad = None

    one = x[: args.rows]

    def compute() -> None:
        for _ in range(m):
            for chunk in pipe.chunks:
                # the first chunk's input is data: no gradient flows into it in the step either
                out = chunk(one.detach().requires_grad_(not chunk.is_first))
                F.mse_loss(out, one).backward() if chunk.is_last else out.backward(one)
        for q in pipe.parameters():
            q.grad = None

    def cpu_per_call(fn, profile: cProfile.Profile | None = None) -> float:
        start = time.thread_time()
        if profile is not None:
            profile.enable()
        for _ in range(args.steps):
            fn()
        if profile is not None:
            profile.disable()
        return (time.thread_time() - start) / args.steps

    for _ in range(3):
        step()
    compute()
    steps, computes = [], []
    for _ in range(args.repeats):
        dist.barrier()
        steps.append(cpu_per_call(step))
        computes.append(cpu_per_call(compute))
    if args.profile:
        profile = cProfile.Profile(time.thread_time)
        dist.barrier()
        cpu_per_call(step, profile)
        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, f"{schedule}-m{m}-rank{dist.get_rank()}.prof")
        profile.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)
    mine = torch.tensor([statistics.median(steps), statistics.median(computes), len(pipe.actions)], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() != 0:
        return None
    rows = [r.tolist() for r in every]
    return {
        "schedule": schedule,
        "stages": len(rows),
        "microbatches": m,
        "actions_per_stage": [int(n) for _, _, n in rows],
        "step_cpu_us_per_stage": [round(s * 1e6, 1) for s, _, _ in rows],
        "compute_cpu_us_per_stage": [round(c * 1e6, 1) for _, c, _ in rows],
        "runtime_us_per_action_per_stage": [round((s - c) / n * 1e6, 1) for s, c, n in rows],
        "runtime_us_per_action": round(sum(s - c for s, c, _ in rows) / sum(n for _, _, n in rows) * 1e6, 1),
        "layers": args.layers,
        "width": args.width,
        "rows": args.rows,
        "device": "cpu",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--schedules", type=lambda t: t.split(","), default=["1f1b", "interleaved-1f1b", "zb-h1"])
    p.add_argument("--microbatches", type=lambda t: [int(v) for v in t.split(",")], default=[16])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--rows", type=int, default=1, help="rows of one micro-batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default=None, help="directory for one cProfile file a rank and schedule")
    p.add_argument("--out", default=None, help="JSON lines to append to")
    args = p.parse_args(argv)
    if min(args.nproc, args.layers, args.width, args.rows, args.steps, args.repeats) < 1:
        raise SystemExit("--nproc, --layers, --width, --rows, --steps and --repeats must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    commit = _commit()
    for schedule in args.schedules:
        for m in args.microbatches:
            row = run_ranks(_rank, args.nproc, args, schedule, m)
            row["commit"] = commit
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
