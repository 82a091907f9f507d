"""What servers send each other, under attack from a holder of the worker key or a malformed message: replication
entries and chain acknowledgements are taken only from servers and only when they fit the receiver's state; a
refused message changes no replica, and the replicas of a shard stay identical."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import zmq

from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.consistency import MAX_AHEAD, MAX_WAITING
from dtrain.ps.launch import LocalCluster

# 2 servers, each shard on both: shard 0 (keys 0..3) is led by server 0, shard 1 (keys 4..7) by server 1.
# ssp with staleness 0 and 2 workers of which only worker 0 pushes: a pull of worker 1 at clock 1 waits for good.
CONFIG = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=2, mode="ssp", staleness=0, replicas=2,
                   replication="chain", momentum=0.9, dead_after_s=30.0, heartbeat_s=0.05)  # fmt: skip


class Peers:
    """The cluster and a DEALER to each server."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster, self.ctx = cluster, zmq.Context()
        self.socks = []
        for rank in range(2):
            sock = wire.configure_socket(self.ctx.socket(zmq.DEALER))
            sock.connect(cluster.server_address(rank))
            self.socks.append(sock)
        self.req = 100

    def send(self, server: int, header: dict, tensors: list = (), key: bytes | None = None) -> None:
        self.socks[server].send_multipart(wire.encode(key or self.cluster.secret, header, tensors))

    def ask(self, server: int, header: dict, tensors: list = (), key: bytes | None = None,
            wait_s: float = 10.0) -> dict | None:  # fmt: skip
        """A request as a worker sends it (with the worker key unless ``key``); the reply's header, or None."""
        self.req += 1
        key = key or self.cluster.worker_secret
        self.send(server, {**header, "req": self.req}, tensors, key)
        if not self.socks[server].poll(int(wait_s * 1000)):
            return None
        reply = wire.decode(key, self.socks[server].recv_multipart())
        assert reply.header["req"] == self.req
        return reply.header

    def dump(self, server: int, shard: int) -> tuple[int, dict[str, np.ndarray]]:
        msg = self.cluster.ask_server(server, {"op": "dump", "shard": shard})
        return msg.header["seq"], {n: np.array(t) for n, t in zip(msg.header["names"], msg.tensors, strict=True)}

    def errors(self, server: int) -> int:
        """The server's error count, asked on the socket the test's messages went out on: so after them."""
        return self.ask(server, {"op": "stats"}, key=self.cluster.secret)["stats"]["errors"]

    def assert_replicas_equal(self, shard: int) -> int:
        """Both replicas of ``shard`` hold the same arrays (after the head's last acknowledged entry); its seq."""
        (seq0, a), (seq1, b) = self.dump(0, shard), self.dump(1, shard)
        assert seq0 == seq1, (seq0, seq1)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"shard {shard} {name}")
        return seq0


def _keys(*k: int) -> np.ndarray:
    return np.array(k, np.int64)


def _grads(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, 2), value, np.float32)


@pytest.fixture(scope="module")
def peers():
    """Shard 0 initialised to ones; shard 1 left uninitialised."""
    with LocalCluster(CONFIG) as cluster:
        p = Peers(cluster)
        try:
            assert p.ask(0, {"op": "init", "shard": 0}, [np.ones((4, 2), np.float32)])["status"] == "applied"
            yield p
        finally:
            p.ctx.destroy(linger=0)


def _push(p: Peers, push_id: int, clock: int = 0, **kw) -> dict | None:
    header = {"op": "push", "shard": 0, "worker": 0, "push_id": push_id, "clock": clock}
    return p.ask(0, header, [_keys(1), _grads(1)], **kw)


@pytest.mark.parametrize("clock", [2**63 - 1, 2**62, MAX_AHEAD + 1])
def test_a_push_with_a_clock_past_the_bound_is_refused_and_changes_no_replica(peers, clock):
    p = peers
    seq = p.assert_replicas_equal(0)
    before = p.dump(0, 0)[1]["weights"]
    reply = _push(p, push_id=10**6, clock=clock)
    assert reply["status"] == "error" and reply["code"] == "bad_request", reply
    assert "clock" in reply["error"]
    assert p.assert_replicas_equal(0) == seq
    np.testing.assert_array_equal(p.dump(0, 0)[1]["weights"], before)


def test_a_step_entry_before_init_is_refused_and_the_shard_still_initialises_on_every_replica(peers):
    p = peers
    errors = p.errors(0)
    # server 0 follows shard 1; the entry is signed with the job's secret, as a server's would be
    p.send(0, {"op": "rep", "shard": 1, "seq": 1, "kind": "step", "round": 1, "pushes": [[0, 0, 0]], "epoch": 0,
               "from": 1}, [_keys(4, 6), _grads(2)])  # fmt: skip
    assert p.errors(0) == errors + 1
    reply = p.ask(0, {"op": "dump", "shard": 1}, key=p.cluster.secret)
    assert reply["status"] == "error" and "not initialised yet" in reply["error"]
    assert p.ask(1, {"op": "init", "shard": 1}, [np.full((4, 2), 2.0, np.float32)])["status"] == "applied"
    assert p.assert_replicas_equal(1) == 1
    push = {"op": "push", "shard": 1, "worker": 0, "push_id": 0, "clock": 0}
    assert p.ask(1, push, [_keys(5), _grads(1)], wait_s=5.0)["status"] == "applied"
    assert p.assert_replicas_equal(1) == 2


@pytest.mark.parametrize(
    ("op", "header", "tensors"),
    [
        ("rep", {"shard": 0, "kind": "step", "round": 1, "pushes": [[0, 9, 0]]}, [_keys(2), _grads(1, 100.0)]),
        ("rep", {"shard": 0, "kind": "step", "round": 1, "pushes": []}, [_keys(2), _grads(1, np.nan)]),
    ],
)
def test_a_replication_entry_from_a_worker_or_with_non_finite_values_changes_no_replica(peers, op, header, tensors):
    p = peers
    seq = p.assert_replicas_equal(0)
    errors = p.errors(1)
    # server 1 follows shard 0: an entry that it would apply next, were it from a server and well formed
    key = p.cluster.worker_secret if not np.isnan(tensors[1]).any() else p.cluster.secret
    p.send(1, {"op": op, "seq": seq + 1, "epoch": 0, "from": 0, **header}, tensors, key=key)
    assert p.errors(1) == errors + 1
    assert p.assert_replicas_equal(0) == seq


def test_a_chain_ack_from_a_worker_or_for_an_entry_never_sent_acknowledges_nothing(peers):
    p = peers
    seq = p.assert_replicas_equal(0)
    tail = p.cluster.procs["server1"].pid
    os.kill(tail, signal.SIGSTOP)
    try:
        header = {"op": "push", "shard": 0, "worker": 0, "push_id": 1, "clock": 0, "req": 7}
        p.send(0, header, [_keys(2), _grads(1)], key=p.cluster.worker_secret)
        assert not p.socks[0].poll(300), "acknowledged before the tail had it"
        errors = p.errors(0)
        # from a worker, even for the entry the head did send; from a server, for one it never sent
        p.send(0, {"op": "chain_ack", "shard": 0, "seq": seq + 1, "epoch": 0, "from": 1}, key=p.cluster.worker_secret)
        p.send(0, {"op": "chain_ack", "shard": 0, "seq": 10**9, "epoch": 0, "from": 1})
        assert not p.socks[0].poll(300), "a forged chain_ack released the acknowledgement"
        assert p.errors(0) == errors + 2
    finally:
        os.kill(tail, signal.SIGCONT)
    assert p.socks[0].poll(10_000)
    reply = wire.decode(p.cluster.worker_secret, p.socks[0].recv_multipart())
    assert reply.header["req"] == 7 and reply.header["status"] == "applied"
    assert p.assert_replicas_equal(0) == seq + 1


def test_a_pull_too_far_ahead_or_one_too_many_waiting_is_refused_at_once(peers):
    p = peers
    far = p.ask(0, {"op": "pull", "shard": 0, "worker": 1, "clock": MAX_AHEAD + 1}, [_keys(1)], wait_s=5.0)
    assert far["status"] == "error" and f"more than {MAX_AHEAD} past what the shard can answer" in far["error"]
    ctx = zmq.Context()  # pulls that wait for good go out on a socket of their own, closed after
    try:
        sock = wire.configure_socket(ctx.socket(zmq.DEALER))
        sock.connect(p.cluster.server_address(0))
        for req in range(MAX_WAITING + 1):
            sock.send_multipart(wire.encode(p.cluster.worker_secret, {"op": "pull", "shard": 0, "worker": 1,
                                                                      "clock": 1, "req": req}, [_keys(1)]))  # fmt: skip
        assert sock.poll(5_000)
        reply = wire.decode(p.cluster.worker_secret, sock.recv_multipart())
        assert reply.header["req"] == MAX_WAITING and reply.header["status"] == "error"
        assert f"worker 1 has {MAX_WAITING} pulls waiting already" in reply.header["error"]
    finally:
        ctx.destroy(linger=0)
    ok = p.ask(0, {"op": "pull", "shard": 0, "worker": 0, "clock": 0}, [_keys(3, 0)])  # others are still answered
    assert ok["status"] == "ok"


def test_the_coordinator_takes_no_stop_heartbeat_or_server_registration_signed_with_the_worker_key(peers):
    p = peers
    ctx = zmq.Context()
    try:
        sock = wire.configure_socket(ctx.socket(zmq.DEALER))
        sock.connect(p.cluster.coordinator)
        key = p.cluster.worker_secret
        for header in ({"op": "register", "role": "server", "rank": 1, "endpoint": "tcp://127.0.0.1:9"},
                       {"op": "hb", "rank": 0}, {"op": "stop", "req": 1}):  # fmt: skip
            sock.send_multipart(wire.encode(key, header))
        sock.send_multipart(wire.encode(key, {"op": "layout?", "req": 2}))  # read-only: answered
        assert sock.poll(10_000)
        reply = wire.decode(key, sock.recv_multipart())
        assert reply.header["req"] == 2, reply.header  # no answer to the stop: it was refused
        assert reply.header["layout"]["endpoints"][1] == p.cluster.server_address(1)
    finally:
        ctx.destroy(linger=0)
    assert p.cluster.procs["coordinator"].poll() is None
