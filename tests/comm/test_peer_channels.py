"""Peer channels (dtrain.comm.peer.channels) on real Gloo processes: messages of every dtype arrive equal and in
order through rings smaller than the messages sent, and bad use is refused before anything is written."""

from __future__ import annotations

from dtrain.comm.peer.channels import _reached, _wrap
from tests.jobs import peer_channels as jobs


def test_counters_compare_cyclically_across_the_32_bit_wrap():
    assert _reached(5, 5) and _reached(6, 5) and not _reached(4, 5)
    assert _reached(_wrap(2**32 + 3) & 0xFFFFFFFF, (2**32 - 2) & 0xFFFFFFFF)  # 3 after the wrap is past 2^32 - 2
    assert not _reached((2**32 - 2) & 0xFFFFFFFF, 3)
    assert _wrap(2**31) == -(2**31) and _wrap(2**32 + 7) == 7


def test_messages_of_every_dtype_go_around_a_ring_of_three_through_two_slots(pool):
    for rank, arrived in enumerate(pool.run(jobs.ring, 3, 11, 2, ranks=3)):
        assert arrived == [True] * 11, f"rank {rank}: {arrived}"


def test_rounds_of_changing_lengths_go_around_a_ring_of_three(pool):
    for rank, arrived in enumerate(pool.run(jobs.rounds, 3, 7, [3, 1, 2], 3, ranks=3)):
        assert arrived == [True] * 15, f"rank {rank}: {arrived}"


def test_a_bad_channel_an_oversized_message_and_another_ranks_channel_are_refused(pool):
    for said in pool.run(jobs.refusals, ranks=2):
        assert len(said) == 3, said
        assert "bad channel" in said[0]
        assert "cannot send 12 bytes on channel" in said[1]
        assert "cannot send 4 bytes on channel" in said[2]


def test_a_message_never_sent_and_a_barrier_reached_late_time_out_naming_what_they_waited_for(pool):
    waited_for_message, waited_at_barrier = pool.run(jobs.stalls, ranks=2)[::-1]
    assert waited_for_message == "peer channels: rank 1 waited past the group's timeout for rank 0's message 0"
    assert waited_at_barrier == "ranks [1] did not reach the barrier"


def test_on_cuda_each_step_is_one_driver_call_at_the_ring_s_addresses():
    """The CUDA path, driven through a stand-in for the driver (no GPU here): a send orders the channel's stream
    after the caller's, waits for a free slot once the ring is full, copies the payload into the receiver's slot
    and raises ``ready``, then records a completion event that goes back to the pool when the send is dropped; a
    receive waits for ``ready`` on the caller's stream, copies the slot out and raises the sender's ``free``."""
    import torch

    from dtrain.comm.peer.channels import _ALIGN, Channel, PeerChannels, _Driver

    calls = []
    events = iter(range(1000, 2000))
    state = {"ready": 0}

    def op(name):
        def call(*args):
            calls.append((name, *args))
            if name == "create_event":
                args[0]._obj.value = next(events)
            return state["ready"] if name == "query" else 0

        return call

    driver = _Driver(*(op(name) for name in _Driver._fields))
    chans = PeerChannels.__new__(PeerChannels)
    chans.rank, chans.device, chans._cuda, chans.direct, chans._driver = 0, torch.device("cpu"), True, True, driver
    chans.channels = [Channel(0, 1, 300, 2), Channel(1, 0, 300, 2)]
    chans._ready_at, chans._free_at, chans._ring_at = [0, 4], [8, 12], [256, 256]
    chans._base = [1 << 20, 2 << 20]
    chans._sent, chans._posted, chans._waiting = [0, 0], [0, 0], [[], []]
    chans._booked, chans._rounds = [0, 0], [False, False]
    chans._raw_streams, chans._events = {0: 77}, []
    chans._raw_current, chans._index = (lambda index: 55), 0
    chans._hold = lambda tensor, index: None
    chans._order = {0: chans._new_event()}
    slot = -(-300 // _ALIGN) * _ALIGN
    payload = torch.arange(75, dtype=torch.float32)  # 300 bytes
    calls.clear()
    sent = [chans.send(0, payload) for _ in range(3)]
    order = chans._order[0]
    want = []
    for n in range(3):
        want += [("record", order, 55), ("wait_event", 77, order, 0)]
        if n >= 2:  # the ring of two is full: wait for the receiver to free the first slot
            want.append(("wait", 77, (1 << 20) + 8, 1, 0))
        want += [
            ("copy", (2 << 20) + 256 + (n % 2) * slot, payload.data_ptr(), 300, 77),
            ("write", 77, (2 << 20) + 0, n + 1, 0),
            ("record", 1001 + n, 77),  # a new completion event each: none was dropped yet
        ]
    assert [c for c in calls if c[0] != "create_event"] == want
    state["ready"] = 600  # cuEventQuery: not yet done
    assert not sent[0].is_completed()
    state["ready"] = 0
    assert sent[0].is_completed()
    del sent[0]
    assert chans._events == [1001]  # the dropped send's event, kept for the next send
    calls.clear()
    got = chans.post(1, (75,), torch.float32).wait()
    assert calls == [
        ("wait", 55, (1 << 20) + 4, 1, 0),
        ("copy", got.data_ptr(), (1 << 20) + 256, 300, 55),
        ("write", 55, (2 << 20) + 12, 1, 0),
    ]
    calls.clear()
    del sent
    chans.__del__()  # the channels go: every event the driver made for them goes too
    assert sorted(c[1] for c in calls if c[0] == "destroy_event") == [1000, 1001, 1002, 1003]


def test_rounds_reset_the_counters_so_each_round_repeats_the_same_operations():
    """Rounds through the stand-in driver: the receiver of a round's last message sets its ``ready`` back to 0 and
    then its sender's ``free`` to ROUND_DONE; the sender's first message of the next round waits for exactly that
    and clears it; every round then issues the same waits and writes with the same values (what lets one round
    recorded in a CUDA graph replay)."""
    import torch

    from dtrain.comm.peer.channels import _ALIGN, ROUND_DONE, Channel, PeerChannels, _Driver

    calls = []
    events = iter(range(1000, 2000))

    def op(name):
        def call(*args):
            calls.append((name, *args))
            if name == "create_event":
                args[0]._obj.value = next(events)
            return 0

        return call

    driver = _Driver(*(op(name) for name in _Driver._fields))

    def endpoint(rank):
        chans = PeerChannels.__new__(PeerChannels)
        chans.rank, chans.device, chans._cuda, chans.direct, chans._driver = (
            rank,
            torch.device("cpu"),
            True,
            True,
            driver,
        )
        chans.channels = [Channel(0, 1, 300, 2)]
        chans._ready_at, chans._free_at, chans._ring_at = [0], [4], [256]
        chans._base = [1 << 20, 2 << 20]
        chans._sent, chans._posted, chans._waiting, chans._booked, chans._rounds = [0], [0], [[]], [0], [False]
        chans._raw_streams, chans._events = {0: 77}, []
        chans._raw_current, chans._index = (lambda index: 55), 0
        chans._hold = lambda tensor, index: None
        chans._order = {0: chans._new_event()} if rank == 0 else {}
        return chans

    sender, receiver = endpoint(0), endpoint(1)
    slot = -(-300 // _ALIGN) * _ALIGN
    payload = torch.arange(75, dtype=torch.float32)
    rounds_sent, rounds_taken = [], []
    for _ in range(3):
        calls.clear()
        held = [sender.send(0, payload), sender.send(0, payload, last=True)]
        rounds_sent.append([c[:2] + c[2:] for c in calls if c[0] in ("wait", "write", "copy")])
        calls.clear()
        posted = [receiver.post(0, (75,), torch.float32), receiver.post(0, (75,), torch.float32, last=True)]
        posted[1].wait()  # takes the first too
        rounds_taken.append([(c[0], c[2], c[3]) for c in calls if c[0] in ("wait", "write")])
        del held
    ready, free = (2 << 20) + 0, (1 << 20) + 4
    first = [("copy", (2 << 20) + 256, payload.data_ptr(), 300, 77), ("write", 77, ready, 1, 0)]
    first += [("copy", (2 << 20) + 256 + slot, payload.data_ptr(), 300, 77), ("write", 77, ready, 2, 0)]
    assert rounds_sent[0] == first
    # later rounds: wait for the round before to be taken (an EQ wait), clear free, then the same as the first
    again = [("wait", 77, free, ROUND_DONE, 1), ("write", 77, free, 0, 0), *first]
    assert rounds_sent[1] == again and rounds_sent[2] == again
    taken = [
        ("wait", ready, 1),
        ("write", free, 1),
        ("wait", ready, 2),
        ("write", ready, 0),
        ("write", free, ROUND_DONE),
    ]
    assert rounds_taken == [taken] * 3


def test_messages_taken_lent_are_their_slots_until_released(pool):
    for rank, r in enumerate(pool.run(jobs.lent_rounds, 3, 5, [3, 1, 2], 3, ranks=3)):
        assert r["equal"] == r["inside"] == r["kept"] == [True] * 10, f"rank {rank}: {r}"
        assert r["said"] == (
            "peer channels: channel " + str((rank - 1) % 3) + " lends its slots within a round of at most 3 "
            "messages; this is its message 4"
        )


def _stand_in(rank: int, calls: list):
    """Rank ``rank``'s end of channels 0 -> 1 and 1 -> 0 on the CUDA path, over a stand-in for the driver that
    records each call, with windows of CPU memory (so a kernel's stores can be read back)."""
    import types

    import torch

    from dtrain.comm.peer.channels import Channel, PeerChannels, _Driver

    def op(name):
        def call(*args):
            calls.append((name, *args))
            if name == "create_event":
                args[0]._obj.value = 1000 + len(calls)
            return 0

        return call

    chans = PeerChannels.__new__(PeerChannels)
    chans.rank, chans.device, chans._cuda, chans.direct = rank, torch.device("cpu"), True, True
    chans._driver = _Driver(*(op(name) for name in _Driver._fields))
    chans.engine = "stream"
    chans.channels = [Channel(0, 1, 300, 4), Channel(1, 0, 300, 4)]
    chans._ready_at, chans._free_at, chans._ring_at = [0, 4], [8, 12], [256, 256]
    chans.window = types.SimpleNamespace(buffers=[torch.zeros(2048, dtype=torch.uint8) for _ in range(2)])
    chans._base = [int(b.data_ptr()) for b in chans.window.buffers]
    chans._sent, chans._posted, chans._waiting = [0, 0], [0, 0], [[], []]
    chans._booked, chans._rounds, chans._lent = [0, 0], [False, False], {}
    chans._raw_streams, chans._events = {rank: 77}, []
    chans._raw_current, chans._index = (lambda index: 55), 0
    chans._hold = lambda tensor, index: None
    chans._order = {rank: chans._new_event()}
    return chans


def test_sends_on_the_caller_s_stream_copy_there_with_no_event_or_second_stream():
    """Engines "inline" and "kernel" (through the stand-in driver): the slot waits, the copy and the raise are all
    on the caller's stream (55), in that order, with no event recorded and nothing on the channel's stream (77);
    "inline" copies through the driver's copy, "kernel" stores the payload's bytes into the peer's slot itself
    (bit for bit, negative zeros and NaNs included), and the round's first message after another waits for that
    round to be taken, as on the channel's stream."""
    import torch

    from dtrain.comm.peer.channels import _ALIGN, ROUND_DONE

    calls = []
    chans = _stand_in(0, calls)
    slot = -(-300 // _ALIGN) * _ALIGN
    ready, free = chans._base[1], chans._base[0] + 8
    payload = torch.tensor([-0.0, float("nan"), 1.5, -2.25] * 18 + [3.0, 4.0, 5.0])  # 75 floats: 300 bytes
    calls.clear()
    sent = chans.send(0, payload, engine="inline")
    assert sent.is_completed()
    assert calls == [
        ("copy", chans._base[1] + 256, payload.data_ptr(), 300, 55),
        ("write", 55, ready, 1, 0),
    ]
    calls.clear()
    chans.send(0, payload, engine="kernel", last=True)
    assert calls == [("write", 55, ready, 2, 0)]
    landed = chans.window.buffers[1][256 + slot : 256 + slot + 300]
    assert torch.equal(landed, payload.view(torch.uint8))  # bits: -0.0 and NaN as they were
    # the next round: its first message waits (on the caller's stream) for the round before to be taken
    calls.clear()
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: stored as bytes
    chans.engine = "kernel"
    chans.send(0, odd)
    assert calls == [("wait", 55, free, ROUND_DONE, 1), ("write", 55, free, 0, 0), ("write", 55, ready, 1, 0)]
    assert torch.equal(chans.window.buffers[1][256:263], odd)


def test_a_send_engine_that_does_not_exist_is_refused_before_anything_is_sent():
    import pytest
    import torch

    from dtrain.parallel.pipeline_parallel_communications import StageLink

    calls = []
    chans = _stand_in(0, calls)
    calls.clear()
    with pytest.raises(ValueError, match="engine must be one of stream, inline, kernel, got 'dma'"):
        chans.send(0, torch.zeros(3), engine="dma")
    assert calls == [] and chans._sent == [0, 0]
    with pytest.raises(ValueError, match="send_engine must be one of stream, inline, kernel, got 'dma'"):
        StageLink(None, 0, 2, send_engine="dma")


def test_store_is_a_bitwise_copy_for_every_length_and_offset():
    import torch

    from dtrain.comm.peer.channels import store

    source = torch.randint(0, 256, (64,), dtype=torch.uint8)
    for start in (0, 1, 2, 4, 8):
        for n in (1, 2, 3, 4, 7, 8, 24, 40):
            out = torch.zeros(64, dtype=torch.uint8)
            store(out[start : start + n], source[8 : 8 + n])
            assert torch.equal(out[start : start + n], source[8 : 8 + n])
            assert not out[:start].any() and not out[start + n :].any()


def test_ranks_that_would_lay_out_their_windows_apart_are_refused_alike_before_any_message(pool):
    got = pool.run(jobs.windows_laid_out_apart, ranks=2)
    sizes = "ValueError: peer transport: the ranks of this group make windows of different sizes ([4096, 8192] bytes"
    assert got[0][0].startswith(sizes) and got[1][0].startswith(sizes)
    apart = "ValueError: peer transport: group ranks [1] lay out their windows otherwise than rank 0 (on this rank: "
    assert got[0][1].startswith(apart + "peer channels [(0, 1, 64, 4)]")
    assert got[1][1].startswith(apart + "peer channels [(0, 1, 512, 2)]")
    assert got[0][2] == "[]" and got[1][2] == "[0.0, 1.0, 2.0]"  # channels the ranks agree on carry every message
