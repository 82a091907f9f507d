"""Tensor and pipeline parallel, ours against torch's own (DTensor tensor parallel, torch.distributed.pipelining).

    torchrun --nproc-per-node 4 benchmarks/peers_tp_pp.py --out runs/peers-tp-pp.jsonl   # GPUs, NCCL
    python benchmarks/peers_tp_pp.py --nproc 4 --tp-dim 64 --pp-width 64 ...             # CPU, Gloo

**Tensor parallel**: the Megatron MLP ``GeLU(X A) B`` (``--tp-dim``, hidden 4x, ``--tp-tokens`` rows) as
:class:`ParallelMLP` on ranks 0..k-1 for each k of ``--sizes``, one training step (forward, backward, SGD) a
call; at k = 1 also the plain ``nn.Sequential``; at the full world also torch's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D device mesh. Parameter bytes a rank and peak memory.

**Pipeline**: ``--pp-layers`` x (Linear(W, W) + GeLU) cut into one stage a rank, ``--pp-batch`` rows a step,
for each micro-batch count of ``--microbatches``: our :class:`PipelineParallel` (GPipe, 1F1B) against
``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``) on the same
stages, timed in rotating turns. Both must give the same gradients from the same weights: checked once
(``max_abs_grad_diff_vs_torch``), and every tensor-parallel output is checked against one device's.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
from pathlib import Path

import peer_timing as pt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtrain.bench.launch import run_ranks
from dtrain.parallel.pipeline_parallel import PipelineParallel, partition_layers
from dtrain.parallel.tensor_parallel import ParallelMLP


def _train_step(model: nn.Module, optimizer, x: torch.Tensor):
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    return step


def _tensor_parallel(args, groups) -> list[dict]:
    dev, rank, world = pt.device(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(args.tp_dim, 4 * args.tp_dim), nn.GELU(), nn.Linear(4 * args.tp_dim, args.tp_dim)
    )
    reference = reference.to(dev)
    x = torch.randn(args.tp_tokens, args.tp_dim, generator=torch.Generator().manual_seed(1)).to(dev)  # (N, D)
    expected = reference(x).detach()
    records = []
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
            records.append(
                {
                    "section": "tp",
                    "variant": name,
                    "ranks": k,
                    "step_s": seconds[name],
                    "parameter_nbytes_per_rank": sum(p.numel() * p.element_size() for p in local),
                    "peak_memory_bytes": pt.peak_memory(steps[name]),
                    "max_abs_error_vs_single": errors[name],
                }
            )
    return records


def _pipeline_model(args) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.pp_width, args.pp_width), nn.GELU()) for _ in range(args.pp_layers)]
    return nn.Sequential(*layers).to(pt.device())


def _torch_pipeline(model: nn.Sequential, schedule_cls, m: int):
    p, rank = dist.get_world_size(), dist.get_rank()
    stage_range = partition_layers(model, p)[rank]
    submodule = model[stage_range.start : stage_range.stop]
    stage = PipelineStage(submodule, rank, p, pt.device())
    return submodule, schedule_cls(stage, n_microbatches=m, loss_fn=F.mse_loss)


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


def _pipeline(args) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(args.pp_batch, args.pp_width, generator=gen).to(pt.device())  # (B, W)
    y = torch.randn(args.pp_batch, args.pp_width, generator=gen).to(pt.device())  # (B, W)
    records = []
    for m in args.microbatches:
        steps, grads = {}, {}
        for name, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            ours = PipelineParallel(_pipeline_model(args), dist.group.WORLD, num_microbatches=m, schedule=name)
            submodule, theirs = _torch_pipeline(_pipeline_model(args), schedule_cls, m)
            steps[f"ours-{name}"] = _pipeline_step("ours", ours, list(ours.parameters()), x, y)
            steps[f"torch-{name}"] = _pipeline_step("torch", theirs, list(submodule.parameters()), x, y)
            if name == "1f1b":  # one step from the same weights: the gradients must agree
                for key, params in ((f"ours-{name}", ours.parameters()), (f"torch-{name}", submodule.parameters())):
                    params = list(params)
                    steps[key]()
                    grads[key] = [p.grad.detach().clone() for p in params]
        if m % dist.get_world_size() == 0:  # interleaved 1F1B, 2 chunks a stage; torch's needs several stages a rank
            model, world = _pipeline_model(args), dist.group.WORLD
            kind = {"schedule": "interleaved-1f1b", "virtual_stages": 2}
            interleaved = PipelineParallel(model, world, num_microbatches=m, **kind)
            steps["ours-interleaved"] = _pipeline_step("ours", interleaved, list(interleaved.parameters()), x, y)
        diff = max((a - b).abs().max().item() for a, b in zip(grads["ours-1f1b"], grads["torch-1f1b"], strict=True))
        seconds = pt.time_variants(steps, warmup=args.warmup, iters=args.iters, trials=args.trials)
        for name, s in seconds.items():
            records.append(
                {
                    "section": "pp",
                    "variant": name,
                    "ranks": dist.get_world_size(),
                    "microbatches": m,
                    "step_s": s,
                    "max_abs_grad_diff_vs_torch": diff,
                }
            )
    return records


def _rank_main(args) -> list[dict]:
    if args.stall_s:  # a run that stalls prints every thread's stack and ends, rather than hanging silently
        faulthandler.dump_traceback_later(args.stall_s, exit=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    records = []
    if "tp" in args.sections:
        records += _tensor_parallel(args, pt.subgroups(tuple(args.sizes)))
    if "pp" in args.sections:
        records += _pipeline(args)
    torch_tp = next((r["step_s"] for r in records if r["variant"] == "torch-tp"), None)
    torch_pp = {
        (r["microbatches"], r["variant"][6:]): r["step_s"]
        for r in records
        if r["section"] == "pp" and r["variant"].startswith("torch-")
    }
    for r in records:
        if r["section"] == "tp":
            base = torch_tp if r["ranks"] == dist.get_world_size() else None
        else:
            base = torch_pp.get((r["microbatches"], r["variant"].split("-")[1].replace("interleaved", "1f1b")))
        r["ratio_vs_torch"] = base / r["step_s"] if base else None
        r |= pt.machine()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks (ignored under torchrun)")
    p.add_argument("--sections", nargs="+", choices=["tp", "pp"], default=["tp", "pp"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tp-dim", type=int, default=4096)
    p.add_argument("--tp-tokens", type=int, default=8192)
    p.add_argument("--pp-width", type=int, default=4096)
    p.add_argument("--pp-layers", type=int, default=16)
    p.add_argument("--pp-batch", type=int, default=1024)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--stall-s", type=float, default=0, help="dump every stack and exit after this long (0: never)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    records = run_ranks(_rank_main, args.nproc, args)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank returns the records; rank 0 reports
        return
    for r in records:
        print(json.dumps({k: v for k, v in r.items() if k != "hostname"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
