"""``dtrain bench overlap`` on a group of the pool."""

from __future__ import annotations

from dtrain.testing.pool import group_of


def bench_overlap(world: int) -> list[dict]:
    from dtrain.bench.overlap import OverlapConfig, overlap_on_rank

    config = OverlapConfig(nproc=world, nbytes=1 << 18, hidden=128, tp=2, tokens=128, seconds=0.02, rounds=1,
                           collectives=("all-reduce", "all-gather"))  # fmt: skip
    return overlap_on_rank(config, group_of(world))
