"""Jobs for tests/test_grid.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.grid import ParallelDims, RankGrid


def grid_sizes(dp: int, pp: int, tp: int) -> list[int] | None:
    """Build a grid on ranks 0..dp*pp*tp-1 (every process takes part) and sum each group's size through it."""
    dims = ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp)
    grid = RankGrid.build(dims, range(dims.world_size))
    if grid is None:
        return None
    sizes = []
    for group in (grid.dp_group, grid.pp_group, grid.tp_group):
        one = torch.ones(1)
        dist.all_reduce(one, group=group)
        sizes.append(int(one.item()))
    return [*sizes, grid.rank]
