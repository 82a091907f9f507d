"""The rank grid: degrees validated, tensor parallel innermost, and real groups on the process pool."""

from __future__ import annotations

import pytest

from dtrain.parallel.grid import ParallelDims
from tests.jobs import grid as grid_jobs


def test_degrees_must_multiply_to_the_world():
    with pytest.raises(ValueError, match="must multiply to the world size"):
        ParallelDims(world_size=8, dp=3)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        ParallelDims(world_size=8, dp=8, tp=0)


def test_tensor_parallel_is_innermost_then_pipeline_then_data():
    dims = ParallelDims(world_size=8, dp=2, pp=2, tp=2)
    assert [dims.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("pp", 5) == [5, 7]
    assert dims.group_ranks("dp", 5) == [1, 5]
    assert all(dims.rank(*dims.coords(r)) == r for r in range(8))


def test_megatron_lms_order_puts_the_pipeline_outermost():
    dims = ParallelDims(world_size=8, dp=2, pp=2, tp=2, order="tp-dp-pp")
    assert [dims.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("dp", 5) == [5, 7]
    assert dims.group_ranks("pp", 5) == [1, 5]
    assert all(dims.rank(*dims.coords(r)) == r for r in range(8))
    assert [dims.coords(r) for r in range(4, 8)] == [(0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    with pytest.raises(ValueError, match="order must be one of tp-pp-dp, tp-dp-pp, got 'dp-tp-pp'"):
        ParallelDims(world_size=8, dp=2, pp=2, tp=2, order="dp-tp-pp")


def test_the_simulators_placements_are_dtrain_trains_two_orders():
    # dtrain.sim imports no torch, so it writes the two orders out again: they must agree with the grid's
    from dtrain.cluster.presets import preset
    from dtrain.sim.model import Layout
    from dtrain.sim.placement import grid_rank, place
    from dtrain.train.plan import RUN_PLACEMENTS

    topology = preset("h100-rail", racks=1, servers_per_rack=4)
    devices = [d.name for d in topology.devices()]
    for dp, pp, tp in ((2, 2, 8), (4, 2, 4), (8, 4, 1), (2, 8, 2)):
        layout = Layout(dp=dp, pp=pp, tp=tp, global_batch=dp)
        for how, order in RUN_PLACEMENTS.items():
            dims = ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, order=order)
            placed = place(topology, layout, how)
            assert all(placed[grid_rank(layout, *dims.coords(r))] == devices[r] for r in range(dims.world_size))


def test_grid_groups_on_real_processes(pool):
    got = pool.run(grid_jobs.grid_sizes, 2, 1, 2)  # every process builds the groups
    assert got == [[2, 1, 2, r] for r in range(4)] + [None] * 4


def test_pipeline_gradients_travel_on_a_second_group_of_the_same_ranks(pool):
    # on NCCL, one group for both directions lets a large send wait behind the opposite send (docs/parallel.md)
    assert all(pool.run(grid_jobs.gradients_on_their_own_group, 2, 2))
