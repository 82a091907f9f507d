"""Jobs for the pool's own tests: one that fails on a rank, one that outlives the pool's timeout."""

from __future__ import annotations

import os
import time


def pid() -> int:
    return os.getpid()


def fail_on(rank: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    return "ok"


def sleep_on(rank: int, seconds: float) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(seconds)
    return "ok"


def env(name: str) -> str | None:
    return os.environ.get(name)
