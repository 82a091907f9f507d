"""The parameter server's wire: what decode accepts and rejects, and a live server that keeps serving
through malformed, oversized, truncated, unauthenticated and random messages."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster

SECRET = b"k" * 32
DTYPES = sorted(wire.DTYPES)


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    count=st.integers(0, 3),
)
def test_round_trip_keeps_dtype_shape_and_bytes(dtype, shape, count):
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal(shape) * 100).astype(wire.DTYPES[dtype]) for _ in range(count)]
    msg = wire.decode(SECRET, wire.encode(SECRET, {"op": "x", "n": 3}, arrays))
    assert msg.op == "x" and msg.header["n"] == 3
    for got, want in zip(msg.tensors, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def _frames() -> list[bytes]:
    keys = np.arange(4, dtype=np.int64)
    return [bytes(f) for f in wire.encode(SECRET, {"op": "pull"}, [keys])]


def test_wrong_secret_is_rejected():
    with pytest.raises(wire.WireError, match="not authenticated"):
        wire.decode(b"x" * 32, _frames())


@given(position=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_flipped_bit_is_rejected(position, bit):
    frames = _frames()
    part = position % len(frames)
    data = bytearray(frames[part])
    data[position % len(data)] ^= 1 << bit
    frames[part] = bytes(data)
    with pytest.raises(wire.WireError):
        wire.decode(SECRET, frames)


def test_truncated_payload_is_rejected_before_it_is_read():
    frames = _frames()
    frames[1] = frames[1][:-8]
    frames[-1] = wire._mac(SECRET, frames[:-1])  # even correctly signed, the size must match the header
    with pytest.raises(wire.WireError, match="needs 32 bytes, the frame holds 24"):
        wire.decode(SECRET, frames)


def test_missing_frames_are_rejected():
    with pytest.raises(wire.WireError, match="2 to"):
        wire.decode(SECRET, _frames()[:1])


def test_oversized_message_is_rejected():
    big = [bytes(f) for f in wire.encode(SECRET, {"op": "push"}, [np.zeros(1000, np.float32)])]
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.decode(SECRET, big, wire.Limits(max_message_bytes=1000))


def test_dtypes_outside_the_list_are_refused_both_ways():
    with pytest.raises(ValueError, match="cannot go on the wire"):
        wire.encode(SECRET, {"op": "x"}, [np.array(["a"], dtype=object)])
    head = wire.msgpack.packb({"op": "x", "t": [["O", [1]]]})
    frames = [head, b"\0" * 8]
    with pytest.raises(wire.WireError, match="bad \\[dtype, shape\\]"):
        wire.decode(SECRET, [*frames, wire._mac(SECRET, frames)])


def test_secret_from_env_names_the_problem(monkeypatch):
    monkeypatch.setenv(wire.SECRET_ENV, "abcd")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        wire.secret_from_env()


# --- a live server --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    config = JobConfig(num_keys=8, width=2, num_servers=1, num_workers=1, mode="async")
    with LocalCluster(config) as cluster:
        ctx = zmq.Context()
        sock = wire.configure_socket(ctx.socket(zmq.DEALER))
        sock.connect(cluster.server_address(0))
        init = wire.encode(cluster.secret, {"op": "init", "shard": 0, "req": 1}, [np.ones((8, 2), np.float32)])
        sock.send_multipart(init)
        assert sock.poll(10_000)
        sock.recv_multipart()
        yield cluster, sock
        ctx.destroy(linger=0)


def _pull_works(cluster, sock) -> None:
    sock.send_multipart(wire.encode(cluster.secret, {"op": "pull", "shard": 0, "worker": 0, "clock": 0, "req": 7},
                                    [np.array([1, 3], np.int64)]))  # fmt: skip
    assert sock.poll(10_000), "the server stopped answering"
    reply = wire.decode(cluster.secret, sock.recv_multipart())
    assert reply.header["req"] == 7 and reply.tensors[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def _rejected(cluster) -> int:
    return cluster.ask_server(0, {"op": "stats"}).header["stats"]["rejected"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=5))
def test_random_bytes_are_dropped_and_the_server_keeps_serving(server, frames):
    cluster, sock = server
    before = _rejected(cluster)
    sock.send_multipart(frames)
    _pull_works(cluster, sock)
    assert _rejected(cluster) == before + 1


def test_unauthenticated_request_gets_no_answer(server):
    cluster, sock = server
    sock.send_multipart(wire.encode(b"w" * 32, {"op": "pull", "shard": 0, "worker": 0, "clock": 0, "req": 9},
                                    [np.array([1], np.int64)]))  # fmt: skip
    _pull_works(cluster, sock)  # the next answer is to the good request, not to the forged one


@pytest.mark.parametrize(
    ("header", "tensors", "reason"),
    [
        ({"op": "pull", "shard": 0, "worker": 0, "clock": 0}, [np.array([8], np.int64)], "outside shard 0's range"),
        ({"op": "pull", "shard": 0, "worker": 0, "clock": 0}, [np.array([1.0], np.float32)], "keys must be int64"),
        ({"op": "push", "shard": 0, "worker": 0, "push_id": 0, "clock": 0},
         [np.array([1], np.int64), np.zeros((1, 3), np.float32)], "values must be float32 \\(1, 2\\)"),
        ({"op": "push", "shard": 0, "worker": 5, "push_id": 0, "clock": 0},
         [np.array([1], np.int64), np.zeros((1, 2), np.float32)], "worker must be in"),
        ({"op": "pull", "shard": 3, "worker": 0, "clock": 0}, [np.array([1], np.int64)], r"shard must be in \[0, 1\)"),
        ({"op": "launch"}, [], "unknown op"),
    ],
)  # fmt: skip
def test_malformed_requests_get_an_error_naming_the_problem(server, header, tensors, reason):
    cluster, sock = server
    sock.send_multipart(wire.encode(cluster.secret, {**header, "req": 11}, tensors))
    assert sock.poll(10_000)
    reply = wire.decode(cluster.secret, sock.recv_multipart())
    assert reply.header["status"] == "error"
    assert reply.header["req"] == 11
    import re

    assert re.search(reason, reply.header["error"]), reply.header["error"]
    _pull_works(cluster, sock)


def test_oversized_message_is_cut_off_by_the_transport(server):
    cluster, _ = server
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cluster.server_address(0))
        sock.send_multipart([b"x" * (300 << 20)])  # over the server's MAXMSGSIZE: it drops the connection
        time.sleep(0.5)
    finally:
        ctx.destroy(linger=0)
    _pull_works(*server)


def test_a_replayed_message_is_dropped_and_the_server_keeps_serving(server):
    cluster, sock = server
    before = _rejected(cluster)
    frames = [bytes(f) for f in wire.encode(cluster.secret, {"op": "pull", "shard": 0, "worker": 0, "clock": 0,
                                                             "req": 21}, [np.array([2], np.int64)])]  # fmt: skip
    sock.send_multipart(frames)
    assert sock.poll(10_000) and wire.decode(cluster.secret, sock.recv_multipart()).header["req"] == 21
    sock.send_multipart(frames)  # the same bytes again, correctly signed
    _pull_works(cluster, sock)
    assert _rejected(cluster) == before + 1


def test_stale_messages_are_refused_by_the_replay_guard():
    guard = wire.ReplayGuard(window_s=5.0)
    with pytest.raises(wire.WireError, match="outside the 5.0 s replay window"):
        guard.check({"ts": time.time() - 60.0, "nonce": 1})
    guard.check({"ts": time.time(), "nonce": 2})
    with pytest.raises(wire.WireError, match="replayed"):
        guard.check({"ts": time.time(), "nonce": 2})


def test_a_shape_whose_size_overflows_int64_is_rejected_not_wrapped():
    # 2**62 x 4 float32 elements wrap to 0 bytes in int64 arithmetic: the empty frame must not match it
    head = wire.msgpack.packb({"op": "x", "ts": time.time(), "nonce": 1, "t": [["f4", [2**62, 4]]]})
    frames = [head, b""]
    with pytest.raises(wire.WireError, match="needs"):
        wire.decode(SECRET, [*frames, wire._mac(SECRET, frames)])


@pytest.mark.parametrize(
    ("header", "tensors"),
    [
        ({"kind": "step", "round": 1, "pushes": None}, [np.array([1], np.int64), np.zeros((1, 2), np.float32)]),
        ({"kind": "step", "round": 1, "pushes": [[0, 1, 0]]}, [np.array([99], np.int64), np.zeros((1, 2), np.float32)]),
        ({"kind": "drop", "round": 1, "pushes": []}, [np.zeros(0, np.int64), np.zeros((0, 2), np.float32)]),
        ({"kind": "init", "round": 0, "pushes": []}, [np.zeros(0, np.int64), np.zeros((3, 2), np.float32)]),
    ],
)  # fmt: skip
def test_a_malformed_replication_entry_changes_nothing_and_the_server_keeps_serving(server, header, tensors):
    cluster, sock = server
    before = cluster.ask_server(0, {"op": "stats"}).header["stats"]
    sock.send_multipart(
        wire.encode(cluster.secret, {"op": "rep", "shard": 0, "seq": 2, "epoch": 0, "from": 0, **header}, tensors)
    )
    _pull_works(cluster, sock)  # still serving, and the weights are still the initial ones
    after = cluster.ask_server(0, {"op": "stats"}).header["stats"]
    assert after["errors"] == before["errors"] + 1


# --- every header field is type-checked before use ------------------------------------------------------------


def _signed(header: dict, payload: list[bytes], secret: bytes = SECRET) -> list[bytes]:
    """Frames signed by ``secret`` whose header is exactly ``header`` (with a fresh send time and nonce unless it
    sets them), for headers that ``wire.encode`` would never write."""
    head = wire.msgpack.packb({"ts": time.time(), "nonce": int(time.time_ns()), **header}, use_bin_type=True)
    frames = [head, *payload]
    return [*frames, wire._mac(secret, frames)]


BAD_HEADERS = [
    ({"op": "pull", "t": [[["f4"], [1]]]}, [b"\0" * 4], "bad \\[dtype, shape\\]"),  # a list where the name goes
    ({"op": "pull", "t": [[{"f4": 1}, [1]]]}, [b"\0" * 4], "bad \\[dtype, shape\\]"),
    ({"op": "pull", "t": [["f4", [[1]]]]}, [b"\0" * 4], "bad shape"),
    ({"op": "pull", "t": [["f4", [1.0]]]}, [b"\0" * 4], "bad shape"),
    ({"op": "pull", "t": [["f4", [True]]]}, [b"\0" * 4], "bad shape"),
    ({"op": "pull", "t": [["f4", {"1": 1}]]}, [b"\0" * 4], "bad \\[dtype, shape\\]"),
    ({"op": "pull", "t": {"f4": [1]}}, [b"\0" * 4], "tensors"),
    ({"op": ["pull"], "t": []}, [], "str 'op'"),
    ({"op": "pull", "t": [], "ts": float("nan")}, [], "replay window"),
    ({"op": "pull", "t": [], "ts": [1.0]}, [], "send time"),
    ({"op": "pull", "t": [], "nonce": [1]}, [], "nonce"),
]


@pytest.mark.parametrize(("header", "payload", "reason"), BAD_HEADERS)
def test_a_header_field_of_the_wrong_type_is_a_wire_error(header, payload, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(SECRET, _signed(header, payload), guard=wire.ReplayGuard())


@pytest.mark.parametrize(("header", "payload", "reason"), BAD_HEADERS[:7])
def test_a_signed_wrongly_typed_header_is_dropped_and_the_server_keeps_serving(server, header, payload, reason):
    cluster, sock = server
    before = _rejected(cluster)
    sock.send_multipart(_signed(header, payload, cluster.secret))
    _pull_works(cluster, sock)
    assert cluster.procs["server0"].poll() is None
    assert _rejected(cluster) == before + 1


def test_an_endpoint_skips_a_wrongly_typed_message_and_takes_the_next():
    from dtrain.ps.transport import Endpoint

    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://peer")
        ep = Endpoint(ctx, "inproc://peer", SECRET, "peer")
        ep.send({"op": "hello"})
        ident = router.recv_multipart()[0]
        router.send_multipart([ident, *_signed({"op": "reply", "t": [[["f4"], [1]]]}, [b"\0" * 4])])
        router.send_multipart([ident, *wire.encode(SECRET, {"op": "reply", "req": 3})])
        assert ep.sock.poll(5_000)
        time.sleep(0.05)  # both are in
        assert ep.try_recv().header["req"] == 3
        assert ep.rejected == 1
    finally:
        ctx.destroy(linger=0)


# --- values, key counts and answer sizes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "tensors", "reason"),
    [
        ({"op": "push", "shard": 0, "worker": 0, "push_id": 0, "clock": 0},
         [np.array([1], np.int64), np.array([[np.nan, 0.0]], np.float32)], "values must be finite"),
        ({"op": "push", "shard": 0, "worker": 0, "push_id": 0, "clock": 0},
         [np.array([1, 2], np.int64), np.array([[1.0, 0.0], [0.0, -np.inf]], np.float32)], "values must be finite"),
        ({"op": "init", "shard": 0}, [np.full((8, 2), np.inf, np.float32)], "rows must be finite"),
        ({"op": "pull", "shard": 0, "worker": 0, "clock": 0}, [np.array([1, 3, 1], np.int64)], "must be distinct"),
        ({"op": "pull", "shard": 0, "worker": 0, "clock": 0}, [np.zeros(1000, np.int64)], "must be distinct"),
    ],
)  # fmt: skip
def test_non_finite_values_and_repeated_pull_keys_are_refused_and_nothing_changes(server, header, tensors, reason):
    cluster, sock = server
    sock.send_multipart(wire.encode(cluster.worker_secret, {**header, "req": 31}, tensors))
    assert sock.poll(10_000)
    reply = wire.decode(cluster.worker_secret, sock.recv_multipart())
    assert reply.header["status"] == "error" and reply.header["req"] == 31
    assert reason in reply.header["error"], reply.header["error"]
    _pull_works(cluster, sock)  # the rows are still the initial ones


def _bare_server(limits: wire.Limits | None = None):
    """A Server's message handling without its process: a ROUTER on inproc and a DEALER talking to it."""
    from dtrain.ps.hotkeys import HotCopies
    from dtrain.ps.server import Server

    server = Server.__new__(Server)
    server.secret, server.rank, server.limits = SECRET, 0, limits or wire.Limits()
    server.worker_key = wire.worker_key(SECRET)
    server.config = JobConfig(num_keys=8, width=2, num_servers=1, num_workers=1, mode="async")
    server.replicas, server.deferred, server.guard = {}, {}, wire.ReplayGuard()
    server.hot = HotCopies(server.config, 0, [], lambda *a: None)
    server.counts = {"rejected": 0, "errors": 0, "pulls": 0, "rows_served": 0, "pushes": 0}
    ctx = zmq.Context()
    server.router = ctx.socket(zmq.ROUTER)
    server.router.bind("inproc://server")
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://server")
    return ctx, server, client


def _handled(server, client, header: dict) -> wire.Message:
    client.send_multipart(wire.encode(server.worker_key, header))
    frames = server.router.recv_multipart()
    server.handle(frames[0], wire.decode((server.worker_key, SECRET), frames[1:]))
    assert client.poll(5_000), "no answer"
    return wire.decode(server.worker_key, client.recv_multipart())


def test_an_answer_over_the_message_size_is_an_error_answer_not_a_silence():
    ctx, server, client = _bare_server(wire.Limits(max_message_bytes=2000))
    try:
        server._dispatch = lambda op, h, tensors, reply: server._reply(reply, {"status": "ok"},
                                                                       [np.zeros((300, 2), np.float32)])  # fmt: skip
        reply = _handled(server, client, {"op": "stats", "req": 4})
        assert reply.header["req"] == 4 and reply.header["status"] == "error"
        assert "over the 2000 bytes a message may carry" in reply.header["error"]
    finally:
        ctx.destroy(linger=0)


def test_an_unexpected_failure_in_handling_a_request_is_answered_and_logged(capsys):
    ctx, server, client = _bare_server()
    try:

        def fails(op, h, tensors, reply):
            raise KeyError("something the checks did not foresee")

        server._dispatch = fails
        reply = _handled(server, client, {"op": "stats", "req": 5})
        assert reply.header["req"] == 5 and reply.header["status"] == "error"
        assert "KeyError" in reply.header["error"] and server.counts["errors"] == 1
        assert "server 0: answered with an error a 'stats' message: " in capsys.readouterr().err
    finally:
        ctx.destroy(linger=0)
