"""Jobs of tests/comm/test_values.py: JSON values between the ranks of a pool group."""

from __future__ import annotations

import torch.distributed as dist

from dtrain.comm.values import all_gather_json, broadcast_json
from dtrain.parallel.pipeline_schedules import Timeline, TimelineEvent
from dtrain.testing.pool import group_of


def _record(value: object) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("rank"), int):
        raise ValueError(f"a record with a rank, not {value!r}")
    return value


def gather_records(world: int) -> list[dict]:
    rank = dist.get_rank()
    mine = {"rank": rank, "names": ["w"] * rank, "x": rank / 3, "nested": {"none": None, "ok": True}, "s": "é∑"}
    return all_gather_json(mine, _record, group=group_of(world))


def gather_one_bad_record(world: int) -> str:
    mine = {"rank": dist.get_rank()} if dist.get_rank() != 1 else ["not", "a", "record"]
    try:
        all_gather_json(mine, _record, group=group_of(world))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def broadcast_from_rank0(world: int) -> object:
    value = {"token": "0123456789ab", "n": [1, 2, 3]} if dist.get_rank() == 0 else None
    return broadcast_json(value, lambda v: v, src=0, group=group_of(world))


def gather_timelines(world: int) -> list[bool]:
    rank = dist.get_rank()
    events = [TimelineEvent("F", 0, 0.5 + rank, 1.0 + rank, 0), TimelineEvent("B", 1, 1.5, 2.0, 0)]
    mine = Timeline(stage=rank, num_stages=world, num_microbatches=2, virtual_stages=1, start_s=0.5, end_s=2.25,
                    peak_activations=2, clock="host", events=events)  # fmt: skip
    every = all_gather_json(mine.to_json(), Timeline.from_json, group=group_of(world))
    return [t.stage == r and t.events[0].start_s == 0.5 + r and t == _same(t) for r, t in enumerate(every)]


def _same(timeline: Timeline) -> Timeline:
    return Timeline.from_json(timeline.to_json())


def gather_one_overlong(world: int) -> str:
    """Every rank takes values of at most 8 bytes; rank 1 sends one longer without checking it: every rank refuses
    the announced length before receiving any of it."""
    import json

    from dtrain.comm import values

    limit, encode = values.MAX_BYTES, values._encode
    values.MAX_BYTES = 8
    if dist.get_rank() == 1:
        values._encode = lambda value: json.dumps(value).encode()
    try:
        mine = {"rank": 1, "pad": "x" * 20} if dist.get_rank() == 1 else [dist.get_rank()]
        all_gather_json(mine, _record, group=group_of(world))
    except ValueError as exc:
        return str(exc)
    finally:
        values.MAX_BYTES, values._encode = limit, encode
    return "accepted"
