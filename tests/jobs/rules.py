"""Jobs for the measured-rules tests: ``auto`` follows a rules file, and ranks with different files refuse alike."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm import api, state
from dtrain.comm.ir import algorithms as registry
from dtrain.testing.pool import group_of


def _forget_choices(group) -> None:
    """Forget what ``auto`` chose and agreed on ``group`` (on every rank of it: a group's state must stay alike on
    its ranks, and other groups' states are left alone, since their other ranks do not run this job)."""
    for cached in (api._rules, api._params, api._choice_digest, api._auto):
        cached.cache_clear()
    held = state.find_state(group)
    if held is not None:
        held.agreed.clear()
        held.rules.clear()
        held.choices.clear()
        held.calls.clear()  # resolved calls would skip the choice that the next call must make again
    state.changed()


def auto_with_rules(world: int, paths: list[str | None], numel: int) -> dict:
    """Every rank reads ``paths[rank]`` as its rules file (None: no file), then calls an ``auto`` all-reduce;
    reports what auto chose, whether the sum was right, or the error it raised."""
    rank = dist.get_rank()
    group = group_of(world)
    comm.set_local_size(None, group)  # an earlier job may have left a node size on this group
    path = paths[rank]
    os.environ["DTRAIN_COMM_RULES"] = path if path is not None else os.devnull + ".missing"
    _forget_choices(group)
    ran = []
    real = registry.build

    def spy(collective, algorithm, *args, **kwargs):  # what the call really ran
        ran.append(algorithm)
        return real(collective, algorithm, *args, **kwargs)

    registry.build = spy
    try:
        x = torch.full((numel,), float(rank + 1))
        try:
            comm.all_reduce(x, group=group, algorithm="auto")
        except ValueError as err:
            return {"error": str(err)}
        chosen = ran[-1] if ran else "native"  # the backend's own call builds no schedule
        return {"chosen": chosen, "right": bool((x == world * (world + 1) / 2).all())}
    finally:
        registry.build = real
        os.environ.pop("DTRAIN_COMM_RULES", None)
        _forget_choices(group)
