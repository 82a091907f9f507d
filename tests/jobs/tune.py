"""Jobs for the calibration tests: ``auto`` measures its rules, follows rank 0's, and survives a corrupt cache."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm import api, tune
from dtrain.comm.cost import rules
from dtrain.testing.pool import group_of
from tests.jobs.rules import _forget_choices


def _auto_all_reduce(group, world: int, numel: int) -> dict:
    """One ``auto`` all-reduce: what ``auto`` resolved to, whether the sum was right, and the warnings raised."""
    resolved = []
    real = api._resolve

    def spy(*args, **kwargs):  # what auto resolved to for this call (the calibration inside names its own)
        resolved.append(real(*args, **kwargs))
        return resolved[-1]

    api._resolve = spy
    x = torch.full((numel,), float(dist.get_rank(group) + 1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_reduce(x, group=group, algorithm="auto")
    finally:
        api._resolve = real
    return {
        "chosen": resolved[-1],
        "right": bool((x == world * (world + 1) / 2).all()),
        "warnings": [str(w.message) for w in caught if "dtrain.comm" in str(w.message)],
    }


def autotune_then_follow(world: int, cache: str, empty: str, numel: int) -> dict:
    """With ``DTRAIN_COMM_AUTOTUNE=1`` and no rules anywhere, the first ``auto`` call measures (all-reduce at two
    sizes, ``native``, star and ring on Gloo and over /dev/shm) and rank 0 writes the cache; a second job start
    (choices forgotten) loads it, where only rank 0 can see it (the others look in ``empty``); then the cache
    is overwritten with garbage and ``auto`` warns and runs native."""
    group = group_of(world)
    rank = dist.get_rank(group)
    comm.set_local_size(None, group)
    saved = (tune.CALIBRATED, tune.AUTOTUNE_SIZES, tune.AUTOTUNE_ALGORITHMS)
    os.environ.pop("DTRAIN_COMM_RULES", None)
    os.environ["XDG_CACHE_HOME"] = cache
    os.environ["DTRAIN_COMM_AUTOTUNE"] = "1"
    os.environ["DTRAIN_CALIBRATION"] = os.path.join(empty, "no-calibration.json")
    tune.CALIBRATED, tune.AUTOTUNE_SIZES = ("all_reduce",), (4 << 10, 256 << 10)
    tune.AUTOTUNE_ALGORITHMS = ("star", "ring")  # a short candidate list
    _forget_choices(group)
    out = {}
    try:
        out["first"] = _auto_all_reduce(group, world, numel)
        path = tune.cache_path_for(group, torch.device("cpu"), "cpu")
        dist.barrier(group)
        made = rules.load_rules("cpu", path)
        out["cached"] = made.to_dict()["rules"]
        out["expected"] = made.pick("all_reduce", numel * 4)
        os.environ["DTRAIN_COMM_AUTOTUNE"] = "0"
        if rank != 0:
            os.environ["XDG_CACHE_HOME"] = empty
        _forget_choices(group)
        out["second"] = _auto_all_reduce(group, world, numel)
        dist.barrier(group)
        if rank == 0:
            path.write_text("{ not json")
        dist.barrier(group)
        _forget_choices(group)
        out["corrupt"] = _auto_all_reduce(group, world, numel)
        dist.barrier(group)
    finally:
        tune.CALIBRATED, tune.AUTOTUNE_SIZES, tune.AUTOTUNE_ALGORITHMS = saved
        for name in ("XDG_CACHE_HOME", "DTRAIN_COMM_AUTOTUNE", "DTRAIN_CALIBRATION"):
            os.environ.pop(name, None)
        _forget_choices(group)
    return out


def bench_side_by_side(world: int, out: str) -> list[list[dict]]:
    """``dtrain bench comm``'s measurement on the group, same tensors then fresh ones: every rank's records."""
    from dtrain.bench.comm import BenchConfig, bench_on_rank

    group = group_of(world)
    comm.set_local_size(None, group)
    every = []
    for fresh in (False, True):
        config = BenchConfig(
            collectives=["all_gather"], algorithms=["torch", "native", "ring", "ring@peer"], min_bytes=1 << 10,
            max_bytes=1 << 10, iters=3, trials=3, warmup=0, out=out, fresh=fresh,
        )  # fmt: skip
        every.append(bench_on_rank(config, group))
    return every


def bench_fresh_beside(world: int, out: str) -> list[dict]:
    """``dtrain bench comm`` with every name timed also on fresh tensors, in the same rounds: every rank's records."""
    from dtrain.bench.comm import BenchConfig, bench_on_rank

    group = group_of(world)
    comm.set_local_size(None, group)
    config = BenchConfig(
        collectives=["all_reduce"], algorithms=["torch", "native", "ring"], min_bytes=1 << 10, max_bytes=1 << 10,
        iters=3, trials=3, warmup=0, out=out, fresh_beside=True,
    )  # fmt: skip
    return bench_on_rank(config, group)
