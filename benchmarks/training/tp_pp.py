"""Usage: torchrun --nproc-per-node 4 benchmarks/training/tp_pp.py [--sections tp pp] [--out F]  (CPU: --nproc 4)

Tensor and pipeline parallel, ours against torch's own (DTensor tensor parallel, torch.distributed.pipelining).

    torchrun --nproc-per-node 4 benchmarks/training/tp_pp.py --out runs/peers-tp-pp.jsonl   # GPUs, NCCL
    python benchmarks/training/tp_pp.py --nproc 4 --tp-dim 64 --pp-width 64 ...             # CPU, Gloo

**Tensor parallel**: the Megatron MLP ``GeLU(X A) B`` (``--tp-dim``, hidden 4x, ``--tp-tokens`` rows) as
:class:`ParallelMLP` on ranks 0..k-1 for each k of ``--sizes``, one training step (forward, backward, SGD) a
call; at k = 1 also the plain ``nn.Sequential``; at the full world also torch's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D device mesh. Parameter bytes a rank and peak memory.

**Pipeline**: ``--pp-layers`` x (Linear(W, W) + GeLU) cut into one stage a rank (two chunks a rank for
interleaved 1F1B), ``--pp-batch`` rows a step, SGD. For each schedule family and micro-batch count ``m``, our
:class:`PipelineParallel` against ``torch.distributed.pipelining`` on the same cut of the same weights:
``ScheduleGPipe``, ``Schedule1F1B``, and ``ScheduleInterleaved1F1B`` over ``PipelineStage`` s, p + s (Narayanan
et al. 2021, section 2.2.2). Each pair: the gradients of one step from the same weights
(``max_abs_grad_diff_vs_torch``, the largest over the stages), the peak memory of one step, then the step time,
timed in rotating turns (:func:`timing.time_variants`) with ``--pp-trials`` trials of at most
``--pp-iters`` steps, fewer if they would not fit ``--pp-budget-s``. GPipe and 1F1B run first, in the order of
``--microbatches``, then interleaved (the most likely to stall, so last), and rank 0 prints each
row as a JSON line and appends it to ``--out`` as soon as it is measured, so a run cut short keeps what it
finished. ``--stall-s`` is re-armed for each pair (:class:`bubble.StallGuard`): a pair that stalls leaves a
row saying so (``stalled_after_s``), dumps every stack and ends the run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import timing as pt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))  # the pipeline benchmarks' folder
from bubble import StallGuard  # noqa: E402

from dtrain.launch import run_ranks
from dtrain.parallel.pipeline_parallel import PipelineParallel, partition_layers
from dtrain.parallel.tensor_parallel import ParallelMLP

PP_FAMILIES = ["gpipe", "1f1b", "interleaved"]
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _train_step(model: nn.Module, optimizer, x: torch.Tensor):
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    return step


def _tensor_parallel(args, groups, emit) -> None:
    dev, rank, world = pt.device(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(args.tp_dim, 4 * args.tp_dim), nn.GELU(), nn.Linear(4 * args.tp_dim, args.tp_dim)
    )
    reference = reference.to(dev)
    x = torch.randn(args.tp_tokens, args.tp_dim, generator=torch.Generator().manual_seed(1)).to(dev)  # (N, D)
    expected = reference(x).detach()
    for k, group in groups.items():
        dist.barrier()
        if rank >= k:
            continue
        ours = ParallelMLP(args.tp_dim, 4 * args.tp_dim, group, init_from=(reference[0], reference[2]))
        models = {"ours": ours.to(dev)}  # built on the CPU, as nn.Linear is
        if k == 1:
            models["single"] = copy.deepcopy(reference)
        if k == world:
            mesh = init_device_mesh(dev.type, (world,))
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            models["torch-tp"] = parallelize_module(copy.deepcopy(reference), mesh, plan)
        errors = {name: (m(x) - expected).abs().max().item() for name, m in models.items()}
        steps = {n: _train_step(m, torch.optim.SGD(m.parameters(), lr=1e-4), x) for n, m in models.items()}
        seconds = pt.time_variants(steps, warmup=args.warmup, iters=args.iters, trials=args.trials, group=group)
        for name, m in models.items():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in m.parameters()]
            emit(
                {
                    "section": "tp",
                    "variant": name,
                    "ranks": k,
                    "step_s": seconds[name],
                    "ratio_vs_torch": seconds["torch-tp"] / seconds[name] if "torch-tp" in seconds else None,
                    "parameter_nbytes_per_rank": sum(p.numel() * p.element_size() for p in local),
                    "peak_memory_bytes": pt.peak_memory(steps[name], own=lambda m=m: pt.state_bytes(m.parameters())),
                    "peak_memory_scope": "variant",
                    "max_abs_error_vs_single": errors[name],
                }
            )


def _pipeline_template(args) -> nn.Sequential:
    """The full model, built once a rank on its device from one seed (the same on every rank); each variant
    deep-copies it, so all start from the same weights without re-initializing 16 layers on the host."""
    torch.manual_seed(0)
    with pt.device():
        return nn.Sequential(
            *(nn.Sequential(nn.Linear(args.pp_width, args.pp_width), nn.GELU()) for _ in range(args.pp_layers))
        )


def _torch_pipeline(model: nn.Sequential, family: str, m: int, v: int):
    """torch.distributed.pipelining on the same cut as ours: rank s holds stages s, s + p, ... of v p."""
    p, rank = dist.get_world_size(), dist.get_rank()
    chunks = v if family == "interleaved" else 1
    ranges = partition_layers(model, chunks * p)
    submodules = [model[ranges[c * p + rank].start : ranges[c * p + rank].stop] for c in range(chunks)]
    stages = [PipelineStage(sub, c * p + rank, chunks * p, pt.device()) for c, sub in enumerate(submodules)]
    if family == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=F.mse_loss)
    else:
        schedule = TORCH_SCHEDULES[family](stages[0], n_microbatches=m, loss_fn=F.mse_loss)
    return nn.ModuleList(submodules), schedule


def _pipeline_step(kind: str, runner, params, x, y):
    optimizer = torch.optim.SGD(params, lr=1e-4)
    rank, last = dist.get_rank(), dist.get_world_size() - 1

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if kind == "ours":
            runner.train_step(x if rank == 0 else None, y if rank == last else None, F.mse_loss)
        elif rank == 0:
            runner.step(x)
        elif rank == last:
            runner.step(target=y, losses=[])
        else:
            runner.step()
        optimizer.step()

    return step


def _pipeline_order(args, p: int) -> list[tuple[str, int]]:
    """(family, m) in the order of what matters most: GPipe and 1F1B in the order of ``--microbatches``, then
    interleaved 1F1B (last: a stall ends the run). Interleaved only where ``m`` is a multiple of the ``p``
    stages (Megatron-LM's rule, ours too) and the layers give every chunk one."""
    families = args.pp_variants
    fits = args.pp_layers >= args.pp_virtual_stages * p
    order = [(f, m) for m in args.microbatches for f in ("gpipe", "1f1b") if f in families]
    order += [("interleaved", m) for m in args.microbatches if "interleaved" in families and fits and m % p == 0]
    return order


def _pipeline_item(args, template: nn.Sequential, family: str, m: int, x, y) -> list[dict]:
    """Ours against torch's schedule of ``family`` at ``m`` micro-batches: the gradients of one step from the
    same weights, the peak memory of a step, then the step time in rotating turns within the time budget."""
    v = args.pp_virtual_stages if family == "interleaved" else 1
    schedule = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b"}[family]
    extra = {"virtual_stages": v} if family == "interleaved" else {}
    ours = PipelineParallel(copy.deepcopy(template), dist.group.WORLD, num_microbatches=m, schedule=schedule, **extra)
    params = {f"ours-{family}": list(ours.parameters())}
    steps = {f"ours-{family}": _pipeline_step("ours", ours, params[f"ours-{family}"], x, y)}
    refused = None
    try:
        theirs_params, theirs = _torch_pipeline(copy.deepcopy(template), family, m, v)
    except ValueError as err:  # e.g. torch's 1F1B wants at least as many micro-batches as stages; ours does not
        refused = str(err)
    else:
        params[f"torch-{family}"] = list(theirs_params.parameters())
        steps[f"torch-{family}"] = _pipeline_step("torch", theirs, params[f"torch-{family}"], x, y)
    grads = {}
    for name, step in steps.items():  # the first step of each, from the same weights
        step()
        grads[name] = [q.grad.detach().clone() for q in params[name]]
    diff = None
    if len(grads) == 2:
        diff = pt.slowest(max((a - b).abs().max().item() for a, b in zip(*grads.values(), strict=True)))
    del grads
    # each variant's own weights and gradients and what its step allocates, not the other's nor the template's
    peaks = {name: pt.peak_memory(step, own=lambda n=name: pt.state_bytes(params[n])) for name, step in steps.items()}
    iters, seconds = _timed_within_budget(args, steps)
    rows = []
    for name, s in seconds.items():
        torch_s = seconds.get(f"torch-{family}")
        rows.append(
            {
                "section": "pp",
                "variant": name,
                "schedule": schedule,
                "virtual_stages": v,
                "ranks": dist.get_world_size(),
                "microbatches": m,
                "step_s": s,
                "ratio_vs_torch": None if torch_s is None else torch_s / s,
                "torch_refused": refused,
                "peak_memory_bytes": peaks[name],
                "peak_memory_scope": "variant",
                "max_abs_grad_diff_vs_torch": diff,
                "warmup": args.pp_warmup,
                "iters": iters,
                "trials": args.pp_trials,
            }
        )
    return rows


def _timed_within_budget(args, steps: dict) -> tuple[int, dict[str, float]]:
    """Warm up, then time with as many calls a trial (up to ``--pp-iters``) as fit ``--pp-budget-s``."""
    start = time.perf_counter()
    for step in steps.values():
        for _ in range(args.pp_warmup):
            step()
    pt.sync()
    per_step = pt.slowest((time.perf_counter() - start) / max(1, args.pp_warmup * len(steps)))
    fit = int(args.pp_budget_s / (per_step * args.pp_trials * len(steps)))
    iters = max(1, min(args.pp_iters, fit))
    return iters, pt.time_variants(steps, warmup=0, iters=iters, trials=args.pp_trials)


def _pipeline(args, emit, guard: StallGuard) -> None:
    """Every (family, m) of :func:`_pipeline_order`, each row emitted as soon as it is measured. With
    ``--stall-s``, each pair gets that long before a stalled row is written, every stack dumped, and the run
    ends."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(args.pp_batch, args.pp_width, generator=gen).to(pt.device())  # (B, W)
    y = torch.randn(args.pp_batch, args.pp_width, generator=gen).to(pt.device())  # (B, W)
    template = _pipeline_template(args)
    for family, m in _pipeline_order(args, dist.get_world_size()):
        guard.arm({"section": "pp", "family": family, "ranks": dist.get_world_size(), "microbatches": m})
        for row in _pipeline_item(args, template, family, m, x, y):
            emit(row)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _emitter(args):
    """Rank 0 prints each record as one JSON line the moment it exists and appends it (with the machine) to
    ``--out``, so a run cut short by its time limit keeps every finished row; the other ranks drop them."""
    machine = pt.machine()
    if dist.get_rank() == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("")

    def emit(record: dict) -> None:
        if dist.get_rank():
            return
        print(json.dumps(record), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(record | machine) + "\n")

    return emit


def _rank_main(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    emit = _emitter(args)
    # a run that stalls prints a row saying where, every thread's stack, and ends, rather than hanging silently
    guard = StallGuard(args.stall_s, args.out, dist.get_rank())
    if "tp" in args.sections:
        guard.arm({"section": "tp"})
        _tensor_parallel(args, pt.subgroups(tuple(args.sizes)), emit)
    if "pp" in args.sections:
        _pipeline(args, emit, guard)
    guard.cancel()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: counts at least 1, the batch splits into every micro-batch count."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks (ignored under torchrun)")
    p.add_argument("--sections", nargs="+", choices=["tp", "pp"], default=["tp", "pp"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tp-dim", type=int, default=4096)
    p.add_argument("--tp-tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2, help="tensor parallel: untimed calls")
    p.add_argument("--iters", type=int, default=3, help="tensor parallel: calls a trial")
    p.add_argument("--trials", type=int, default=5, help="tensor parallel: trials (the median is reported)")
    p.add_argument("--pp-width", type=int, default=4096)
    p.add_argument("--pp-layers", type=int, default=16)
    p.add_argument("--pp-batch", type=int, default=1024)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--pp-variants", nargs="+", choices=["gpipe", "1f1b", "interleaved"], default=PP_FAMILIES)
    p.add_argument("--pp-virtual-stages", type=int, default=2, help="model chunks a rank for interleaved 1F1B")
    p.add_argument("--pp-warmup", type=int, default=2, help="pipeline: untimed steps of each variant")
    p.add_argument("--pp-iters", type=int, default=3, help="pipeline: most steps a trial")
    p.add_argument("--pp-trials", type=int, default=3, help="pipeline: trials (the median is reported)")
    p.add_argument(
        "--pp-budget-s", type=float, default=5.0, help="pipeline: seconds of timed steps a (schedule, m), at most"
    )
    p.add_argument("--stall-s", type=float, default=0, help="dump every stack and exit after this long (0: never)")
    p.add_argument("--out", type=Path, default=None, help="JSON lines, appended as rows are measured")
    args = p.parse_args(argv)
    if args.pp_warmup < 1 or min(args.pp_iters, args.pp_trials, args.pp_virtual_stages) < 1:
        p.error("--pp-warmup, --pp-iters, --pp-trials and --pp-virtual-stages must be at least 1")
    if "pp" in args.sections and any(args.pp_batch % m for m in args.microbatches):
        p.error(f"--pp-batch {args.pp_batch} must be a multiple of every --microbatches value {args.microbatches}")
    return args


def main() -> None:
    args = parse_args()
    run_ranks(_rank_main, args.nproc, args)


if __name__ == "__main__":
    main()
