"""Checkpoints: one file per rank per step, each written atomically, and finding the last complete one.

A checkpoint of step ``s`` is the directory ``<out>/checkpoints/step-<s>/`` holding ``rank-<r>.pt`` for every
rank ``r`` of the world: model (this rank's stage) and optimizer state, the step, the torch RNG state and the
run's layout. Each file is written to a temporary name, flushed and fsynced, then moved into place with
``os.replace`` (atomic on POSIX), so a crash leaves either the old file or the new one, never half of one; a
step directory missing a rank's file is incomplete and resume skips it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "checkpoint_path",
    "latest_complete_step",
    "latest_step",
    "load_checkpoint",
    "load_layout",
    "save_checkpoint",
]

_STEP_DIR = re.compile(r"step-(\d+)")


def checkpoint_path(out: str | Path, step: int, rank: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:08d}" / f"rank-{rank:05d}.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` with ``torch.save`` to ``path`` atomically (temp file, fsync, ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)


def _steps(out: str | Path) -> list[int]:
    """The steps with a checkpoint directory under ``out``, largest first."""
    root = Path(out) / "checkpoints"
    return sorted((int(m.group(1)) for d in root.glob("step-*") if (m := _STEP_DIR.fullmatch(d.name))), reverse=True)


def latest_step(out: str | Path) -> int | None:
    """The largest step with rank 0's file (complete or not), or None."""
    return next((step for step in _steps(out) if checkpoint_path(out, step, 0).exists()), None)


def latest_complete_step(out: str | Path, world_size: int) -> int | None:
    """The largest step whose checkpoint has a file for each of ``world_size`` ranks, or None."""
    for step in _steps(out):
        if all(checkpoint_path(out, step, r).exists() for r in range(world_size)):
            return step
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only: a checkpoint is tensors and plain containers, nothing that runs code when loaded
    return torch.load(path, map_location="cpu", weights_only=True)


def load_layout(path: Path) -> dict[str, Any] | None:
    """The layout a checkpoint file was written with (memory-mapped: the tensors are not read), or None if
    ``path`` is missing."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("layout")
