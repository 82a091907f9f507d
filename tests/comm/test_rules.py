"""Measured rules for ``algorithm="auto"`` (dtrain.comm.cost.rules): built from bench records, read by the API."""

from __future__ import annotations

import json

import pytest

from dtrain.comm import algorithms as api_algorithms
from dtrain.comm.cost import rules
from dtrain.comm.cost.rules import Rules
from tests.jobs import rules as jobs


def _rec(alg: str, nbytes: int, time_us: float, coll: str = "all_reduce", world: int = 4) -> dict:
    return {"collective": coll, "algorithm": alg, "nbytes": nbytes, "time_us": time_us, "world_size": world}


def test_rules_keep_the_fastest_path_native_included_and_switch_between_measured_sizes():
    records = [
        _rec("ring", 1 << 20, 50.0), _rec("halving_doubling", 1 << 20, 40.0), _rec("native", 1 << 20, 45.0),
        _rec("ring", 4 << 20, 90.0), _rec("halving_doubling", 4 << 20, 95.0), _rec("native", 4 << 20, 99.0),
        _rec("ring", 16 << 20, 300.0), _rec("halving_doubling", 16 << 20, 310.0), _rec("native", 16 << 20, 250.0),
        _rec("auto", 16 << 20, 1.0), _rec("ring+graph", 1 << 20, 1.0),
    ]  # fmt: skip
    made = rules.from_records(records, kind="cuda-peer")
    assert made.table == {"all_reduce": ((0, "halving_doubling"), (2 << 20 | 1, "ring"), (8 << 20 | 1, "native"))}
    assert made.pick("all_reduce", 1) == "halving_doubling"
    assert made.pick("all_reduce", 2 << 20) == "halving_doubling"  # up to the geometric midpoint
    assert made.pick("all_reduce", (2 << 20) + 1) == "ring"
    assert made.pick("all_reduce", 1 << 40) == "native"
    assert made.pick("broadcast", 1 << 20) is None
    assert made.covers("cuda-peer", 4, None) and not made.covers("cuda", 4, None)
    assert not made.covers("cuda-peer", 8, None)


def test_a_path_must_beat_native_by_the_margin_to_win_a_size():
    records = [_rec("native", 1 << 10, 100.0), _rec("ring", 1 << 10, 95.0), _rec("star@peer", 1 << 10, 97.0)]
    records += [_rec("native", 1 << 20, 100.0), _rec("ring", 1 << 20, 80.0), _rec("star@peer", 1 << 20, 70.0)]
    assert rules.from_records(records, kind="cpu").table == {"all_reduce": ((0, "ring"), (32769, "star@peer"))}
    made = rules.from_records(records, kind="cpu", margin=0.1)
    assert made.table == {"all_reduce": ((0, "native"), (32769, "star@peer"))}
    with pytest.raises(ValueError, match="margin"):
        rules.from_records(records, kind="cpu", margin=-1)


def test_rules_round_trip_through_a_file(tmp_path):
    made = Rules(kind="cpu", world_size=2, table={"all_reduce": ((0, "ring"), (100, "direct"))}, meta={"x": 1})
    path = rules.save_rules(made, tmp_path / "r.json")
    assert rules.load_rules("cpu", path) == made
    assert rules.load_rules("cpu", tmp_path / "absent.json") is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not json", "not a dtrain rules file"),
        (json.dumps({"world_size": 2, "rules": {}}), "malformed"),
        (json.dumps({"kind": "cpu", "world_size": 0, "rules": {}}), "world_size"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[5, "ring"]]}}), "start at 0"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[0, "a"], [0, "b"]]}}), "rise"),
        ('{"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[0, "ring"], [Infinity, "native"]]}}', "malformed"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[0, "rnig"]]}}), "'rnig', not one"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"allreduce": [[0, "ring"]]}}), "unknown collective"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[0, "ring@nvlink"]]}}), "not one"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"all_reduce": [[0, "native@peer"]]}}), "not one"),
        (json.dumps({"kind": "cpu", "world_size": 2, "rules": {"broadcast": [[0, "one_shot"]]}}), "not one"),
        (b"\xff\xfe", "not a dtrain rules file"),
        (None, "not a dtrain rules file"),  # a directory
    ],
)
def test_a_bad_rules_file_is_an_error_naming_it(tmp_path, text, problem):
    path = tmp_path / "rules.json"
    if text is None:
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ValueError, match=problem) as err:
        rules.load_rules("cpu", path)
    assert str(path) in str(err.value)


def test_records_of_several_group_sizes_are_refused():
    with pytest.raises(ValueError, match="several group sizes"):
        rules.from_records([_rec("ring", 8, 1.0, world=2), _rec("ring", 8, 1.0, world=4)], kind="cpu")
    with pytest.raises(ValueError, match="no record"):
        rules.from_records([_rec("auto", 8, 1.0)], kind="cpu")


def test_auto_follows_the_rules_file_where_it_covers_the_call(pool, tmp_path):
    path = tmp_path / "rules.json"
    table = {"all_reduce": ((0, "star"), (4096, "tree"))}
    rules.save_rules(Rules(kind="cpu", world_size=4, table=table), path)
    small = pool.run(jobs.auto_with_rules, 4, [str(path)] * 4, 16, ranks=4)
    assert small == [{"chosen": "star", "right": True}] * 4
    big = pool.run(jobs.auto_with_rules, 4, [str(path)] * 4, 4096, ranks=4)
    assert big == [{"chosen": "tree", "right": True}] * 4
    # rules for another group size do not apply: with nothing measured, auto is the backend's own collective
    other = pool.run(jobs.auto_with_rules, 2, [str(path)] * 2, 16, ranks=2)
    plain = pool.run(jobs.auto_with_rules, 2, [None] * 2, 16, ranks=2)
    assert other == plain == [{"chosen": "native", "right": True}] * 2


def test_a_rule_names_native_or_hands_the_choice_to_the_cost_model(pool, tmp_path):
    path = tmp_path / "rules.json"
    table = {"all_reduce": ((0, "native"), (4096, rules.MODEL))}
    rules.save_rules(Rules(kind="cpu", world_size=4, table=table), path)
    small = pool.run(jobs.auto_with_rules, 4, [str(path)] * 4, 16, ranks=4)
    assert small == [{"chosen": "native", "right": True}] * 4
    big = pool.run(jobs.auto_with_rules, 4, [str(path)] * 4, 4096, ranks=4)
    ours = set(api_algorithms("all_reduce")) - {"auto", "native"}
    assert big[0]["chosen"] in ours and big == [big[0]] * 4 and big[0]["right"]


def test_ranks_that_read_different_rules_follow_rank_0s(pool, tmp_path):
    path = tmp_path / "rules.json"
    rules.save_rules(Rules(kind="cpu", world_size=2, table={"all_reduce": ((0, "star"),)}), path)
    out = pool.run(jobs.auto_with_rules, 2, [str(path), None], 16, ranks=2)
    assert out == [{"chosen": "star", "right": True}] * 2
    out = pool.run(jobs.auto_with_rules, 2, [None, str(path)], 16, ranks=2)
    assert out == [{"chosen": "native", "right": True}] * 2


def test_built_in_rules_cover_only_what_was_measured_and_native_runs_elsewhere(monkeypatch, tmp_path):
    from dtrain.comm import api
    from dtrain.comm.ir.schedule import Collective

    monkeypatch.setenv("DTRAIN_COMM_RULES", str(tmp_path / "none.json"))  # this machine's own files stay out
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "none-cal.json"))
    for cached in (api._auto, api._rules, api._params):
        cached.cache_clear()
    peer2 = rules.built_in("cuda-peer", 2, None)
    assert peer2 is not None and peer2.pick("reduce_scatter", 64 << 20) == "native_wide"
    assert peer2.pick("gather", 64 << 20) == "native" and peer2.pick("scan", 64 << 20) is None  # no rule: native
    peer4 = rules.built_in("cuda-peer", 4, None)
    # the one-pass reduce-scatter, broadcast, all-gather and all-to-all where they measured faster than NCCL's,
    # NCCL's above: on the wide communicator where that measured faster (not the broadcast; the all-to-all on 2
    # GPUs from 64 MiB, on 4 to 256 MiB)
    sizes = (8 << 10, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20)
    for table in (peer2, peer4):
        assert [table.pick("reduce_scatter", n) for n in sizes] == ["direct"] * 4 + ["native_wide"] * 2
    assert [peer2.pick("all_to_all", n) for n in sizes] == ["direct"] * 4 + ["native"] * 2
    assert [peer4.pick("all_to_all", n) for n in sizes] == ["direct"] * 4 + ["native_wide"] * 2
    assert peer2.pick("all_to_all", 64 << 20) == "native_wide" and peer4.pick("all_to_all", 1 << 30) == "native"
    assert [peer2.pick("broadcast", n) for n in sizes] == ["star"] * 4 + ["native"] * 2
    assert peer2.pick("broadcast", 1 << 30) == "native" and peer4.pick("broadcast", 1 << 30) == "native"
    # the one-pass reduce on 2 GPUs up to its 8 MiB, NCCL's above; on 4 to 2 MiB, where the root's port carrying
    # three windows binds from 4 MiB
    assert [peer2.pick("reduce", n) for n in sizes] == ["star"] * 4 + ["native"] * 2
    assert [peer4.pick("reduce", n) for n in sizes] == ["star"] * 2 + ["native"] * 4
    # the gather (by its output) and the scatter (by its input) in one pass, to 8 MiB a rank put in
    assert [peer2.pick("gather", n) for n in sizes] == ["star"] * 5 + ["native"]
    assert [peer2.pick("scatter", n) for n in sizes] == ["star"] * 4 + ["native"] * 2
    assert [peer4.pick("gather", n) for n in sizes] == ["star"] * 6 and peer4.pick("gather", 64 << 20) == "native"
    assert [peer4.pick("scatter", n) for n in sizes] == ["star"] * 4 + ["native"] * 2
    # on 4 GPUs the star's root links bind from 4 MiB: the scatter-allgather sends its buffer once, to 4 MiB
    assert [peer4.pick("broadcast", n) for n in sizes] == ["star"] * 2 + ["scatter_allgather"] + ["native"] * 3
    # the all-gather by its output: up to the one pass's 8 MiB a rank on 2 GPUs, to 16 MiB (of 32) on 4
    assert [peer2.pick("all_gather", n) for n in sizes] == ["direct"] * 5 + ["native_wide"]
    assert [peer4.pick("all_gather", n) for n in sizes] == ["direct"] * 5 + ["native_wide"]
    # the one-shot all-reduce, then the two-shot from 1 MiB, where each was measured faster; NCCL's above, on the
    # wide communicator from 16 MiB
    reduces = (8 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20)
    want2 = ["one_shot"] * 2 + ["direct"] * 4 + ["native_wide"] * 2
    assert [peer2.pick("all_reduce", n) for n in reduces] == want2
    want4 = ["one_shot"] * 2 + ["direct"] * 2 + ["native"] * 2 + ["native_wide"] * 2
    assert [peer4.pick("all_reduce", n) for n in reduces] == want4
    assert rules.built_in("cuda-peer", 8, None) is None and rules.built_in("cpu", 2, None) is None
    try:
        assert api._auto(Collective.REDUCE_SCATTER, 64 << 20, 2, "cuda-peer", None) == "native_wide"
        assert api._auto(Collective.REDUCE_SCATTER, 1 << 20, 2, "cuda-peer", None) == "direct"
        for coll in Collective:
            for kind in ("cuda", "cuda-peer", "cpu", "cpu-peer"):
                wide = kind == "cuda-peer" and coll.value in (
                    "all_reduce",
                    "all_gather",
                    "reduce_scatter",
                    "all_to_all",
                )
                assert api._auto(coll, 64 << 20, 4, kind, None) == ("native_wide" if wide else "native")
    finally:
        for cached in (api._auto, api._rules, api._params):
            cached.cache_clear()


def test_a_rules_file_without_a_rule_for_a_collective_leaves_the_built_in_rule_in_force(monkeypatch, tmp_path):
    from dtrain.comm import api
    from dtrain.comm.ir.schedule import Collective

    path = tmp_path / "rules.json"
    rules.save_rules(Rules(kind="cuda-peer", world_size=2, table={"all_gather": ((0, "direct"),)}), path)
    monkeypatch.setenv("DTRAIN_COMM_RULES", str(path))
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "none-cal.json"))
    for cached in (api._auto, api._rules, api._params):
        cached.cache_clear()
    try:
        assert api._auto(Collective.ALL_GATHER, 64 << 20, 2, "cuda-peer", None) == "direct"  # the file's
        assert api._auto(Collective.REDUCE_SCATTER, 64 << 20, 2, "cuda-peer", None) == "native_wide"  # built in
        assert api._auto(Collective.ALL_REDUCE, 64 << 20, 2, "cuda-peer", None) == "native_wide"  # built in: NCCL's
    finally:
        for cached in (api._auto, api._rules, api._params):
            cached.cache_clear()


def test_native_wide_runs_the_backends_own_call_on_the_group_where_no_wide_communicator_can_be_made(pool, tmp_path):
    """A rule naming native_wide: on Gloo no wide communicator exists (it is NCCL's), so the backend's call runs on
    the group itself, right, first call and kept call alike; with DTRAIN_COMM_WIDE=0 none is asked for."""
    path = str(tmp_path / "wide.json")
    out = pool.run(jobs.wide_with_rules, 2, path, 64, ranks=2)
    assert out == [{"right": True, "asked": 3, "got": [False] * 3, "chosen": "native_wide"}] * 2
    off = pool.run(jobs.wide_with_rules, 2, path, 64, "0", ranks=2)
    assert off == [{"right": True, "asked": 0, "got": [], "chosen": "native_wide"}] * 2


def test_every_known_name_passes_the_rules_check():
    """Ours (with a transport or without), native, native_wide and model, for every collective."""
    from dtrain.comm.ir.algorithms import registry
    from dtrain.comm.ir.schedule import Collective

    for coll in Collective:
        names = [*registry.names(coll), rules.NATIVE, rules.NATIVE_WIDE, rules.MODEL]
        names += [f"{n}@{t}" for n in registry.names(coll) for t in rules.TRANSPORTS]
        Rules(kind="cpu", world_size=2, table={coll.value: tuple((i, n) for i, n in enumerate(names))})


@pytest.mark.parametrize(
    ("contents", "expect"),
    [
        ((None, None), ("right", "right")),
        # a bad file on one rank: every rank raises, none waits; that rank names its file, the others the rank
        (
            (None, "null"),
            ("group ranks [1] cannot read their calibration file", "cal-1.json: not a dtrain calibration"),
        ),
        (("truncated", "truncated"), ("cal-0.json: not a dtrain calibration", "cal-1.json: not a dtrain calibration")),
        (("valid-a", "valid-b"), ("different calibration files", "different calibration files")),
        (("valid-a", "valid-a"), ("right", "right")),
    ],
)
def test_ranks_check_their_calibration_alike_before_auto_or_a_pipelined_ring(pool, tmp_path, contents, expect):
    """``auto`` and the ring broadcast (its pieces come from the calibration) run only where every rank prices
    with the same readable calibration; otherwise every rank raises a one-line ``ValueError`` naming it."""
    from dtrain.comm.cost.model import LinkCost
    from dtrain.comm.cost.params import CostParams

    def params(alpha: float) -> str:
        link = LinkCost(alpha_s=alpha, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10)
        return json.dumps(CostParams(intra=link).to_dict())

    files = {
        "null": "null",
        "truncated": '{"intra": {"alpha_s": 1e-5,',
        "valid-a": params(1e-5),
        "valid-b": params(2e-5),
    }
    paths = []
    for rank, name in enumerate(contents):
        if name is None:
            paths.append(None)
            continue
        path = tmp_path / f"cal-{rank}.json"
        path.write_text(files[name])
        paths.append(str(path))
    out = pool.run(jobs.calibrated_calls, 2, paths, ranks=2)
    for rank, result in enumerate(out):
        for call in ("auto", "ring"):
            if expect[rank] == "right":
                assert result[call] is True, out
            else:
                assert isinstance(result[call], str) and expect[rank] in result[call], out
                assert "\n" not in result[call]


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"[1]", "rank 0 sent list where the rules agreement is a JSON object"),
        (b"\xff{}", "rank 0 sent a value that is not JSON"),
        (b'{"error": 7}', "rank 0 sent a rules agreement whose error is not text"),
        (b'{"kind": "cpu", "world_size": "two"}', "rank 0 sent rules: world_size must be a positive int"),
    ],
)
def test_rank_0s_rules_agreement_is_checked_before_any_rank_follows_it(pool, data, problem):
    got = pool.run(jobs.auto_with_rank0_sending, data, ranks=2)
    assert got[0] == got[1] and got[0].startswith(f"ValueError: algorithm='auto': {problem}"), got
