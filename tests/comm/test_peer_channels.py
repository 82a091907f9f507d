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
