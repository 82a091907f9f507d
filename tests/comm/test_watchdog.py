"""The host watchdog of CUDA collectives (dtrain.comm.peer.watchdog), driven with fake events and a fake clock, and
the choice of transport that puts CUDA groups on the peer transport by default."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from dtrain.comm import api
from dtrain.comm.peer import watchdog
from dtrain.comm.peer import window as peer
from dtrain.comm.peer.watchdog import Watchdog
from dtrain.comm.state import group_state
from tests.jobs import peer as jobs


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dog(reserve: int = 2):
    clock, reports, made = _Clock(), [], []

    def make():
        made.append(_Event())
        return made[-1]

    dog = Watchdog(make, reports.append, clock, reserve=reserve)
    dog.top_up()
    return dog, clock, reports, made


def _watch(dog, label, limit=10.0):
    """Watch a call; the event it was given (None when unwatched)."""
    got = []
    return got[0] if dog.watch(label, limit, got.append) else None


def test_the_oldest_unfinished_call_is_reported_once_when_it_passes_the_limit():
    dog, clock, reports, _ = _dog()
    a = _watch(dog, "call A")
    clock.now = 1.0
    b = _watch(dog, lambda: "call B")
    clock.now = 9.9
    assert dog.check() is None and reports == []
    clock.now = 10.5
    assert "call A" in dog.check() and len(reports) == 1
    assert "channel k is the call's k-th barrier" in reports[0]
    clock.now = 30.0
    assert dog.check() is None and len(reports) == 1  # once per call
    a.done = True  # A finished after all: B is now the oldest, and it is late too
    assert "call B" in dog.check()
    b.done = True
    assert dog.check() is None and dog.pending() == 0


def test_finished_calls_give_their_events_back_and_the_reserve_is_kept_made():
    dog, _, reports, made = _dog()
    for _ in range(5):
        _watch(dog, "c").done = True
        dog.check()
    assert len(made) == 2 and dog.pending() == 0 and reports == []  # made ahead, then reused


def test_a_call_with_no_spare_event_goes_unwatched_and_the_next_watched_one_says_so():
    dog, clock, _, _ = _dog(reserve=2)
    a, b = _watch(dog, "a", 1.0), _watch(dog, "b", 1.0)
    assert _watch(dog, "c", 1.0) is None and dog.skipped == 1  # both spares in use
    a.done = True
    dog.check()  # a's event back, and the reserve made again
    d = _watch(dog, "d", 1.0)
    assert d is not None and dog.skipped == 0
    b.done = True
    clock.now = 5.0
    assert "d (or one of the 1 calls enqueued just before it" in dog.check()


def test_no_event_is_queried_while_a_graph_is_captured():
    dog, clock, reports, _ = _dog()
    _watch(dog, "a", 1.0)
    clock.now = 5.0
    with watchdog.capturing():  # a query now would invalidate a global-mode capture
        assert dog.check() is None and reports == []
    assert "a" in dog.check()


def test_at_most_max_pending_calls_are_watched(monkeypatch):
    monkeypatch.setattr(watchdog, "MAX_PENDING", 2)
    dog, _, _, _ = _dog(reserve=5)
    assert _watch(dog, "a", 1.0) and _watch(dog, "b", 1.0)
    assert _watch(dog, "c", 1.0) is None  # the oldest is the one a stall would hold
    assert dog.skipped == 1


class _Group:
    """Something a weak dictionary can hold, standing in for a process group."""


def test_auto_puts_cuda_groups_on_the_peer_transport_unless_the_timeout_or_a_fallback_says_otherwise(monkeypatch):
    monkeypatch.delenv("DTRAIN_COMM_TRANSPORT", raising=False)
    monkeypatch.delenv("DTRAIN_COMM_TIMEOUT", raising=False)
    group, cuda = _Group(), torch.device("cuda", 0)
    monkeypatch.setattr(peer, "peer_available", lambda g, d: True)
    monkeypatch.setattr(peer, "_torch_version", lambda: (2, 11))
    assert api.transport_name(group, cuda) == "peer"
    assert api.transport_name(group, torch.device("cpu")) == "p2p"
    monkeypatch.setattr(peer, "_torch_version", lambda: (2, 10))
    assert api.transport_name(group, cuda) == "p2p"  # not measured there
    monkeypatch.setattr(peer, "_torch_version", lambda: (2, 13))
    monkeypatch.setenv("DTRAIN_COMM_TIMEOUT", "5")
    assert api.transport_name(group, cuda) == "p2p"  # the debugging mode: rounds wait on the host
    monkeypatch.delenv("DTRAIN_COMM_TIMEOUT")
    group_state(group).fell_back = True
    assert api.transport_name(group, cuda) == "p2p"
    monkeypatch.setenv("DTRAIN_COMM_TRANSPORT", "peer")
    assert api.transport_name(group, cuda) == "peer"  # asked for by name
    monkeypatch.setenv("DTRAIN_COMM_TRANSPORT", "fast")
    with pytest.raises(ValueError, match="DTRAIN_COMM_TRANSPORT"):
        api.transport_name(group, cuda)


def test_a_group_whose_window_is_refused_falls_back_to_point_to_point_on_every_rank(pool):
    answers = pool.run(jobs.auto_falls_back_when_a_window_is_refused, ranks=3)
    assert answers == [{"before": "peer", "after": "p2p", "right": True, "warned": True}] * 3, answers


def test_a_group_forgetting_its_windows_leaves_the_larger_groups_windows_alike_on_their_ranks(pool):
    """Ranks 0-2 forget their group's windows; the 4-rank group, which also holds rank 3, must keep its window and
    its answer to peer_available on all four alike, or its next call would set up on three ranks only (a hang)."""
    assert pool.run(jobs.check_collective, "all_reduce", "ring", 4, [5], ranks=4) == [[]] * 4
    pool.run(jobs.auto_falls_back_when_a_window_is_refused, ranks=3)
    assert pool.run(jobs.check_collective, "all_reduce", "ring", 4, [5, 1 << 16], ranks=4) == [[]] * 4


class _WhoStore:
    """The store calls a heartbeat's peer lookup makes, in memory."""

    def __init__(self, who: dict[int, bytes]) -> None:
        self.data = {f"dtrain/heartbeat/who/{r}": v for r, v in who.items()}

    def check(self, keys) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key) -> bytes:
        return self.data[key]

    def add(self, key, n) -> int:
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]


def test_a_peers_registration_is_used_only_as_a_host_name_and_a_process_id():
    from dtrain.comm.peer.watchdog import Heartbeat, Peer, parse_who

    assert parse_who(b"node-7.cluster:4242") == ("node-7.cluster", 4242)
    for bad in (b"vm:-12", b"vm:0", b"vm:99999999", b"vm:+12", b"vm: 12", b"v m:12", b"vm\n:12", b":12", b"vm:", b"vm"):
        assert parse_who(bad) is None, bad
    host = socket.gethostname()
    store = _WhoStore({1: f"{host}:-{os.getpid()}".encode(), 2: b"evil\nrank 7 is gone:12", 3: f"{host}:7".encode()})
    beat = Heartbeat(store, 0, 4)
    assert [beat.peer(r) for r in (1, 2, 3)] == [Peer(1), Peer(2), Peer(3, host, 7)]
    assert [p.rank for p in beat.gone(wait=0.01)] in ([3], [1, 2, 3])  # pid 7 may run here; nothing else is looked up
