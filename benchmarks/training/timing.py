"""Usage: (a module: imported by benchmarks/training/dp_zero.py and tp_pp.py)

Timing and memory functions shared by the training benchmarks (ours against torch's own, in one launch).

A figure is the median over ``trials`` of the slowest rank's time for ``iters`` calls, after ``warmup`` untimed
calls; on CUDA each timed run ends with a synchronize, so queued kernels are counted. Variants are timed in
turns, trial after trial, in an order that rotates, so that a drift of the machine falls on all of them alike.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["device", "sync", "slowest", "time_variants", "peak_memory", "machine", "subgroups"]


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def slowest(seconds: float, group=None) -> float:
    """The largest of every rank's ``seconds`` in ``group``."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def time_variants(
    steps: dict[str, Callable[[], None]], *, warmup: int, iters: int, trials: int, group=None
) -> dict[str, float]:
    """Median seconds per call of each variant's ``step``, timed in rotating turns over ``group``."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            sync()
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(iters):
                steps[name]()
            sync()
            runs[name].append(slowest(time.perf_counter() - start, group) / iters)
    result = {name: statistics.median(values) for name, values in runs.items()}
    if dist.get_rank() == 0:  # progress, to stderr: a run that stalls shows where
        print(f"timed {', '.join(f'{n} {s * 1e3:.2f} ms' for n, s in result.items())}", file=sys.stderr, flush=True)
    return result


def peak_memory(fn: Callable[[], None], own: Callable[[], int] | None = None) -> int | None:
    """Peak bytes allocated on this GPU while ``fn`` runs (None on the CPU). With ``own`` (the bytes of the
    variant's own state, :func:`state_bytes`, read before ``fn``): that plus the most ``fn`` allocated above what
    the device held before it, so what other variants keep on the device is not counted."""
    if not torch.cuda.is_available():
        fn()
        return None
    sync()
    held = own() if own is not None else 0
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    return peak if own is None else held + peak - before


def state_bytes(parameters, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Device bytes of ``parameters`` (each DTensor's local shard), their gradients and ``optimizer``'s state
    tensors, each storage once."""
    tensors = []
    for q in parameters:
        tensors += [q, q.grad] if q.grad is not None else [q]
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_cuda:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def subgroups(sizes: tuple[int, ...]) -> dict[int, object]:
    """Process groups of ranks 0..k-1 for each k (every rank must call this, in the same order)."""
    world = dist.get_world_size()
    return {k: (dist.group.WORLD if k == world else dist.new_group(list(range(k)))) for k in sizes if k <= world}


def machine() -> dict:
    info = {"hostname": platform.node(), "torch_version": torch.__version__, "world_size": dist.get_world_size()}
    if torch.cuda.is_available():
        info |= {
            "device": torch.cuda.get_device_name(),
            "backend": "nccl",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    else:
        info |= {"device": "cpu", "backend": "gloo", "cpu_count": os.cpu_count()}
    return info
