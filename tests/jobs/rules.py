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
        held.params_agreed.clear()
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


def wide_with_rules(world: int, path: str, numel: int, wide: str = "1") -> dict:
    """A rules file (written at ``path`` by rank 0 for this group's kind) gives the all-reduce, all-gather and
    reduce-scatter to ``native_wide``; each runs twice (the second through the kept fast path) with
    ``DTRAIN_COMM_WIDE=wide``. Reports whether every result was right, what ``auto`` chose, how many calls asked for
    a wide communicator and whether they got one."""
    from dtrain.comm import native
    from dtrain.comm.cost import rules

    rank = dist.get_rank()
    group = group_of(world)
    comm.set_local_size(None, group)
    kind = api._kind(group, torch.device("cpu"))
    if rank == 0:
        table = {c: ((0, rules.NATIVE_WIDE),) for c in ("all_reduce", "all_gather", "reduce_scatter")}
        rules.save_rules(rules.Rules(kind=kind, world_size=world, table=table), path)
    dist.barrier(group=group)
    os.environ["DTRAIN_COMM_RULES"] = path
    os.environ["DTRAIN_COMM_WIDE"] = wide
    _forget_choices(group)
    asked = []
    real = native.wide_group

    def spy(g):
        got = real(g)
        asked.append(got)
        return got

    native.wide_group = spy
    try:
        right = []
        for _ in range(2):
            x = torch.full((numel,), float(rank + 1))
            comm.all_reduce(x, group=group, algorithm="auto")
            right.append(bool((x == world * (world + 1) / 2).all()))
            out = torch.empty(world * numel)
            comm.all_gather(out, torch.full((numel,), float(rank)), group=group, algorithm="auto")
            right.append(torch.equal(out, torch.arange(world).float().repeat_interleave(numel)))
            piece = torch.empty(numel // world)
            comm.reduce_scatter(piece, torch.ones(numel), group=group, algorithm="auto")
            right.append(bool((piece == world).all()))
        chosen = api._auto(api.Collective.ALL_REDUCE, numel * 4, world, kind, None)
        return {"right": all(right), "asked": len(asked), "got": [g is not None for g in asked], "chosen": chosen}
    finally:
        native.wide_group = real
        os.environ.pop("DTRAIN_COMM_RULES", None)
        os.environ.pop("DTRAIN_COMM_WIDE", None)
        _forget_choices(group)


def calibrated_calls(world: int, paths: list[str | None]) -> dict:
    """Every rank reads ``paths[rank]`` as its calibration file (None: none there), then makes an ``auto``
    all-reduce and a ``ring`` broadcast (whose pieces the calibration decides); reports, for each, the error it
    raised or whether its result was right."""
    rank = dist.get_rank()
    group = group_of(world)
    path = paths[rank]
    os.environ["DTRAIN_CALIBRATION"] = path if path is not None else os.devnull + ".missing"
    os.environ["DTRAIN_COMM_RULES"] = os.devnull + ".missing"
    _forget_choices(group)
    out = {}
    try:
        x = torch.full((64,), float(rank + 1))
        try:
            comm.all_reduce(x, group=group, algorithm="auto")
            out["auto"] = bool((x == world * (world + 1) / 2).all())
        except ValueError as err:
            out["auto"] = str(err)
        y = torch.full((4096,), float(rank))
        try:
            comm.broadcast(y, 0, group=group, algorithm="ring")
            out["ring"] = bool((y == 0).all())
        except ValueError as err:
            out["ring"] = str(err)
        return out
    finally:
        os.environ.pop("DTRAIN_CALIBRATION", None)
        os.environ.pop("DTRAIN_COMM_RULES", None)
        _forget_choices(group)


def auto_with_rank0_sending(data: bytes) -> str:
    """Ranks 0 and 1: rank 0's rules agreement arrives as ``data`` on every rank, then an ``auto`` all-reduce.
    Returns what the call raised, as "Type: message", or "no error"."""
    group = group_of(2)
    _forget_choices(group)
    real = api._from_rank0
    api._from_rank0 = lambda group, mine, device: data
    try:
        comm.all_reduce(torch.ones(4), group=group, algorithm="auto")
        return "no error"
    except Exception as err:  # noqa: BLE001  (what the caller sees is the point)
        return f"{type(err).__name__}: {err}"
    finally:
        api._from_rank0 = real
        _forget_choices(group)
