"""Every message kind is checked against its schema and the job's configuration (dtrain.ps.messages): forged
hot-key copies, replication entries, registrations and replies are refused, and a live server that gets them
keeps its state and keeps answering as before."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from dtrain.ps import messages, wire
from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster
from dtrain.ps.worker import Worker

# 3 servers, 30 keys: shard 0 holds keys 0..9, shard 1 keys 10..19, shard 2 keys 20..29
HOT = JobConfig(num_keys=30, width=2, num_servers=3, num_workers=2, hot_keys=4, hot_replicas=1)
REPLICATED = JobConfig(num_keys=30, width=2, num_servers=3, num_workers=2, replicas=2)


def _keys(*k: int) -> np.ndarray:
    return np.array(k, np.int64)


def _rows(n: int, width: int = 2) -> np.ndarray:
    return np.zeros((n, width), np.float32)


# what every message between servers carries: the sender's view and rank (server 0, in the first view)
VIEW = {"epoch": 0, "from": 0}


def _check(table, op, header, tensors, config, **kw) -> None:
    messages.check(table, op, header, tensors, config, **kw)


def test_a_well_formed_hot_update_to_a_copy_holder_passes():
    # shard 0's owner is server 0; its hot rows are copied to server 1
    _check(messages.SERVER, "hot_update", {"shard": 0, "round": 3, "slowest": 2, **VIEW}, [_keys(1, 4, 9), _rows(3)],
           HOT, rank=1)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "rank", "header", "tensors", "reason"),
    [
        (HOT, 1, {"shard": 99, "round": 0, "slowest": 0}, [_keys(1), _rows(1)], r"shard must be in \[0, 3\), got 99"),
        (HOT, 1, {"shard": "x", "round": 0, "slowest": 0}, [_keys(1), _rows(1)], r"shard must be in \[0, 3\)"),
        (HOT, 1, {"shard": True, "round": 0, "slowest": 0}, [_keys(1), _rows(1)], r"shard must be in \[0, 3\)"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [np.array([1.0], np.float32), _rows(1)],
         r"keys must be int64 \(1,\), got float32"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1, 2), _rows(2, width=3)],
         r"values must be float32 \(2, 2\), got float32 \(2, 3\)"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1, 2), _rows(3)], r"values must be float32 \(2, 2\)"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1, 12), _rows(2)],
         r"outside shard 0's range \[0, 10\)"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(4, 1), _rows(2)], "strictly increasing"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1, 1), _rows(2)], "strictly increasing"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1, 2, 3, 4, 5), _rows(5)], "over hot_keys=4"),
        (HOT, 2, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1), _rows(1)], "server 2 holds no copies of shard 0"),
        (HOT, 0, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1), _rows(1)], "server 0 holds no copies of shard 0"),
        (HOT, 1, {"shard": 0, "round": -1, "slowest": 0}, [_keys(1), _rows(1)],
         r"round must be an int in \[0, 2\*\*62\)"),
        (HOT, 1, {"shard": 0, "round": 0}, [_keys(1), _rows(1)], "slowest is missing"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0, "extra": 1}, [_keys(1), _rows(1)], "not in the schema: extra"),
        (HOT, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1)], "carries 1 tensors"),
        (REPLICATED, 1, {"shard": 0, "round": 0, "slowest": 0}, [_keys(1), _rows(1)],
         r"off in this job \(hot_keys=0\)"),
    ],
)  # fmt: skip
def test_a_malformed_or_unwanted_hot_update_is_refused(config, rank, header, tensors, reason):
    with pytest.raises(messages.MessageError, match=reason) as info:
        _check(messages.SERVER, "hot_update", {**VIEW, **header}, tensors, config, rank=rank)
    assert str(info.value).startswith("hot_update: ")


@pytest.mark.parametrize(
    ("config", "header", "tensors", "reason"),
    [
        (REPLICATED, {"kind": "step", "pushes": [[0, 0, 0]]}, [_keys(2, 1), _rows(2)], "strictly increasing"),
        (REPLICATED, {"kind": "step", "pushes": [[2, 0, 0]]}, [_keys(1), _rows(1)], "worker < 2"),
        (REPLICATED, {"kind": "step", "pushes": [[0, -1, 0]]}, [_keys(1), _rows(1)], "pushes must be"),
        (REPLICATED, {"kind": "init", "pushes": []}, [_keys(), _rows(9)], r"rows must be float32 \(10, 2\)"),
        (REPLICATED, {"kind": "init", "pushes": []}, [_keys(1), _rows(10)], r"keys must be int64 \(0,\)"),
        (REPLICATED, {"kind": "merge", "pushes": []}, [], "kind must be one of init, step"),
        (HOT, {"kind": "step", "pushes": []}, [_keys(1), _rows(1)], r"replication is off in this job \(replicas=1\)"),
    ],
)  # fmt: skip
def test_a_malformed_replication_entry_is_refused(config, header, tensors, reason):
    with pytest.raises(messages.MessageError, match=reason):
        _check(messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 1, **VIEW, **header}, tensors, config, rank=1)
    _check(messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 1, "kind": "step", "pushes": [[1, 0, 0]], **VIEW},
           [_keys(1, 5), _rows(2)], REPLICATED, rank=1)  # fmt: skip


@pytest.mark.parametrize(
    ("table", "op", "header", "tensors", "kw", "reason"),
    [
        (messages.COORDINATOR, "register", {"role": "server", "rank": 3, "endpoint": "tcp://x:1"}, [], {},
         r"rank must be in \[0, 3\), got 3"),
        (messages.COORDINATOR, "register", {"role": "worker", "rank": 2}, [], {}, r"rank must be in \[0, 2\)"),
        (messages.COORDINATOR, "register", {"role": "server", "rank": 0}, [], {}, "with its endpoint"),
        (messages.COORDINATOR, "register", {"role": "boss", "rank": 0}, [], {}, "role must be one of"),
        (messages.COORDINATOR, "hb", {"rank": -1}, [], {}, r"rank must be in \[0, 3\)"),
        (messages.WORKER_CONTROL, "layout", {"layout": {"epoch": 1, "chains": [[0], [1]], "endpoints": [None] * 3}},
         [], {}, "layout must be"),
        (messages.WORKER_CONTROL, "layout", {"layout": {"epoch": 1, "chains": [[0], [1], [7]],
                                                        "endpoints": [None] * 3}}, [], {}, "layout must be"),
        (messages.WORKER_CONTROL, "layout", {"layout": {"epoch": 1, "chains": [[0], [1], [2]],
                                                        "endpoints": ["tcp://a:1", "tcp://b:1", None]}}, [], {},
         r"chains name servers \[2\], which have no endpoint"),
        (messages.SERVER_CONTROL, "layout", {"layout": {"epoch": 1, "chains": [[0], [1], [2]],
                                                        "endpoints": ["tcp://a:1", None, None]}}, [], {},
         r"chains name servers \[1, 2\], which have no endpoint"),
        (messages.WORKER_REPLIES, "pull", {"req": 1, "status": "ok", "round": 0}, [_rows(2)], {"shard": 0, "n": 3},
         r"rows must be float32 \(3, 2\)"),
        (messages.WORKER_REPLIES, "pull", {"req": 1, "status": "ok", "round": 0, "hot_version": 1,
                                           "hot_servers": [1]}, [_rows(3), _keys(11)], {"shard": 0, "n": 3},
         "hot keys outside shard 0's range"),
        (messages.WORKER_REPLIES, "push", {"req": 1, "status": "lost"}, [], {}, "status must be one of"),
        (messages.WORKER_REPLIES, "push", {"req": 1, "status": "error"}, [], {}, "code is missing"),
        (messages.SERVER, "pull", {"req": 1, "shard": 0, "worker": 0, "clock": 0, "hot_seen": 5}, [_keys(1)], {},
         r"hot_seen must be in \[0, 2\)"),
        (messages.SERVER, "launch", {"req": 1}, [], {}, "unknown op 'launch'"),
    ],
)  # fmt: skip
def test_every_kind_is_checked_by_the_same_tables(table, op, header, tensors, kw, reason):
    with pytest.raises(messages.MessageError, match=reason):
        _check(table, op, header, tensors, HOT, **kw)


@pytest.mark.parametrize(
    ("config", "header", "tensors", "reason"),
    [
        (HOT, {"hot_version": 1}, [_rows(1), _keys(1, 2)], "hot_version without hot_servers"),
        (HOT, {"hot_servers": [1]}, [_rows(1), _keys(1, 2)], "hot_servers without hot_version"),
        (HOT, {"hot_version": 1, "hot_servers": [1]}, [_rows(1), _keys(0, 1, 2, 3, 4)], "over hot_keys=4"),
        (REPLICATED, {"hot_version": 1, "hot_servers": [1]}, [_rows(1), _keys(1)], r"off in this job \(hot_keys=0\)"),
        (REPLICATED, {}, [_rows(1), _keys(1)], "over hot_keys=0"),
    ],
)  # fmt: skip
def test_a_pull_reply_names_hot_rows_whole_and_only_where_the_job_has_them(config, header, tensors, reason):
    """A worker routes its pulls by what a reply says of hot rows: a half or unwanted advertisement is a
    MessageError (which the worker reports as a malformed reply), never a KeyError in the worker."""
    with pytest.raises(messages.MessageError, match=reason):
        _check(messages.WORKER_REPLIES, "pull", {"req": 1, "status": "ok", "round": 0, **header}, tensors, config,
               shard=0, n=1)  # fmt: skip
    whole = {"req": 1, "status": "ok", "round": 0, "hot_version": 1, "hot_servers": [1]}
    _check(messages.WORKER_REPLIES, "pull", whole, [_rows(1), _keys(1, 2)], HOT, shard=0, n=1)


# --- a live server --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """2 servers, hot-key copies off: server 0 leads shard 0 (keys 0..3) and nothing of shard 1 (keys 4..7)."""
    config = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=1, mode="async")
    with LocalCluster(config) as c:
        worker = Worker(c.coordinator, c.secret, 0)
        worker.wait(worker.init(np.repeat(np.arange(8, dtype=np.float32)[:, None], 2, axis=1)))
        worker.close()
        ctx = zmq.Context()
        sock = wire.configure_socket(ctx.socket(zmq.DEALER))
        sock.connect(c.server_address(0))
        yield c, sock
        ctx.destroy(linger=0)


def _ask(c, sock, header: dict, tensors: list, secret: bytes | None = None) -> wire.Message:
    sock.send_multipart(wire.encode(secret or c.secret, header, tensors))
    assert sock.poll(10_000), "the server stopped answering"
    return wire.decode(c.secret, sock.recv_multipart())


def _pull_shard_1_is_not_led_here(c, sock) -> None:
    reply = _ask(c, sock, {"op": "pull", "shard": 1, "worker": 0, "clock": 0, "req": 5}, [_keys(5)])
    assert reply.header["status"] == "error" and reply.header["code"] == "not_leader", reply.header
    assert not reply.tensors


@pytest.mark.parametrize(
    ("header", "tensors"),
    [
        ({"shard": 99, "round": 0, "slowest": 0}, [_keys(5), _rows(1)]),
        ({"shard": "x", "round": 0, "slowest": 0}, [_keys(5), _rows(1)]),
        ({"shard": 1, "round": 0, "slowest": 0}, [np.array([5.0], np.float32), _rows(1)]),
        ({"shard": 1, "round": 0, "slowest": 0}, [_keys(5), _rows(1, width=7)]),
        ({"shard": 1, "round": 0, "slowest": 0}, [_keys(5), _rows(1)]),  # well formed, but copies are off
        ({"shard": 1, "round": 9, "slowest": 9}, [_keys(4, 5, 6, 7), np.full((4, 2), 666.0, np.float32)]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("signed", [True, False], ids=["valid-hmac", "wrong-secret"])
def test_a_forged_hot_update_installs_nothing_and_the_server_still_answers_not_leader(cluster, header, tensors,
                                                                                      signed):  # fmt: skip
    c, sock = cluster
    before = c.ask_server(0, {"op": "stats"}).header["stats"]
    secret = c.secret if signed else b"w" * 32
    sock.send_multipart(wire.encode(secret, {"op": "hot_update", **VIEW, **header}, tensors))
    _pull_shard_1_is_not_led_here(c, sock)
    after = c.ask_server(0, {"op": "stats"}).header["stats"]
    assert after["hot"]["copies"] == 0
    if signed:  # authenticated, then refused by its schema and the job
        assert (after["errors"], after["rejected"]) == (before["errors"] + 2, before["rejected"])
    else:  # not authenticated: dropped by the wire
        assert (after["errors"], after["rejected"]) == (before["errors"] + 1, before["rejected"] + 1)
    own = _ask(c, sock, {"op": "pull", "shard": 0, "worker": 0, "clock": 0, "req": 6}, [_keys(3, 0)])
    assert own.header["status"] == "ok" and own.tensors[0][:, 0].tolist() == [3.0, 0.0]


# --- bounds on every int, types before values, finite floats ---------------------------------------------------

PUSH = {"req": 1, "shard": 0, "worker": 0, "push_id": 0, "clock": 0}


@pytest.mark.parametrize(
    ("table", "op", "header", "tensors", "config", "reason"),
    [
        (messages.SERVER, "push", {**PUSH, "clock": 2**63 - 1}, [_keys(1), _rows(1)], HOT, r"clock must be an int in"),
        (messages.SERVER, "push", {**PUSH, "clock": 2**62}, [_keys(1), _rows(1)], HOT, r"\[0, 2\*\*62\), got"),
        (messages.SERVER, "push", {**PUSH, "push_id": 2**64 - 1}, [_keys(1), _rows(1)], HOT, "push_id must be"),
        (messages.SERVER, "pull", {"req": 2**62, "shard": 0, "worker": 0, "clock": 0}, [_keys(1)], HOT, "req must"),
        (messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 2**63, "kind": "step", "pushes": []},
         [_keys(1), _rows(1)], REPLICATED, "round must be"),
        (messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 1, "kind": "step", "pushes": [[0, 0, 2**63 - 1]]},
         [_keys(1), _rows(1)], REPLICATED, "pushes must be"),
        (messages.SERVER, "chain_ack", {"shard": 0, "seq": 2**62}, [], REPLICATED, "seq must be"),
        (messages.SERVER, "chain_ack", {"shard": 0, "seq": 1, "epoch": -1}, [], REPLICATED,
         r"epoch must be an int in \[0, 2\*\*62\)"),
        (messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 1, "kind": "step", "pushes": [], "from": 3},
         [_keys(1), _rows(1)], REPLICATED, r"from must be in \[0, 3\), got 3"),
        (messages.WORKER_CONTROL, "layout", {"layout": {"epoch": 1, "chains": [[[0]], [1], [2]],
                                                        "endpoints": [None] * 3}}, [], HOT, "layout must be"),
        (messages.WORKER_CONTROL, "layout", {"layout": {"epoch": 2**62, "chains": [[0], [1], [2]],
                                                        "endpoints": [None] * 3}}, [], HOT, "layout must be"),
        (messages.SERVER, "pull", {"req": 1, "shard": 0, "worker": 0, "clock": 0}, [_keys(1, 2, 1)], HOT,
         "keys must be distinct"),
        (messages.SERVER, "push", PUSH, [_keys(1), np.array([[np.nan, 0]], np.float32)], HOT,
         "values must be finite"),
        (messages.SERVER, "init", {"req": 1, "shard": 0}, [np.full((10, 2), np.inf, np.float32)], HOT,
         "rows must be finite"),
        (messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 1, "kind": "step", "pushes": []},
         [_keys(1), np.array([[0, -np.inf]], np.float32)], REPLICATED, "values must be finite"),
        (messages.SERVER, "rep", {"shard": 0, "seq": 1, "round": 0, "kind": "init", "pushes": []},
         [_keys(), np.full((10, 2), np.nan, np.float32)], REPLICATED, "rows must be finite"),
        (messages.SERVER, "hot_update", {"shard": 0, "round": 0, "slowest": 0},
         [_keys(1), np.array([[np.nan, 1]], np.float32)], HOT, "values must be finite"),
        (messages.SERVER, "chain_ack", {"shard": 0, "seq": 1}, [],
         JobConfig(num_keys=30, width=2, num_servers=3, replicas=2, replication="primary_backup"),
         "not used with replication=primary_backup"),
    ],
)  # fmt: skip
def test_out_of_range_ints_wrong_types_repeats_and_non_finite_values_are_refused(table, op, header, tensors, config,
                                                                                 reason):  # fmt: skip
    if table is messages.SERVER and op in messages.PEER:
        header = {**VIEW, **header}
    with pytest.raises(messages.MessageError, match=reason):
        _check(table, op, header, tensors, config, rank=1)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ([1, 2], "config must be a map"),
        ({"num_keys": "x", "width": 2}, "config is not a valid job"),
        ({"num_keys": 8, "width": 2, "lr": "fast"}, "config is not a valid job"),
        ({"num_keys": 8, "width": 2, "surprise": 1}, "config is not a valid job"),
    ],
)
def test_a_welcome_with_a_malformed_job_is_a_message_error(config, reason):
    with pytest.raises(messages.MessageError, match=reason):
        messages.job_config({"op": "welcome", "config": config})


def test_a_hot_copy_refuses_a_pull_too_far_ahead_and_too_many_waiting_pulls():
    from dtrain.ps.consistency import MAX_AHEAD, MAX_WAITING
    from dtrain.ps.hotkeys import HotCopies
    from dtrain.ps.keys import partition

    config = JobConfig(num_keys=30, width=2, num_servers=3, num_workers=2, mode="sync", hot_keys=4)
    copies = HotCopies(config, 1, partition(30, 3), lambda *a: None)
    copies.update(0, 3, 0, _keys(1, 4), _rows(2), lambda *a: None)
    with pytest.raises(ValueError, match=f"more than {MAX_AHEAD} past"):
        copies.pull(0, (None, 0, 3 + MAX_AHEAD + 1, _keys(1)), lambda *a: None)
    for _ in range(MAX_WAITING):  # round 4 is not there yet: they wait
        copies.pull(0, (None, 1, 4, _keys(4)), lambda *a: None)
    with pytest.raises(ValueError, match=f"worker 1 has {MAX_WAITING} pulls"):
        copies.pull(0, (None, 1, 4, _keys(4)), lambda *a: None)
    assert len(copies.waiting[0]) == MAX_WAITING


@pytest.mark.parametrize(
    ("kind", "keys", "values", "pushes", "reason"),
    [
        ("step", _keys(1), _rows(1), [[0, 0, 2**63 - 1]], "push"),  # the clock that overflowed clocks[worker] + 1
        ("step", _keys(1, 2), np.array([[1, 1], [np.nan, 1]], np.float32), [[0, 0, 0]], "not all finite"),
        ("step", _keys(2, 1), _rows(2), [[0, 0, 0]], "strictly increasing"),
        ("step", _keys(12), _rows(1), [[0, 0, 0]], "inside"),
        ("init", _keys(), _rows(10), [], "initialised already"),
        ("drop", _keys(), _rows(0), [], "unknown kind"),
    ],
)  # fmt: skip
def test_a_refused_entry_changes_nothing_in_the_shard(kind, keys, values, pushes, reason):
    from dtrain.ps.keys import KeyRange
    from dtrain.ps.shard import Entry, EntryError, ShardState

    config = JobConfig(num_keys=30, width=2, num_servers=3, num_workers=2, optimizer="adam")
    state = ShardState(config, 0, KeyRange(0, 10))
    state.apply(Entry(1, "init", 0, _keys(), np.ones((10, 2), np.float32), []))
    state.apply(Entry(2, "step", 1, _keys(3), np.ones((1, 2), np.float32), [[1, 0, 0]]))
    before = {name: np.array(a, copy=True) for name, a in state.arrays().items()}
    with pytest.raises(EntryError, match=reason):
        state.apply(Entry(3, kind, 2, keys, values, pushes))
    assert (state.seq, state.round, state.last_push.tolist()) == (2, 1, [-1, 0])
    for name, a in state.arrays().items():
        np.testing.assert_array_equal(a, before[name], err_msg=name)


def test_a_step_entry_before_init_is_refused_and_leaves_the_sequence_where_it_was():
    from dtrain.ps.keys import KeyRange
    from dtrain.ps.shard import Entry, EntryError, ShardState

    config = JobConfig(num_keys=30, width=2, num_servers=3, num_workers=2, momentum=0.9)
    state = ShardState(config, 0, KeyRange(0, 10))
    with pytest.raises(EntryError, match="a step before the shard's initial values"):
        state.apply(Entry(1, "step", 1, _keys(1), np.ones((1, 2), np.float32), [[0, 0, 0]]))
    assert state.seq == 0 and not state.optimizer.state["started"].any()
    assert state.apply(Entry(1, "init", 0, _keys(), np.ones((10, 2), np.float32), []))
    assert state.ready and state.seq == 1
