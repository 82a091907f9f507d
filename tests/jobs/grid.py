"""Jobs for tests/parallel/test_grid.py."""

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


def gradients_on_their_own_group(dp: int, pp: int) -> bool:
    """A grid pipeline's gradient messages travel on ``pp_grad_group``: the pipeline group's ranks, another group."""
    from torch import nn

    from dtrain.parallel.pipeline_parallel import PipelineParallel

    grid = RankGrid.build(ParallelDims(world_size=dp * pp, dp=dp, pp=pp, tp=1), range(dp * pp))
    if grid is None:  # every process builds the groups; those off the grid have nothing to check
        return True
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(pp)))
    pipe = PipelineParallel(model, grid.pp_group, num_microbatches=2, grad_group=grid.pp_grad_group)
    same_ranks = dist.get_process_group_ranks(grid.pp_grad_group) == dist.get_process_group_ranks(grid.pp_group)
    return pipe.link.grad_group is grid.pp_grad_group and grid.pp_grad_group is not grid.pp_group and same_ranks
