"""Jobs for tests/train/test_plan_run.py: ``dtrain train``'s trainer and its plan scoring on the pool."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.fsdp import hybrid_shard_groups
from tests.jobs import parallel as jobs


def trainer(config, plan, steps: int) -> dict | None:
    """``steps`` steps of the trainer of ``config`` on the grid of ``plan`` (every pool process calls it: hybrid
    sharding makes its groups collectively); the losses, gradient norms, and under ZeRO-3 the sizes of the
    parameter shard group and of the replica group. None off the grid."""
    from dtrain.train import loop

    dims = plan.dims
    shard_size = config.parallel.zero_shard_size
    grid = jobs._grid(dims.dp, dims.pp, dims.tp, dims.order)
    if grid is None:
        if shard_size and shard_size != dims.dp:
            hybrid_shard_groups(dims, shard_size, range(dims.world_size))
        return None
    run = loop._Trainer(config, plan, grid)
    records = [run.step(step) for step in range(steps)]
    got = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
           "coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank)}  # fmt: skip
    if config.parallel.zero == 3:
        fsdp = run.hybrid.optimizer
        got |= {"shard": dist.get_world_size(fsdp.group), "replicas": fsdp.replicas}
    return got


def peak_over_ranks(per_rank: list[list[float | None]]) -> float | None:
    """The training loop's largest peak memory over every rank, this rank's records holding the peaks
    ``per_rank[rank]``."""
    from dtrain.train import loop

    records = [{"peak_memory_gib": peak} for peak in per_rank[dist.get_rank()]]
    return loop._peak_over_ranks(records, torch.device("cpu"))
