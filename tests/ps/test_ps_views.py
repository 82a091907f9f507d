"""Changes of view (a server declared dead): whatever the dead server had sent to whom, the replicas of a shard
end identical, and a server no longer in the view changes no replica."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import zmq

from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster


class Client:
    """A DEALER to each server of a cluster, speaking as worker 0 (or, with ``key``, as a server would)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster, self.ctx = cluster, zmq.Context()
        self.socks = {}
        for rank in range(cluster.config.num_servers):
            sock = wire.configure_socket(self.ctx.socket(zmq.DEALER))
            sock.connect(cluster.server_address(rank))
            self.socks[rank] = sock
        self.req = 0

    def send(self, server: int, header: dict, tensors: list = (), key: bytes | None = None) -> int:
        self.req += 1
        key = key or self.cluster.worker_secret
        self.socks[server].send_multipart(wire.encode(key, {**header, "req": self.req}, tensors))
        return self.req

    def reply(self, server: int, req: int, key: bytes | None = None, wait_s: float = 10.0) -> dict:
        key = key or self.cluster.worker_secret
        deadline = time.monotonic() + wait_s
        while self.socks[server].poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = wire.decode(key, self.socks[server].recv_multipart())
            if msg.header["req"] == req:
                return msg.header
        raise AssertionError(f"no reply from server {server} to request {req} within {wait_s} s")

    def ask(self, server: int, header: dict, tensors: list = (), key: bytes | None = None) -> dict:
        return self.reply(server, self.send(server, header, tensors, key), key)

    def push(self, server: int, push_id: int, key: int, grad: float) -> int:
        header = {"op": "push", "shard": 0, "worker": 0, "push_id": push_id, "clock": 0}
        return self.send(server, header, [np.array([key], np.int64), np.full((1, 2), grad, np.float32)])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _replica(cluster: LocalCluster, server: int, shard: int) -> tuple[int, dict[str, np.ndarray]] | None:
    """``(seq, arrays)`` of a server's replica of ``shard``, or ``None`` while it is not initialised there."""
    msg = cluster.ask_server(server, {"op": "dump", "shard": shard})
    if msg.header["status"] != "ok":
        return None
    return msg.header["seq"], {n: np.array(t) for n, t in zip(msg.header["names"], msg.tensors, strict=True)}


def _wait_for(condition, what: str, wait_s: float = 10.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {wait_s} s")


def _wait_for_chain(cluster: LocalCluster, shard: int, chain: list[int]) -> None:
    _wait_for(lambda: cluster.layout()["chains"][shard] == chain, f"shard {shard} on chain {chain}")


def _equal(a, b) -> bool:
    return a is not None and b is not None and a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


def test_primary_backup_followers_end_equal_when_the_leader_dies_between_its_sends():
    """The leader ships a batch to one follower and dies before the other gets it: the promoted follower's state
    reaches the other follower too, rather than its later entries alone (which that one could never apply)."""
    job = JobConfig(num_keys=12, width=2, num_servers=3, num_workers=1, mode="async", lr=1.0, replicas=3,
                    replication="primary_backup", dead_after_s=1.5, timeout_s=10.0)  # fmt: skip
    with LocalCluster(job) as cluster:
        client = Client(cluster)
        follower = cluster.procs["server2"].pid
        try:
            # server 2 stopped before the leader ever connects to it: what the leader ships it waits in the
            # leader's own queue, and is gone with the leader
            os.kill(follower, signal.SIGSTOP)
            try:
                init = client.ask(0, {"op": "init", "shard": 0}, [np.ones((4, 2), np.float32)])
                assert init["status"] == "applied"
                assert client.reply(0, client.push(0, 0, 1, 0.5))["status"] == "applied"
                _wait_for(lambda: (_replica(cluster, 1, 0) or (0,))[0] == 2, "server 1 holding both entries")
                cluster.kill("server0")
            finally:
                os.kill(follower, signal.SIGCONT)
            _wait_for_chain(cluster, 0, [1, 2])
            assert client.reply(1, client.push(1, 1, 2, 0.25))["status"] == "applied"
            _wait_for(lambda: _equal(_replica(cluster, 1, 0), _replica(cluster, 2, 0)), "replicas 1 and 2 equal")
            seq, arrays = _replica(cluster, 2, 0)
            assert seq == 3
            want = np.ones((4, 2), np.float32)
            want[1] -= 0.5
            want[2] -= 0.25
            np.testing.assert_array_equal(arrays["weights"], want)
        finally:
            client.close()


def test_a_server_declared_dead_while_alive_changes_no_replica_of_the_new_view():
    """The head of a chain pauses past ``dead_after_s`` with two pushes waiting; its follower leads, and takes
    the second push resent. When the old head runs again it turns both into entries and forwards them: the new
    head refuses them (their sender is not in its view), so no gradient is applied twice."""
    job = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=1, mode="async", lr=1.0, replicas=2,
                    replication="chain", dead_after_s=1.0, timeout_s=10.0)  # fmt: skip
    with LocalCluster(job) as cluster:
        client = Client(cluster)
        old_head = cluster.procs["server0"].pid
        try:
            assert client.ask(0, {"op": "init", "shard": 0}, [np.zeros((4, 2), np.float32)])["status"] == "applied"
            os.kill(old_head, signal.SIGSTOP)
            try:
                client.push(0, 0, 1, 1.0)  # push A: waits in the paused head's queue
                client.push(0, 1, 2, 10.0)  # push B
                _wait_for_chain(cluster, 0, [1])
                assert client.reply(1, client.push(1, 1, 2, 10.0))["status"] == "applied"  # B, resent
                errors = client.ask(1, {"op": "stats"}, key=cluster.secret)["stats"]["errors"]
            finally:
                os.kill(old_head, signal.SIGCONT)
            # answered after A and B (one socket keeps its order): by then the old head has sent on its entries
            assert client.ask(0, {"op": "stats"}, key=cluster.secret)["status"] == "ok"

            def taken_or_refused():
                stats = client.ask(1, {"op": "stats"}, key=cluster.secret)["stats"]
                return stats["shards"]["0"]["seq"] != 2 or stats["errors"] >= errors + 2

            _wait_for(taken_or_refused, "server 0's entries reaching server 1")
            assert client.reply(1, client.push(1, 0, 1, 1.0))["status"] == "applied"  # A, resent
            seq, arrays = _replica(cluster, 1, 0)
            want = np.zeros((4, 2), np.float32)
            want[1] -= 1.0
            want[2] -= 10.0
            np.testing.assert_array_equal(arrays["weights"], want)
            assert arrays["applied"].tolist() == [2] and seq == 3
        finally:
            client.close()


def _state(config: JobConfig, steps: list[tuple[int, float, list[int]]]):
    from dtrain.ps.keys import KeyRange
    from dtrain.ps.shard import Entry, ShardState

    state = ShardState(config, 0, KeyRange(0, 4))
    state.apply(Entry(1, "init", 0, np.zeros(0, np.int64), np.ones((4, 2), np.float32), []))
    for seq, (key, grad, push) in enumerate(steps, start=2):
        state.apply(Entry(seq, "step", seq - 1, np.array([key], np.int64), np.full((1, 2), grad, np.float32), [push]))
    return state


def test_a_leaders_state_replaces_a_followers_whole_and_a_malformed_one_changes_nothing():
    """What a new primary_backup leader sends its followers: every array, the sequence number, and which pushes
    are held (so a push resent to the new leader is recognised on every replica alike)."""
    from dataclasses import replace

    from dtrain.ps import messages
    from dtrain.ps.shard import EntryError

    config = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=2, optimizer="adam", replicas=2,
                       replication="primary_backup")  # fmt: skip
    leader = _state(config, [(1, 0.5, [0, 0, 0]), (2, 0.25, [1, 3, 0]), (3, 2.0, [0, 1, 1])])
    follower = _state(config, [(1, 0.5, [0, 0, 0]), (0, 9.0, [1, 0, 0])])  # one entry that the leader never had
    snap = leader.snapshot()
    messages.check(messages.SERVER, "state", {**snap.header(0), "epoch": 1, "from": 1}, snap.tensors(), config, rank=0)
    before = {name: a.copy() for name, a in follower.arrays().items()}
    bad = [
        (replace(snap, weights=snap.weights[:2]), r"weights must be float32 \(4, 2\)"),
        (replace(snap, optimizer_rows=np.where(snap.optimizer_rows > 0, np.nan, 0).astype(np.float32)), "finite"),
        (replace(snap, pushes_above=np.array([[0, 1]], np.int64)), "above their worker's last push"),
        (replace(snap, progress=snap.progress - 5), "out of"),
    ]
    for malformed, reason in bad:
        with pytest.raises(EntryError, match=reason):
            follower.restore(malformed)
        assert follower.seq == 3
        for name, a in follower.arrays().items():
            np.testing.assert_array_equal(a, before[name], err_msg=name)
    follower.restore(snap)
    assert (follower.seq, follower.round) == (leader.seq, leader.round) == (4, 3)
    for name, a in leader.arrays().items():
        np.testing.assert_array_equal(follower.arrays()[name], a, err_msg=name)
    assert follower.holds_push(1, 3) and not follower.holds_push(1, 0) and follower.holds_push(0, 1)
    chain = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=2, replicas=2)
    with pytest.raises(messages.MessageError, match="only with replication=primary_backup, not chain"):
        messages.check(messages.SERVER, "state", {**snap.header(0), "epoch": 1, "from": 1}, snap.tensors(), chain)
