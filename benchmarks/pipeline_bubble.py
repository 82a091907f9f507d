"""Pipeline bubble measured against (p - 1) / (m + p - 1), GPipe and 1F1B, with activations held per stage.

    python benchmarks/pipeline_bubble.py --stages 2 4 --out docs/data/cpu-pipeline-bubble.jsonl

For each number of stages ``p``, one launch of ``p`` Gloo ranks (:func:`dtrain.bench.launch.run_ranks`); every
rank trains its stage of an MLP of ``--layers`` Linear(width, width) + GELU layers with
:class:`~dtrain.parallel.pipeline_parallel.PipelineParallel`, for every micro-batch count ``m`` and both
schedules. After ``--warmup`` untimed steps, ``--steps`` timed steps; a step's time is the slowest stage's, the
figure the median. The bubble is :func:`~dtrain.parallel.pipeline_schedules.bubble_fraction` of all stages'
timelines (gathered to rank 0; ranks of one host share the clock) of the last timed step, beside the median
over the timed steps and :func:`~dtrain.parallel.pipeline_schedules.theoretical_bubble`. Peak activations are
each stage's most micro-batches held at once (``Timeline.peak_activations``): GPipe ``m``, 1F1B ``min(p - s, m)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.bench.launch import run_ranks
from dtrain.parallel.pipeline_parallel import PipelineParallel
from dtrain.parallel.pipeline_schedules import Timeline, bubble_fraction, theoretical_bubble

SCHEDULES = ("gpipe", "1f1b")


def _model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model and keeps its own stage of it
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))


def _expected_peak(schedule: str, p: int, m: int, stage: int) -> int:
    return m if schedule == "gpipe" else min(p - stage, m)


def _measure(args: argparse.Namespace, schedule: str, m: int) -> dict | None:
    """Time ``schedule`` with ``m`` micro-batches on this group; rank 0 gets the record, the others None."""
    p, rank = dist.get_world_size(), dist.get_rank()
    pipe = PipelineParallel(_model(args.layers, args.width), dist.group.WORLD, num_microbatches=m, schedule=schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)  # (B, width)
    y = torch.randn(args.batch, args.width, generator=gen)  # (B, width)
    step_s, bubbles = [], []
    timelines: list[Timeline | None] = [None] * p
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_gather_object(timelines, pipe.timeline)
        if step >= args.warmup:
            step_s.append(elapsed.item())
            bubbles.append(bubble_fraction(timelines))
    if rank:
        return None
    peaks = [t.peak_activations for t in timelines]
    expected = [_expected_peak(schedule, p, m, s) for s in range(p)]
    if peaks != expected:
        raise AssertionError(f"{schedule} p={p} m={m}: peak activations per stage {peaks}, expected {expected}")
    return {
        "schedule": schedule,
        "stages": p,
        "microbatches": m,
        "batch": args.batch,
        "layers": args.layers,
        "width": args.width,
        "bubble_measured": bubbles[-1],
        "bubble_measured_median": statistics.median(bubbles),
        "bubble_theory": theoretical_bubble(p, m),
        "step_s": statistics.median(step_s),
        "step_s_all": step_s,
        "busy_s_per_stage": [t.busy_s() for t in timelines],
        "peak_activations_per_stage": peaks,
        "warmup": args.warmup,
        "steps": args.steps,
    }


def _rank_main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    records = []
    for m in args.microbatches:
        for schedule in SCHEDULES:
            record = _measure(args, schedule, m)
            if record is not None:
                records.append(record)
    return records


def table(records: list[dict]) -> str:
    """Markdown: per (p, m), the theory and per schedule the measured bubble, step time and peak activations."""
    lines = [
        "| p | m | theory | GPipe bubble | 1F1B bubble | GPipe step ms | 1F1B step ms "
        "| GPipe peak act. | 1F1B peak act. |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p, m in dict.fromkeys((r["stages"], r["microbatches"]) for r in records):
        at = {r["schedule"]: r for r in records if r["stages"] == p and r["microbatches"] == m}
        g, o = at["gpipe"], at["1f1b"]
        peaks = [",".join(map(str, r["peak_activations_per_stage"])) for r in (g, o)]
        lines.append(
            f"| {p} | {m} | {g['bubble_theory']:.2f} | {g['bubble_measured']:.2f} | {o['bubble_measured']:.2f} | "
            f"{g['step_s'] * 1e3:.1f} | {o['step_s'] * 1e3:.1f} | {peaks[0]} | {peaks[1]} |"
        )
    return "\n".join(lines)


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({r["stages"] for r in records}), figsize=(10, 4), squeeze=False)
    for ax, p in zip(axes[0], sorted({r["stages"] for r in records}), strict=True):
        rows = [r for r in records if r["stages"] == p]
        ms = sorted({r["microbatches"] for r in rows})
        ax.plot(ms, [theoretical_bubble(p, m) for m in ms], "k--", label="(p-1)/(m+p-1)")
        for schedule, marker in zip(SCHEDULES, "os", strict=True):
            pts = sorted((r["microbatches"], r["bubble_measured"]) for r in rows if r["schedule"] == schedule)
            ax.plot(*zip(*pts, strict=True), marker=marker, label=f"{schedule} measured")
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble fraction", title=f"p = {p}", ylim=(0, 1))
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file to write (and a .png beside it)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    records = []
    for p in args.stages:
        start = time.perf_counter()
        records += run_ranks(_rank_main, p, args)
        print(f"p={p}: {time.perf_counter() - start:.1f} s")
    machine = {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": "cpu",
        "backend": "gloo",
        "threads_per_rank": 1,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps({**r, **machine}) + "\n" for r in records))
        _plot(records, args.out.with_suffix(".png"))
    print(f"batch {args.batch}, {args.layers} x Linear({args.width}, {args.width}) + GELU; {machine}")
    print(table(records))


if __name__ == "__main__":
    main()
