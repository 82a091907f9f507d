"""Pipeline timelines on the device clock: CUDA event pairs turned into a step's times (fakes with
``elapsed_time`` stand in for ``torch.cuda.Event``; no GPU here), the bubble, trace and Gantt chart read from them,
and the pipeline's wiring of the clock, with a stand-in clock on Gloo processes."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.parallel.pipeline_parallel_communications import DeviceClock
from dtrain.parallel.pipeline_schedules import (
    Timeline,
    TimelineEvent,
    apply_device_times,
    bubble_fraction,
    theoretical_bubble,
    timelines_clock,
)
from dtrain.train.trace import chrome_trace, write_gantt
from tests.jobs import pipeline as pipeline_jobs


class Marker:
    """A completed ``torch.cuda.Event`` stand-in: a time in milliseconds on one device's clock."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: Marker) -> float:
        return end.ms - self.ms


# GPipe, p = 2, m = 2, on the device: F 1 ms, B 2 ms; stage 1 waits 1 ms for its first input and stage 0 for its
# first gradient until stage 1's B0 is done. (kind, microbatch, start ms, end ms) since the step's start.
DEVICE = {
    0: [
        ("F", 0, 0, 1), ("send_forward", 0, 1, 1), ("F", 1, 1, 2), ("send_forward", 1, 2, 2),
        ("recv_backward", 0, 2, 5), ("B", 0, 5, 7), ("recv_backward", 1, 7, 7), ("B", 1, 7, 9),
    ],
    1: [
        ("recv_forward", 0, 0, 1), ("F", 0, 1, 2), ("recv_forward", 1, 2, 2), ("F", 1, 2, 3),
        ("B", 0, 3, 5), ("send_backward", 0, 5, 5), ("B", 1, 5, 7), ("send_backward", 1, 7, 7),
    ],
}  # fmt: skip
DEVICE_END_MS = {0: 9.0, 1: 7.0}
HOST_START_S = 100.0  # both ranks' host clocks read this as their streams began the step
EPOCH_MS = {0: 5_000.0, 1: 123.0}  # each device's clock starts elsewhere: only differences count


def _host_timeline(stage: int) -> tuple[Timeline, list[TimelineEvent]]:
    """The step as the host saw it: each action's call blocked until the device had room for its kernels, so the
    calls tile the whole step (a host bubble of 0), and one more send whose device interval was never marked."""
    timeline = Timeline(stage=stage, num_stages=2, num_microbatches=2, start_s=HOST_START_S)
    events, at = [], HOST_START_S
    for kind, mb, _, _ in DEVICE[stage]:
        took = 9e-3 / 4 if kind in ("F", "B") else 0.0  # the four actions' calls take the 9 ms, messages none
        event = TimelineEvent(kind, mb, at, at + took)
        at += took
        timeline.events.append(event)
        events.append(event)
    timeline.events.append(TimelineEvent("send_forward", 9, HOST_START_S, HOST_START_S + 9e-3))
    timeline.end_s = HOST_START_S + 9e-3
    return timeline, events


def _device_timeline(stage: int) -> Timeline:
    timeline, events = _host_timeline(stage)
    epoch = EPOCH_MS[stage]
    intervals = [
        (event, Marker(epoch + start), Marker(epoch + end))
        for event, (_, _, start, end) in zip(events, DEVICE[stage], strict=True)
    ]
    return apply_device_times(timeline, Marker(epoch), Marker(epoch + DEVICE_END_MS[stage]), intervals)


def test_device_times_replace_the_host_times_and_give_the_bubble_the_device_ran():
    host = [_host_timeline(s)[0] for s in (0, 1)]
    assert bubble_fraction(host) == pytest.approx(0.0, abs=1e-9)  # the host clock sees no bubble at all
    device = [_device_timeline(s) for s in (0, 1)]
    assert timelines_clock(device) == "device" and timelines_clock(host) == "host"
    # busy 6 ms of a 9 ms step on each stage: 1 - 12 / 18, GPipe's (p - 1) / (m + p - 1)
    assert bubble_fraction(device) == pytest.approx(1 / 3)
    assert bubble_fraction(device) == pytest.approx(theoretical_bubble(2, 2))
    for stage, timeline in enumerate(device):
        assert timeline.start_s == HOST_START_S
        assert timeline.end_s == pytest.approx(HOST_START_S + DEVICE_END_MS[stage] / 1e3)
        got = [(r["kind"], r["microbatch"], r["start_s"] * 1e3, r["end_s"] * 1e3) for r in timeline.as_records()]
        assert got == [pytest.approx(e) for e in DEVICE[stage]]  # the unmarked send is dropped
        assert timeline.busy_s() == pytest.approx(6e-3)


def test_the_bubble_needs_timelines_on_one_clock_with_action_times():
    device = [_device_timeline(s) for s in (0, 1)]
    mixed = [device[0], _host_timeline(1)[0]]
    replayed = Timeline(stage=0, num_stages=2, num_microbatches=2, end_s=1.0, clock="none")
    assert timelines_clock(mixed) == "none" and timelines_clock([replayed, replayed]) == "none"
    for timelines in (mixed, [replayed]):
        with pytest.raises(ValueError, match="one clock"):
            bubble_fraction(timelines)


def test_the_device_clock_drains_the_stream_marks_on_it_and_reads_its_events_once(monkeypatch):
    now = {"ms": 40.0}
    drained, recorded, synchronized = [], [], []

    class Stream:
        def synchronize(self) -> None:
            drained.append(now["ms"])

    class Event(Marker):
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            super().__init__(float("nan"))

        def record(self, stream: Stream) -> None:
            assert isinstance(stream, Stream)
            self.ms = now["ms"]
            recorded.append(self)

        def synchronize(self) -> None:
            synchronized.append(self)

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr("time.perf_counter", lambda: 7.0)
    assert DeviceClock.available(torch.device("cuda", 0)) and not DeviceClock.available(torch.device("cpu"))
    clock = DeviceClock(torch.device("cuda", 0))
    assert drained == [40.0] and clock.start_s == 7.0
    timeline = Timeline(stage=0, num_stages=1, num_microbatches=1, start_s=clock.start_s)
    event = TimelineEvent("F", 0, 7.0, 7.0)
    timeline.events.append(event)
    now["ms"] = 42.5
    marked = clock.mark()  # after the stream's wait for the input
    now["ms"] = 45.5
    clock.add(event, marked)
    now["ms"] = 46.0
    clock.stop()
    assert len(recorded) == 4 and not synchronized  # nothing waited within the step
    clock.finish(timeline)
    assert synchronized == [clock.end]
    assert timeline.clock == "device"
    assert (event.start_s, event.end_s, timeline.end_s) == pytest.approx((7.0025, 7.0055, 7.006))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_step_timed_on_the_device_clock_marks_every_action_and_message_on_its_stream(pool, schedule):
    p, m = 2, 4
    results = pool.run(pipeline_jobs.device_timeline, p, m, schedule, ranks=p)
    hosts, devices = [r[0] for r in results], [r[1] for r in results]
    for host, device, finished in results:
        assert host.clock == "host" and device.clock == "device"
        assert finished == 1  # read once, on the first look
        kinds = sorted(e.kind for e in device.events)
        assert kinds == sorted(e.kind for e in host.events)  # every action and message was marked
        assert all(device.start_s <= e.start_s <= e.end_s <= device.end_s for e in device.events)
        waits = {(e.kind, e.microbatch): e for e in device.events if e.kind.startswith("recv")}
        for e in device.events:  # an action starts after the stream's wait for its input
            wait = waits.get(("recv_forward" if e.kind == "F" else "recv_backward", e.microbatch))
            if e.kind in ("F", "B") and wait is not None:
                assert wait.end_s <= e.start_s
    assert 0.0 < bubble_fraction(devices) < 1.0 and 0.0 < bubble_fraction(hosts) < 1.0


def test_the_trace_and_the_gantt_chart_name_their_clock(tmp_path):
    device = [_device_timeline(s) for s in (0, 1)]
    for t in device:
        t.events.append(TimelineEvent("W", 0, t.end_s, t.end_s))
    trace = chrome_trace(device, [4, 5])
    assert trace["otherData"] == {"clock": "device"}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["stage 0 (device clock)", "stage 1 (device clock)"]
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert sorted(e["name"] for e in compute if e["pid"] == 5) == ["B0", "B1", "F0", "F1", "W0"]
    first = next(e for e in trace["traceEvents"] if e["name"] == "F0" and e["pid"] == 5)
    assert first["ts"] == pytest.approx(1e3) and first["dur"] == pytest.approx(1e3)  # microseconds
    assert write_gantt(tmp_path / "device.png", device, "gpipe") == pytest.approx(1 / 3)
    replayed = [Timeline(stage=s, num_stages=2, num_microbatches=2, end_s=1.0, clock="none") for s in (0, 1)]
    assert chrome_trace(replayed, [0, 1])["otherData"] == {"clock": "none"}
    assert write_gantt(tmp_path / "replayed.png", replayed, "1f1b") is None
    assert (tmp_path / "replayed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(trace)
