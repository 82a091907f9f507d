"""Usage: torchrun --nproc-per-node N benchmarks/pipeline/device_profile.py [--schedules 1f1b,interleaved-1f1b]
[--microbatches 16] [--groups 0,8] [--batch 1024] [--layers 16] [--width 4096] [--steps 5] [--out FILE]

Where a pipeline step's time goes on each GPU, from the device's own clock. Each stage records its whole step as
one CUDA graph over the peer channels (``PipelineParallel(graphs="step")``, what ``dtrain bench pipeline
--graphs step`` times) and replays it ``--steps`` times under ``torch.profiler``; then the same forwards and
backwards alone, back to back and recorded as one graph, which ``dtrain bench pipeline`` counts as the stage's
compute. Per rank and variant, in milliseconds a step:

- ``step_ms``: the step's wall-clock time (the slowest rank's, between two synchronizations);
- ``compute_ms``: the step's kernels other than copies and memory operations, summed;
- ``alone_ms``: the same kernels' sum when the forwards and backwards run alone (``compute_ms - alone_ms``: what
  running beside the pipeline's messages costs them), and ``alone_wall_ms`` their wall-clock time, gaps between
  kernels included (what ``dtrain bench pipeline`` counts as the stage's compute);
- ``copy_ms``: the copies the device runs (into a peer's slot, out of this rank's), summed;
- ``busy_ms``: the union of every kernel and copy interval (what the GPU was doing anything);
- ``idle_ms``: ``step_ms - busy_ms``, the stage waiting.

``--groups``: interleaved 1F1B's micro-batch groups (0: the stages' count). Rank 0 prints one line a variant with
every rank's figures and appends JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dtrain.cli.bench_pipeline import _graphed
from dtrain.launch import init_rank, rank_device
from dtrain.parallel.pipeline_parallel import PipelineParallel
from dtrain.parallel.pipeline_schedules import chunks_per_stage, theoretical_bubble

_COPY = ("memcpy", "memset", "Memcpy", "Memset")


def _model(width: int, layers: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    with device:
        return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))


def _device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel and copy the profiler saw on the device, but NCCL's (the barrier and
    the all-reduce of the wall-clock times between the steps, whose kernels spin while other ranks catch up)."""
    out = []
    for e in prof.events():
        if (
            e.device_type == torch.autograd.DeviceType.CUDA
            and e.time_range.elapsed_us() > 0
            and not e.name.startswith("nccl")
        ):
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def _by_name(events: list[tuple[str, float, float]], runs: int) -> dict[str, tuple[float, float]]:
    """Per kernel name: (milliseconds a step, calls a step)."""
    out: dict[str, list[float]] = {}
    for n, a, b in events:
        got = out.setdefault(n[:90], [0.0, 0.0])
        got[0] += (b - a) / runs / 1e3
        got[1] += 1 / runs
    return {n: (round(t, 4), round(c, 2)) for n, (t, c) in out.items()}


def _gaps(events: list[tuple[str, float, float]], windows: list[tuple[float, float]]) -> list[float]:
    """Idle milliseconds in each fifth of a step (the device doing nothing, NCCL's kernels counted as idle),
    summed over the steps whose (start, end) device times are ``windows``."""
    fifths = [0.0] * 5
    spans = sorted((a, b) for n, a, b in events if not n.startswith("exchange"))
    for lo, hi in windows:
        cursor = lo
        for a, b in spans:
            if b <= lo or a >= hi:
                continue
            a, b = max(a, lo), min(b, hi)
            if a > cursor:  # idle from cursor to a, spread over the fifths it covers
                for k in range(5):
                    f0, f1 = lo + (hi - lo) * k / 5, lo + (hi - lo) * (k + 1) / 5
                    fifths[k] += max(0.0, min(a, f1) - max(cursor, f0))
            cursor = max(cursor, b)
        for k in range(5):
            f0, f1 = lo + (hi - lo) * k / 5, lo + (hi - lo) * (k + 1) / 5
            fifths[k] += max(0.0, min(hi, f1) - max(cursor, f0))
    return [round(x / len(windows) / 1e3, 3) for x in fifths]


def _sums(events: list[tuple[str, float, float]], runs: int) -> dict:
    compute = sum(b - a for n, a, b in events if not n.startswith(_COPY)) / runs / 1e3
    copy = sum(b - a for n, a, b in events if n.startswith(_COPY)) / runs / 1e3
    busy, end = 0.0, float("-inf")
    for _, a, b in sorted(events, key=lambda e: e[1]):
        if a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return {"compute_ms": compute, "copy_ms": copy, "busy_ms": busy / runs / 1e3}


def _alone(pipe: PipelineParallel, m: int, rows: int, width: int, device: torch.device):
    """The stage's forwards and backwards alone, back to back, recorded as one graph (bench pipeline's compute)."""
    x = torch.randn(rows, width, device=device)

    def once() -> None:
        for _ in range(m):
            for chunk in pipe.chunks:
                out = chunk(x.detach().requires_grad_(not chunk.is_first))
                F.mse_loss(out, x).backward() if chunk.is_last else out.backward(x)

    return _graphed(once, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,interleaved-1f1b")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--groups", default="0")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    init_rank()
    device = rank_device()
    torch.cuda.set_device(device)
    rank, p = dist.get_rank(), dist.get_world_size()
    m, rows = args.microbatches, args.batch // args.microbatches
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)
    for name in args.schedules.split(","):
        groups = [int(g) or p for g in args.groups.split(",")] if name == "interleaved-1f1b" else [p]
        for group in dict.fromkeys(g for g in groups if g % p == 0 and m % g == 0):
            pipe = PipelineParallel(
                _model(args.width, args.layers, device),
                dist.group.WORLD,
                num_microbatches=m,
                schedule=name,
                graphs="step",
                microbatch_group=group if name == "interleaved-1f1b" and group != p else None,
            )

            def step(pipe=pipe) -> None:
                pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
                for q in pipe.parameters():
                    q.grad = None

            for _ in range(4):  # eager, eager (shapes agreed), recorded, replayed
                step()
            walls = []
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    dist.barrier()
                    torch.cuda.synchronize(device)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    torch.cuda.synchronize(device)
                    wall = torch.tensor([start.elapsed_time(end)], device=device)
                    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                    walls.append(wall.item())
            step_events = _device_events(prof)
            in_step = _sums(step_events, args.steps)
            # each step lies between its barrier's NCCL kernel and the all-reduce of its wall time
            nccl = sorted(
                (float(e.time_range.start), float(e.time_range.end))
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("nccl")
            )
            windows = [(nccl[2 * i][1], nccl[2 * i + 1][0]) for i in range(len(nccl) // 2)]
            in_step["idle_by_fifth_ms"] = _gaps(step_events, windows) if len(nccl) == 2 * args.steps else None
            alone = _alone(pipe, m, rows, args.width, device)
            alone()
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    alone()
                torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                alone()
            end.record()
            torch.cuda.synchronize(device)
            alone_wall = start.elapsed_time(end) / args.steps
            alone_events = _device_events(prof)
            alone_ms = _sums(alone_events, args.steps)["compute_ms"]
            kernels = {"step": _by_name(step_events, args.steps), "alone": _by_name(alone_events, args.steps)}
            step_ms = statistics.median(walls)
            idle = step_ms - in_step["busy_ms"]
            fifths = in_step.pop("idle_by_fifth_ms")
            mine = {**in_step, "alone_ms": alone_ms, "alone_wall_ms": alone_wall, "idle_ms": idle}
            gathered: list = [None] * p
            dist.all_gather_object(gathered, fifths)
            every: list = [None] * p
            dist.all_gather_object(every, mine)
            names: list = [None] * p
            dist.all_gather_object(names, kernels)
            if rank == 0:
                row = {
                    "schedule": name,
                    "microbatch_group": group if name == "interleaved-1f1b" else None,
                    "stages": p,
                    "microbatches": m,
                    "batch": args.batch,
                    "step_ms": round(step_ms, 3),
                    "bubble_theory": round(theoretical_bubble(p, m, chunks_per_stage(name), schedule=name), 4),
                    "per_rank": [{k: round(v, 3) for k, v in r.items()} for r in every],
                    "kernels_per_rank": names,
                    # idle ms in each fifth of the step (an exchange kernel's spin counted idle), per rank
                    "idle_by_fifth_ms": gathered,
                    "device": torch.cuda.get_device_name(device),
                }
                print(
                    f"{name} g={row['microbatch_group']} m={m} step {step_ms:.2f} ms | "
                    + " | ".join(
                        f"r{i}: compute {r['compute_ms']:.2f} (alone {r['alone_ms']:.2f}, "
                        f"wall {r['alone_wall_ms']:.2f}) copy {r['copy_ms']:.2f} "
                        f"busy {r['busy_ms']:.2f} idle {r['idle_ms']:.2f}"
                        for i, r in enumerate(every)
                    ),
                    flush=True,
                )
                print("  idle ms by fifth of the step: " + " | ".join(f"r{i} {f}" for i, f in enumerate(gathered)))
                for i, k in enumerate(names):
                    for n in sorted(set(k["step"]) | set(k["alone"]), key=lambda n: -k["step"].get(n, (0, 0))[0])[:6]:
                        a, b = k["step"].get(n, (0.0, 0.0)), k["alone"].get(n, (0.0, 0.0))
                        print(f"  r{i} {n[:70]:70} step {a[0]:7.3f} ms x{a[1]:6.1f}  alone {b[0]:7.3f} ms x{b[1]:6.1f}")
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del pipe
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
