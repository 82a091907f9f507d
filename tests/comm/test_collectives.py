"""Every (collective, algorithm) on real Gloo processes, against a one-process reference and torch.distributed.

World sizes 2, 3, 4 and 8; sizes 0, 1, a prime and a large one; every op; a non-contiguous input; both ends
as root; every supported dtype on 2 and 3 ranks, one of each element width on 4 and 8 (the reduction kernels
do not depend on the group; the rounds, their blocks and byte offsets do).
"""

from __future__ import annotations

import pytest

from dtrain.comm import Collective, algorithms
from tests.jobs import comm as jobs

WORLDS = (2, 3, 4, 8)
SIZES = [0, 1, 13, 4099]


def _pairs():
    for coll in Collective:
        if coll == Collective.BARRIER:
            continue
        for algorithm in algorithms(coll.value):
            if algorithm != "hierarchical":
                yield coll.value, algorithm


def _cases():
    """Every pair on every world, but "native" (torch.distributed's own collective) and "auto" (which runs one of
    the others, each checked here on 8 ranks too) on the smaller worlds only."""
    for coll, algorithm in _pairs():
        for world in WORLDS:
            if world < 8 or algorithm not in ("native", "auto"):
                yield coll, algorithm, world


@pytest.mark.parametrize(("coll", "algorithm", "world"), list(_cases()))
def test_matches_reference(pool, coll, algorithm, world):
    problems = pool.run(jobs.check_collective, coll, algorithm, world, SIZES, every_dtype=world < 4, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


@pytest.mark.parametrize(("coll", "algorithm"), [p for p in _pairs() if p[1] not in ("native", "auto")])
def test_matches_torch_distributed_on_random_floats(pool, coll, algorithm):
    worst = pool.run(jobs.check_against_native, coll, algorithm, 3, 1031, ranks=3)
    assert max(worst) < 1e-5


def _hierarchical():
    for coll in Collective:
        if "hierarchical" in algorithms(coll.value):
            yield coll.value


@pytest.mark.parametrize(("world", "local_size"), [(4, 2), (8, 2), (8, 4), (3, 1), (4, 4)])
@pytest.mark.parametrize("coll", list(_hierarchical()))
def test_hierarchical_matches_reference(pool, coll, world, local_size):
    problems = pool.run(jobs.check_collective, coll, "hierarchical", world, SIZES, local_size=local_size, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


@pytest.mark.parametrize(("coll", "algorithm"), [p for p in _pairs() if p[1] not in ("native", "auto")])
def test_matches_torch_distributed_on_a_large_buffer(pool, coll, algorithm):
    # 2^17 + 3 elements a block: uneven chunks everywhere, and more than any scratch seen so far.
    worst = pool.run(jobs.check_against_native, coll, algorithm, 4, (1 << 17) + 3, ranks=4)
    assert max(worst) < 1e-5


def test_a_group_of_the_whole_world_in_order_takes_the_world_node_size(pool):
    # dtrain train's data-parallel group of a 1-D layout is such a group: --algorithm hierarchical must work there
    assert max(pool.run(jobs.world_copy_takes_world_node_size)) == 0.0


def test_bench_verify_finds_every_pair_equal_to_torch_distributed_and_a_wrong_one_not(pool):
    """The check people run on a new backend, on Gloo: float32 within its tolerance, integers and booleans exactly;
    an all-reduce made wrong is a failure."""
    assert pool.run(jobs.bench_verify, 4, [13], ranks=4) == [0] * 4
    assert pool.run(jobs.bench_verify, 4, [13], "ring", ranks=4) == [1] * 4
