"""Usage: python benchmarks/pipeline/bubble.py [--stages 2 4] [--out FILE] | --report FILE... [--plot PNG]

Pipeline bubble measured against (p - 1) / (v m + p - 1): GPipe, 1F1B and interleaved 1F1B, with the
activations each stage holds.

    python benchmarks/pipeline/bubble.py --stages 2 4 --out benchmarks/results/cpu-pipeline-bubble.jsonl    # CPU, Gloo
    torchrun --nproc-per-node 4 benchmarks/pipeline/bubble.py --layers 32 --width 4096 --batch 8192 \\
        --out runs/bubble-p4.jsonl                                                      # GPUs, NCCL, p = 4
    python benchmarks/pipeline/bubble.py --report runs/bubble-p2.jsonl runs/bubble-p4.jsonl  # table, plot

One launch a pipeline depth ``p``: on the CPU, ``p`` Gloo ranks for each of ``--stages``
(:func:`dtrain.launch.run_ranks`); under torchrun, ``p`` is the number of ranks, one stage a GPU. An MLP
of ``--layers`` x (Linear(width, width) + GELU), MSE loss, is trained with
:class:`~dtrain.parallel.pipeline_parallel.PipelineParallel` for every micro-batch count ``m`` and schedule
(interleaved 1F1B with ``--virtual-stages`` chunks a rank where ``m`` is a multiple of ``p``). Rank 0 prints each
row as a JSON line the moment it is measured and appends it to ``--out``. Per row:

- ``step_s``: the slowest stage's time of ``train_step`` (synchronized before and after, optimizer step
  excluded), the median over ``--steps`` timed steps after ``--warmup``.
- ``bubble_measured``: 1 - (sum over stages of ``busy_s``) / (p x ``step_s``), the idle share of the step.
  ``busy_s`` is what the stage's own compute of a step takes alone: the forward and backward of its ``m``
  micro-batches through its chunks, back to back, with no communication (on the CPU one stage at a time, as
  the ranks share cores), the median of ``--steps`` runs. Communication and waiting both count as bubble, as
  they do in the theory's (p - 1) / (v m + p - 1) (GPipe paper section 2.3; Megatron-LM paper section 2.2).
- ``bubble_timeline``: :func:`~dtrain.parallel.pipeline_schedules.bubble_fraction` of the stages' timelines of
  the last timed step: host clock readings around each action on the CPU, the devices' own times on a GPU
  (``PipelineParallel.device_clock``; the timed step's CUDA events, ``timeline_clock``).
- ``peak_activations_per_stage``: the most micro-batches a stage held at once (``Timeline.peak_activations``),
  against ``peak_expected_per_stage`` (GPipe m; 1F1B min(p - s, m); interleaved min(2 (p - 1 - s) +
  (v - 1) p + 1, v m), the warm-up of Megatron-LM plus the first steady forward).
- GPU only: ``peak_step_bytes_per_stage``, the most memory a step allocated above what the stage held before it
  (weights, gradients), from ``torch.cuda.max_memory_allocated``, beside ``microbatch_activation_bytes_per_stage``
  (what one micro-batch's forward leaves allocated) times the peak held micro-batches.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.launch import rank_device, run_ranks, under_torchrun
from dtrain.parallel.pipeline_parallel import PipelineParallel
from dtrain.parallel.pipeline_schedules import theoretical_bubble

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


class StallGuard:
    """A deadline for each configuration of a sweep, re-armed by :meth:`arm`.

    At 90% of ``seconds`` rank 0 prints and appends to ``out`` a row naming the configuration with
    ``"stalled_after_s"`` (from a Python thread: best effort, it needs the interpreter lock); at ``seconds``
    :mod:`faulthandler` prints every thread's stack and ends the process, which needs no lock. An NCCL exchange
    that deadlocks never returns, so ending the process is the only way out; the rows measured before stay.
    """

    def __init__(self, seconds: float, out: Path | None, rank: int) -> None:
        self.seconds, self.out, self.rank = seconds, out, rank
        self._timer: threading.Timer | None = None

    def arm(self, what: dict) -> None:
        self.cancel()
        if not self.seconds:
            return
        faulthandler.dump_traceback_later(self.seconds, exit=True)
        self._timer = threading.Timer(0.9 * self.seconds, self._report, [what])
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _report(self, what: dict) -> None:
        if self.rank:
            return
        row = what | {"stalled_after_s": round(0.9 * self.seconds, 1)}
        print(json.dumps(row), flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


def _model(layers: int, width: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model and keeps its own stage of it
    with device:
        return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))


def expected_peak(schedule: str, p: int, m: int, stage: int, v: int = 1) -> int:
    """Micro-batches stage ``stage`` of ``p`` holds at most: GPipe all ``m``; 1F1B its warm-up ``p - 1 - s`` plus
    one; interleaved 1F1B its warm-up 2 (p - 1 - s) + (v - 1) p (Narayanan et al. 2021) plus one, of ``v m``."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    if schedule == "zb-h1":  # 1F1B's plus the W's held back for the cool-down: p at most (Qi et al. 2024)
        return min(p, m + stage)
    if schedule == "zb-v":  # 2 chunks of half a stage each, within 1F1B's p stage-sized micro-batches
        return min(2 * p, 2 * m)
    return min(2 * (p - 1 - stage) + (v - 1) * p + 1, v * m)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    dist.barrier()
    _sync(device)


def _stage_busy_s(pipe: PipelineParallel, args: argparse.Namespace, m: int, device: torch.device) -> float:
    """Seconds this rank's chunks take for the forward and backward of ``m`` micro-batches alone, back to back."""
    rows = args.batch // m
    x = torch.randn(rows, args.width, device=device)  # (B / m, width)
    grad = torch.randn(rows, args.width, device=device)  # (B / m, width)

    def one_step() -> None:
        for _ in range(m):
            for chunk in pipe.chunks:
                inp = x if chunk.is_first else x.detach().requires_grad_()
                out = chunk(inp)
                if chunk.is_last:
                    (F.mse_loss(out, grad) / m).backward()
                else:
                    out.backward(grad)

    one_step()  # warm-up
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        one_step()
        _sync(device)
        times.append(time.perf_counter() - start)
    for q in pipe.parameters():
        q.grad = None
    return statistics.median(times)


def _serially(fn, device: torch.device):
    """``fn()`` on every rank; on the CPU one rank after another (the ranks share cores), on GPUs all at once."""
    if device.type == "cuda":
        return fn()
    result = None
    for turn in range(dist.get_world_size()):
        if dist.get_rank() == turn:
            result = fn()
        dist.barrier()
    return result


def _activation_bytes(pipe: PipelineParallel, args: argparse.Namespace, m: int, device: torch.device) -> int:
    """Bytes one micro-batch's forward through this rank's chunks leaves allocated (its saved activations)."""
    if device.type != "cuda":
        return 0
    x = torch.randn(args.batch // m, args.width, device=device).requires_grad_()
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    outs = [chunk(x) for chunk in pipe.chunks]
    _sync(device)
    held = torch.cuda.memory_allocated(device) - before
    del outs
    return held


def _measure(args: argparse.Namespace, schedule: str, m: int, device: torch.device) -> dict | None:
    """Time ``schedule`` with ``m`` micro-batches; rank 0 gets the record, the others None."""
    p, rank = dist.get_world_size(), dist.get_rank()
    v = args.virtual_stages if schedule == "interleaved-1f1b" else 1
    extra = {"virtual_stages": v} if v > 1 else {}
    model = _model(args.layers, args.width, device)
    pipe = PipelineParallel(model, dist.group.WORLD, num_microbatches=m, schedule=schedule, **extra)
    del model  # the stage keeps its own layers
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)  # (B, width)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)  # (B, width)
    step_s, base_bytes, peak_bytes = [], 0, 0
    for step in range(args.warmup + args.steps):
        _barrier(device)
        if device.type == "cuda":
            base_bytes = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            pipe.device_clock = step == args.warmup + args.steps - 1  # the last step's actions timed on the GPU
        start = time.perf_counter()
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if device.type == "cuda":
            peak_bytes = torch.cuda.max_memory_allocated(device) - base_bytes
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: the peak above is the step's own
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            step_s.append(elapsed.item())
    timeline = pipe.timeline
    busy = _serially(lambda: _stage_busy_s(pipe, args, m, device), device)
    act = _activation_bytes(pipe, args, m, device)
    mine = [timeline.start_s, timeline.end_s, timeline.busy_s(), busy, timeline.peak_activations, peak_bytes, act]
    stages = [torch.zeros(len(mine), dtype=torch.float64, device=device) for _ in range(p)]
    dist.all_gather(stages, torch.tensor(mine, dtype=torch.float64, device=device))
    if rank:
        return None
    return _record(args, schedule, m, v, statistics.median(step_s), step_s, [t.tolist() for t in stages], device)


def _record(args, schedule: str, m: int, v: int, step: float, step_all: list, stages: list, device) -> dict:
    p = len(stages)
    starts, ends, timeline_busy, busy, held, peak_bytes, act = (list(column) for column in zip(*stages, strict=True))
    span = max(ends) - min(starts)
    on_gpu = device.type == "cuda"
    return {
        "schedule": schedule,
        "stages": p,
        "microbatches": m,
        "virtual_stages": v,
        "batch": args.batch,
        "layers": args.layers,
        "width": args.width,
        "bubble_theory": theoretical_bubble(p, m, v),
        "bubble_measured": 1 - sum(busy) / (p * step),
        "bubble_timeline": 1 - sum(timeline_busy) / (p * span),
        "timeline_clock": "device" if on_gpu else "host",
        "step_s": step,
        "step_s_all": step_all,
        "busy_s_per_stage": busy,
        "peak_activations_per_stage": [int(h) for h in held],
        "peak_expected_per_stage": [expected_peak(schedule, p, m, s, v) for s in range(p)],
        "peak_step_bytes_per_stage": [int(b) for b in peak_bytes] if on_gpu else None,
        "microbatch_activation_bytes_per_stage": [int(a) for a in act] if on_gpu else None,
        "warmup": args.warmup,
        "steps": args.steps,
    }


def _machine(device: torch.device) -> dict:
    info = {
        "hostname": platform.node(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    if device.type == "cuda":
        cuda = {"device": torch.cuda.get_device_name(device), "backend": "nccl", "matmul": "fp32 with TF32"}
        return info | cuda | {"nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return info | {"device": "cpu", "backend": "gloo", "cpu_count": os.cpu_count(), "threads_per_rank": 1}


def _rank_main(args: argparse.Namespace) -> None:
    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    p = dist.get_world_size()
    machine = _machine(device)
    guard = StallGuard(args.stall_s, args.out, dist.get_rank())
    for schedule in args.schedules:  # a schedule at a time: one that deadlocks leaves the others' rows
        for m in args.microbatches:
            v = args.virtual_stages if schedule == "interleaved-1f1b" else 1
            if v > 1 and (m % p or args.layers < v * p):
                continue  # interleaved takes micro-batches in groups of p, and needs a layer a chunk
            guard.arm({"schedule": schedule, "stages": p, "microbatches": m, "virtual_stages": v} | machine)
            record = _measure(args, schedule, m, device)
            if record is not None:
                print(json.dumps(_brief(record)), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(record | machine) + "\n")
    guard.cancel()


def _brief(record: dict) -> dict:
    keys = ("schedule", "stages", "microbatches", "bubble_theory", "bubble_measured", "bubble_timeline", "step_s")
    brief = {k: round(record[k], 4) if isinstance(record[k], float) else record[k] for k in keys}
    return brief | {
        "peak_held": record["peak_activations_per_stage"],
        "peak_bytes": record["peak_step_bytes_per_stage"],
    }


def table(records: list[dict]) -> str:
    """Markdown: a row per (p, m, schedule): theory, measured bubble, step time, peak held and peak step memory."""
    lines = [
        "| p | m | schedule | theory | bubble measured | bubble (timeline) | step ms | peak held (expected) "
        "| peak step MB per stage |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {s: i for i, s in enumerate(SCHEDULES)}
    for r in sorted(records, key=lambda r: (r["stages"], r["microbatches"], order[r["schedule"]])):
        held = ",".join(map(str, r["peak_activations_per_stage"]))
        # absent from the records of bubble-cpu2.jsonl
        expected = ",".join(map(str, r.get("peak_expected_per_stage") or []))
        held += f" ({expected})" if expected else ""
        timeline = "-" if r.get("bubble_timeline") is None else f"{r['bubble_timeline']:.2f}"
        mb = (
            "-"
            if r.get("peak_step_bytes_per_stage") is None
            else ",".join(f"{b / 2**20:.0f}" for b in r["peak_step_bytes_per_stage"])
        )
        lines.append(
            f"| {r['stages']} | {r['microbatches']} | {r['schedule']} | {r['bubble_theory']:.2f} "
            f"| {r['bubble_measured']:.2f} | {timeline} | {r['step_s'] * 1e3:.1f} | {held} | {mb} |"
        )
    return "\n".join(lines)


def _plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the table and the JSON lines carry the same figures
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["stages"] for r in records})
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 4), squeeze=False)
    for ax, p in zip(axes[0], depths, strict=True):
        rows = [r for r in records if r["stages"] == p]
        ms = sorted({r["microbatches"] for r in rows})
        ax.plot(ms, [theoretical_bubble(p, m) for m in ms], "k--", label="(p-1)/(m+p-1)")
        vs = sorted({r.get("virtual_stages", 1) for r in rows if r.get("virtual_stages", 1) > 1})
        for v in vs:
            ax.plot(ms, [theoretical_bubble(p, m, v) for m in ms], "k:", label=f"(p-1)/({v}m+p-1)")
        for schedule, marker in zip(SCHEDULES, "os^", strict=True):
            pts = sorted((r["microbatches"], r["bubble_measured"]) for r in rows if r["schedule"] == schedule)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marker, label=f"{schedule} measured")
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble fraction", title=f"p = {p}", ylim=(0, 1))
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _report(paths: list[Path], plot: Path | None) -> None:
    found = [path for path in paths if path.exists()]  # a launch cut short may have left none
    rows = [json.loads(line) for path in found for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in rows if "stalled_after_s" not in r]
    for r in rows:
        if "stalled_after_s" in r:
            print(f"STALLED: {r['schedule']} p={r['stages']} m={r['microbatches']} after {r['stalled_after_s']} s")
    if not records:
        raise SystemExit(f"no records in {', '.join(map(str, paths))}")
    first = records[0]
    print(
        f"batch {first['batch']}, {first['layers']} x Linear({first['width']}, {first['width']}) + GELU; "
        f"{first['device']}, {first['backend']}, torch {first['torch_version']}"
    )
    print(table(records))
    if plot:
        _plot(records, plot)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: every micro-batch count divides the batch, counts are at least 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="CPU: p of each launch (torchrun: ranks)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="in this order")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--virtual-stages", type=int, default=2, help="model chunks a rank for interleaved 1F1B")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--stall-s",
        type=float,
        default=0,
        help="a configuration running longer: a stalled row, every stack, exit (0: never)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file, appended row by row")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="print the table of these files, plot")
    parser.add_argument("--plot", type=Path, default=None, help="with --report: write the bubble plot here")
    args = parser.parse_args(argv)
    if any(args.batch % m for m in args.microbatches) or min(args.warmup, args.steps, args.virtual_stages) < 1:
        parser.error(
            f"--batch {args.batch} must split into each of {args.microbatches} micro-batches, and "
            "--warmup, --steps and --virtual-stages must be at least 1"
        )
    return args


def main() -> None:
    args = parse_args()
    if args.report:
        _report(args.report, args.plot)
        return
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("")
    if under_torchrun():
        run_ranks(_rank_main, 0, args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for p in args.stages:
        start = time.perf_counter()
        run_ranks(_rank_main, p, args)
        print(f"p={p}: {time.perf_counter() - start:.1f} s", flush=True)
    if args.out:
        _report([args.out], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
