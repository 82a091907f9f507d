"""Usage: python benchmarks/training/dp_vs_ddp.py --nproc 1 2 4 1 [--out FILE]

Data parallel, ours against torch's DistributedDataParallel: same model, global batch and AdamW, one launch.

    python benchmarks/training/dp_vs_ddp.py --nproc 1 2 4 1 --out benchmarks/results/dp_vs_ddp-cpu2.jsonl

(the 1-rank launch repeated last shows how far the machine drifted during the run.)

For each world size, one launch (:func:`dtrain.launch.run_ranks`, Gloo on CPU): every rank builds each
model once, copies it into one replica per variant -- :class:`~dtrain.parallel.data_parallel.DataParallel`
with ``algorithm="auto"`` and ``"native"``, and ``DistributedDataParallel`` (on 1 rank: the plain module, no
wrapper) -- each with its own AdamW, warms every replica up, then times them in turns: window after window,
each replica runs ``--steps`` steps on the same pre-drawn shards of the same global batches, in an order that
rotates each window. A window's time is the slowest rank's; the figure is the median window. At the end every
replica has seen the same batches from the same weights, so ours and DDP must hold the same parameters: the
script asserts it (``torch.testing.assert_close``), which shows they did the same work.

Models: the GPT-2 ``tiny`` preset (:mod:`dtrain.models`, 512-token vocabulary) on uniform random token ids --
each global batch one ``(B, 65)`` draw from a seeded ``torch.Generator``, 64 input tokens and their 64 next-token
targets; a step's speed does not depend on the text -- and the MLP classifier of :mod:`dtrain.ps.classification`
(widened so that a step has measurable compute) on its synthetic batches. Scaling efficiency is throughput per
rank over the 1-rank throughput.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.launch import run_ranks
from dtrain.models import build, preset
from dtrain.parallel.data_parallel import DataParallel, split_batch
from dtrain.ps.classification import ClassificationBatches, mlp_classifier

VARIANTS_MULTI = ("ours-auto", "ours-native", "ddp")
SEED = 0
VOCAB = 512  # the GPT-2 tiny preset's vocabulary
BLOCK = 64  # tokens a sequence


@dataclass(kw_only=True)
class Workload:
    name: str
    model: nn.Module
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # global batches, one per step
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    global_batch: int  # samples per step
    tokens_per_sample: int


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # (B*T, V) against (B*T,)


def _token_batches(batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of uniform random token ids: inputs ``(B, T)`` and their next tokens ``(B, T)``."""
    gen = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (batch_size, BLOCK + 1), generator=gen)  # (B, T + 1)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _workloads(args: argparse.Namespace, total_steps: int) -> list[Workload]:
    torch.manual_seed(SEED)
    gpt = build(preset("gpt2", "tiny", vocab_size=VOCAB))
    mlp = mlp_classifier(in_features=64, hidden=args.mlp_hidden, num_layers=4, num_classes=10)
    cls = ClassificationBatches(in_features=64, num_classes=10, batch_size=args.mlp_batch, seed=SEED)
    return [
        Workload(
            name="gpt2-tiny",
            model=gpt,
            batches=_token_batches(args.gpt_batch, total_steps),
            loss_fn=_lm_loss,
            global_batch=args.gpt_batch,
            tokens_per_sample=BLOCK,
        ),
        Workload(
            name=f"mlp-{args.mlp_hidden}x4",
            model=mlp,
            batches=[cls.batch(s) for s in range(total_steps)],
            loss_fn=F.cross_entropy,
            global_batch=args.mlp_batch,
            tokens_per_sample=1,
        ),
    ]


def _wrap(variant: str, module: nn.Module, group) -> nn.Module:
    if variant == "single":
        return module
    if variant == "ddp":
        return DistributedDataParallel(module, process_group=group)  # bucket_cap_mb=25, as ours
    return DataParallel(module, group, algorithm=variant.removeprefix("ours-"))


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DataParallel | DistributedDataParallel) else model


def _run_steps(model, optimizer, shards, loss_fn) -> None:
    for x, y in shards:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _bench_workload(work: Workload, args: argparse.Namespace) -> list[dict]:
    world = dist.get_world_size()
    group = dist.group.WORLD
    variants = ("single",) if world == 1 else VARIANTS_MULTI
    shards = [split_batch(b, group) for b in work.batches] if world > 1 else work.batches
    replicas = {}
    for v in variants:
        model = _wrap(v, copy.deepcopy(work.model), group)
        replicas[v] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for v in variants:
        _run_steps(*replicas[v], shards[: args.warmup], work.loss_fn)
    window_s: dict[str, list[float]] = {v: [] for v in variants}
    for w in range(args.windows):
        lo = args.warmup + w * args.steps
        for v in variants[w % len(variants) :] + variants[: w % len(variants)]:
            dist.barrier()
            start = time.perf_counter()
            _run_steps(*replicas[v], shards[lo : lo + args.steps], work.loss_fn)
            window_s[v].append(_slowest(time.perf_counter() - start))
    max_diff = _check_same_parameters(replicas) if world > 1 else {}
    params = sum(p.numel() for p in work.model.parameters())
    records = []
    for v in variants:
        median_s = statistics.median(window_s[v])
        samples_per_s = work.global_batch * args.steps / median_s
        records.append(
            {
                "model": work.name,
                "variant": v,
                "world_size": world,
                "parameters": params,
                "global_batch": work.global_batch,
                "tokens_per_sample": work.tokens_per_sample,
                "steps_per_window": args.steps,
                "windows": args.windows,
                "warmup": args.warmup,
                "window_s": window_s[v],
                "step_s": median_s / args.steps,
                "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * work.tokens_per_sample,
                "max_abs_param_diff_vs_ddp": max_diff.get(v),
            }
        )
    return records


def _check_same_parameters(replicas: dict) -> dict[str, float]:
    """Ours and DDP, started from the same weights on the same batches, must end with the same parameters."""
    reference = list(_inner(replicas["ddp"][0]).parameters())
    diffs = {"ddp": 0.0}
    for v in VARIANTS_MULTI[:-1]:
        ours = list(_inner(replicas[v][0]).parameters())
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, v=v: f"{v} against ddp: {m}")
        diffs[v] = max((a - b).abs().max().item() for a, b in zip(ours, reference, strict=True))
    return diffs


def _rank_main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)  # one core per rank, for every world size including 1
    records = []
    for work in _workloads(args, args.warmup + args.windows * args.steps):
        records += _bench_workload(work, args)
    return records


def _machine() -> dict:
    return {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": "cpu",
        "backend": "gloo",
        "threads_per_rank": 1,
    }


def _add_ratios(records: list[dict]) -> None:
    singles: dict[str, list[float]] = {}
    for r in records:
        if r["variant"] == "single":
            singles.setdefault(r["model"], []).append(r["tokens_per_s"])
    single = {model: statistics.mean(values) for model, values in singles.items()}  # 1-rank launches averaged
    ddp = {(r["model"], r["launch"]): r["samples_per_s"] for r in records if r["variant"] == "ddp"}
    for r in records:
        base = ddp.get((r["model"], r["launch"]))
        r["ratio_vs_ddp"] = r["samples_per_s"] / base if base else None
        one = single.get(r["model"])
        r["scaling_efficiency"] = r["tokens_per_s"] / r["world_size"] / one if one else None


def table(records: list[dict]) -> str:
    """Markdown: samples/s per model, launch and variant; ours/DDP in brackets, scaling efficiency last.

    Scaling efficiency is tokens/s per rank over the 1-rank tokens/s (the mean of the 1-rank launches).
    """
    lines = [
        "| model | ranks | single | ours-auto | ours-native | ddp | scaling eff. ours-auto / ddp |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in dict.fromkeys(r["model"] for r in records):
        for launch in sorted({r["launch"] for r in records if r["model"] == model}):
            at = {r["variant"]: r for r in records if r["model"] == model and r["launch"] == launch}
            world = next(iter(at.values()))["world_size"]
            cells = []
            for v in ("single", *VARIANTS_MULTI):
                r = at.get(v)
                ratio = f" ({r['ratio_vs_ddp']:.2f}x)" if r and v.startswith("ours") and r["ratio_vs_ddp"] else ""
                cells.append(f"{r['samples_per_s']:.0f}{ratio}" if r else "-")
            eff = [at[v]["scaling_efficiency"] for v in ("ours-auto", "ddp") if v in at]
            eff_cell = " / ".join(f"{e:.0%}" for e in eff if e is not None) or "-"
            lines.append(f"| {model} | {world} | " + " | ".join(cells) + f" | {eff_cell} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4, 1])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per replica")
    parser.add_argument("--windows", type=int, default=9, help="timed windows per replica (median reported)")
    parser.add_argument("--steps", type=int, default=4, help="steps per timed window")
    parser.add_argument("--gpt-batch", type=int, default=32, help=f"global batch of {BLOCK}-token sequences")
    parser.add_argument("--mlp-batch", type=int, default=256)
    parser.add_argument("--mlp-hidden", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file to write")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    records = []
    for launch, nproc in enumerate(args.nproc):
        start = time.perf_counter()
        records += [{"launch": launch, **r} for r in run_ranks(_rank_main, nproc, args)]
        print(f"{nproc} rank(s): {time.perf_counter() - start:.1f} s")
    _add_ratios(records)
    machine = _machine()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps({**r, **machine}) + "\n" for r in records))
    print(f"samples/s (median of {args.windows} windows of {args.steps} steps); {machine}")
    print(table(records))


if __name__ == "__main__":
    main()
