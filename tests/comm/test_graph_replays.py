"""Persistent collectives: eager the first time, captured on the second sighting, replayed after; bounded."""

from __future__ import annotations

import pytest
import torch

from dtrain.comm import state
from dtrain.comm.peer import graphs as persistent
from dtrain.comm.state import group_state

CPU = torch.device("cpu")
CACHE = persistent.GraphCache()


class FakeGraph:
    """Stands in for a captured CUDA graph: replaying it runs the recorded call."""

    def __init__(self, call, log):
        self.call, self.log, self.released = call, log, False
        log.append("capture")

    def __call__(self):
        assert not self.released
        self.log.append("replay")
        self.call()

    def release(self):
        self.released = True


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    global CACHE
    monkeypatch.setenv("DTRAIN_COMM_PERSISTENT", "1")
    CACHE = persistent.GraphCache()  # one group's graphs
    yield
    CACHE.release_all()


def _runner(log):
    def capture(call, device):
        return FakeGraph(call, log)

    return lambda key: CACHE.run(key, lambda: log.append(f"eager {key}"), CPU, capture=capture)


def test_the_first_call_runs_eagerly_the_second_is_captured_and_replayed_and_later_ones_replay():
    log = []
    run = _runner(log)
    run("a")
    run("a")
    run("a")
    assert log == ["eager a", "capture", "replay", "eager a", "replay", "eager a"]
    assert CACHE.held() == 1


def test_a_capture_runs_the_call_exactly_once_per_call():
    # capturing records without running: every call still runs the collective once, so ranks that capture
    # at different calls meet at the same barriers
    log = []
    run = _runner(log)
    for _ in range(5):
        run("k")
    assert log.count("eager k") == 5


def test_nothing_is_captured_when_turned_off(monkeypatch):
    monkeypatch.setenv("DTRAIN_COMM_PERSISTENT", "0")
    log = []
    run = _runner(log)
    for _ in range(3):
        run("a")
    assert log == ["eager a"] * 3 and CACHE.held() == 0


def test_the_least_recently_replayed_graph_goes_when_too_many_are_held(monkeypatch):
    monkeypatch.setattr(persistent, "MAX_GRAPHS", 2)
    graphs = []

    def capture(call, device):
        graphs.append(FakeGraph(call, []))
        return graphs[-1]

    for key in ("a", "b", "a", "c"):
        CACHE.run(key, lambda: None, CPU, capture=capture)
        CACHE.run(key, lambda: None, CPU, capture=capture)
    assert CACHE.held() == 2
    assert [g.released for g in graphs] == [False, True, False]  # a (replayed last) stays, b goes


def test_release_all_drops_every_graph_and_sighting():
    log = []
    run = _runner(log)
    run("a")
    run("a")
    CACHE.release_all()
    assert CACHE.held() == 0
    run("a")  # seen afresh: eager again
    assert log[-1] == "eager a"


def test_inside_another_capture_a_held_graph_is_not_replayed_the_call_is_recorded_plainly(monkeypatch):
    log = []
    gpu = torch.device("cuda")

    def capture(call, device):
        return FakeGraph(call, log)

    def run():
        CACHE.run("k", lambda: log.append("eager"), gpu, capture=capture)

    monkeypatch.setattr(persistent.torch.cuda, "is_current_stream_capturing", lambda: False)
    run()
    run()  # captured and replayed: a graph is held now
    monkeypatch.setattr(persistent.torch.cuda, "is_current_stream_capturing", lambda: True)
    log.clear()
    run()
    assert log == ["eager"]


def _owned_runner(log):
    def capture(call, device):
        return FakeGraph(call, log)

    return lambda key, owner: CACHE.run(key, lambda: log.append("eager"), CPU, owner=owner, capture=capture)


def test_a_graph_is_replayed_for_its_own_storage_and_for_views_of_it():
    log = []
    run = _owned_runner(log)
    buf = torch.zeros(64)
    run("k", buf)
    run("k", buf[:])  # a view of the same storage: the same call, captured now
    run("k", buf.view(8, 8).view(-1))
    assert log == ["eager", "capture", "replay", "eager", "replay", "eager"]


def test_a_new_buffer_at_the_address_of_a_freed_one_never_replays_the_old_graph():
    # the bench's sweep frees a case's buffer and makes the next at the same address: replaying the freed
    # buffer's graph on it faulted on 4 H200s; the graph belongs to the storage, so the new buffer starts afresh
    log = []
    run = _owned_runner(log)
    first = torch.zeros(1 << 16)
    run("k", first)
    run("k", first)
    assert CACHE.held() == 1
    address = first.data_ptr()
    del first
    second = torch.zeros(1 << 16)
    log.clear()
    run("k", second)
    run("k", second)
    run("k", second)
    assert log == ["eager", "capture", "replay", "eager", "replay", "eager"], (address, second.data_ptr())
    assert CACHE.held() == 1  # the dead storage's graph was released when the new one was captured


def test_a_live_buffer_of_the_same_size_elsewhere_gets_its_own_graph():
    log = []
    run = _owned_runner(log)
    a, b = torch.zeros(32), torch.zeros(32)
    for buf in (a, a, b, b):
        run("k", buf)
    assert log.count("capture") == 2 and CACHE.held() == 2


def test_a_loop_that_only_replays_still_releases_the_graphs_of_freed_buffers(monkeypatch):
    monkeypatch.setattr(persistent, "SWEEP_EVERY", 4)
    log = []
    run = _owned_runner(log)
    gone, kept = torch.zeros(16), torch.zeros(16)
    run("a", gone)
    run("a", gone)
    run("b", kept)
    run("b", kept)
    assert CACHE.held() == 2
    del gone
    for _ in range(4):  # replays of "b" only: nothing new is captured
        run("b", kept)
    assert CACHE.held() == 1


def test_replays_are_on_by_default_and_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.delenv("DTRAIN_COMM_PERSISTENT")
    assert persistent.enabled()
    monkeypatch.setenv("DTRAIN_COMM_PERSISTENT", "yes")
    with pytest.raises(ValueError, match="DTRAIN_COMM_PERSISTENT"):
        persistent.enabled()


class _Group:
    """Stands in for a process group (the registry keys state by the group object)."""


def test_each_group_keeps_its_own_graphs_and_releasing_a_group_drops_only_its_own():
    log, made = [], []

    def capture(call, device):
        made.append(FakeGraph(call, log))
        return made[-1]

    a, b = _Group(), _Group()
    for group in (a, a, b, b):
        persistent.run(group, "k", lambda: log.append("eager"), CPU, capture=capture)
    assert group_state(a).graphs.held() == 1 and group_state(b).graphs.held() == 1
    state.release(a)
    assert made[0].released and not made[1].released
    assert group_state(a).graphs is None and group_state(b).graphs.held() == 1
    persistent.run(b, "k", lambda: log.append("eager"), CPU, capture=capture)
    assert log[-2:] == ["replay", "eager"]
    state.release(b)
    assert made[1].released


def test_a_group_state_is_made_on_first_use_found_after_and_gone_once_released():
    group = _Group()
    assert state.find_state(group) is None
    held = group_state(group)
    held.fell_back, held.local_size = True, 4
    assert state.find_state(group) is held and group_state(group) is held
    state.release(group)
    assert state.find_state(group) is None and not group_state(group).fell_back


def test_without_a_default_group_questions_find_no_state_and_nothing_is_made(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    assert state.find_state(None) is None
    with pytest.raises(ValueError, match="init_process_group"):
        group_state(None)
