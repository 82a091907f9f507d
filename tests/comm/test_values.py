"""Values between ranks as JSON (``dtrain.comm.values``), and no pickled object collective anywhere in dtrain."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dtrain.comm.values import _decode, _encode
from dtrain.parallel.pipeline_schedules import Timeline, TimelineEvent
from tests.jobs import values as jobs

PACKAGE = Path(__file__).resolve().parents[2] / "dtrain"


def test_every_ranks_value_arrives_in_rank_order_as_it_was_sent(pool):
    for rank_result in pool.run(jobs.gather_records, 3, ranks=3):
        assert [r["rank"] for r in rank_result] == [0, 1, 2]
        assert rank_result[2] == {"rank": 2, "names": ["w", "w"], "x": 2 / 3, "nested": {"none": None, "ok": True},
                                  "s": "é∑"}  # fmt: skip


def test_a_value_the_check_refuses_raises_on_every_rank_naming_the_sender(pool):
    said = pool.run(jobs.gather_one_bad_record, 3, ranks=3)
    assert said == ["rank 1 sent a record with a rank, not ['not', 'a', 'record']"] * 3


def test_a_length_beyond_the_limit_is_refused_on_every_rank_before_anything_is_received(pool):
    said = pool.run(jobs.gather_one_overlong, 3, ranks=3)
    assert said == ["rank 1 announced a value of 42 bytes; a value takes 0 to 8 bytes"] * 3


def test_rank_0s_value_reaches_every_rank(pool):
    assert pool.run(jobs.broadcast_from_rank0, 2, ranks=2) == [{"token": "0123456789ab", "n": [1, 2, 3]}] * 2


def test_pipeline_timelines_cross_ranks_whole(pool):
    assert pool.run(jobs.gather_timelines, 2, ranks=2) == [[True, True]] * 2


def test_only_json_is_sent_and_only_json_is_read():
    with pytest.raises(ValueError, match="must be JSON"):
        _encode({1, 2})
    with pytest.raises(ValueError, match="must be JSON"):
        _encode(float("nan"))
    with pytest.raises(ValueError, match="^rank 3 sent a value that is not JSON"):
        _decode(b"\x80\x04K\x01.", 3, lambda v: v)  # a pickle of 1


TIMELINE = Timeline(stage=1, num_stages=2, num_microbatches=1, events=[TimelineEvent("F", 0, 0.0, 1.0)])


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"stage": -1}, "stage is not a count"),
        ({"stage": True}, "stage is not a count"),
        ({"end_s": "1"}, "end_s is not a number"),
        ({"clock": "wall"}, "unknown clock"),
        ({"events": [["F", 0, 0.0, 1.0]]}, "not \\[kind, microbatch, start_s, end_s, chunk\\]"),
        ({"events": {}}, "events are not a list"),
        ({"extra": 1}, "fields"),
    ],
)
def test_a_timeline_is_read_back_only_whole(change, said):
    assert Timeline.from_json(TIMELINE.to_json()) == TIMELINE
    with pytest.raises(ValueError, match=said):
        Timeline.from_json(TIMELINE.to_json() | change)


def test_no_module_sends_a_pickled_object_between_processes():
    """torch.distributed's ``*_object`` collectives unpickle what a peer sends; dtrain sends JSON or tensors. Read
    from the source: every name or attribute of those collectives, every import of a pickle module."""
    objects = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"}
    picklers = {"pickle", "cPickle", "dill", "cloudpickle"}
    used = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if "_object" not in text and not any(name in text for name in picklers):
            continue  # no name of either kind in its text: nothing to parse
        for node in ast.walk(ast.parse(text)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if name in objects or any(m.split(".")[0] in picklers for m in modules):
                used.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not used, used
