"""Jobs of tests/train/test_elastic.py, run through dtrain.launch.run_ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.launch import restart_count


def bad_input_on_rank1(log: str) -> float:
    """Rank 1 stops on bad input at once; rank 0 waits for it in an all-reduce. Each attempt is logged."""
    with open(Path(log), "a") as f:
        f.write(f"attempt {restart_count()} rank {dist.get_rank()}\n")
    if dist.get_rank() == 1:
        raise ValueError("--thing: must be 1, got 2")
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.sum().item()


#: What the CUDA caching allocator raises, as torch words it
OUT_OF_MEMORY = (
    "CUDA out of memory. Tried to allocate 48.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which 3.10 GiB is "
    "free. Including non-PyTorch memory, this process has 76.09 GiB memory in use.\nOf the allocated memory 70.02 "
    "GiB is allocated by PyTorch."
)


#: What torch's CPU allocator raises (a RuntimeError), as torch words it
HOST_OUT_OF_MEMORY = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "281474976710656 bytes. Error code 12 (Cannot allocate memory)"
)


def out_of_memory_on_rank1(log: str, host: bool = False) -> float:
    """Rank 1 runs out of device memory (``host``: of host memory) at once, the allocator's error; rank 0 waits for
    it in an all-reduce. Each attempt is logged."""
    with open(Path(log), "a") as f:
        f.write(f"attempt {restart_count()} rank {dist.get_rank()}\n")
    if dist.get_rank() == 1:
        raise RuntimeError(HOST_OUT_OF_MEMORY) if host else torch.OutOfMemoryError(OUT_OF_MEMORY)
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.sum().item()


def error_on_rank1(stderr: str) -> float:
    """Rank 1 fails with an unexpected error at once; rank 0 waits for it in an all-reduce. Each rank's stderr
    goes to ``STDERR.RANK``."""
    import sys

    sys.stderr = open(f"{stderr}.{dist.get_rank()}", "w", buffering=1)  # noqa: SIM115 (the rank's, to its end)
    if dist.get_rank() == 1:
        raise RuntimeError("the step's graph could not be recorded\nsecond line")
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.sum().item()


def environment(names: list[str]) -> dict[str, str | None]:
    """Each rank's values of ``names``, rank 0's returned (the others must agree)."""
    import os

    mine = {n: os.environ.get(n) for n in names}
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(e != every[0] for e in every):
        raise RuntimeError(f"the ranks' environments differ: {every}")
    return mine
