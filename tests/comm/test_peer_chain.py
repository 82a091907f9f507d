"""The pipelined chain broadcast (dtrain.comm.peer.chain): its plans, run by a checker that interleaves every
rank's streams at random, deliver the root's buffer and leave every counter as a round found it, whatever the
order and whichever roots follow each other; and on real Gloo processes (windows in /dev/shm) the chain matches
torch.distributed's broadcast."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm.peer import chain
from dtrain.comm.peer.chain import CALLER, FORWARDED, FREE, LANES, READY, ROUND_DONE, plan
from tests.jobs import peer as jobs


def _reached(value: int, target: int) -> bool:
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


def _simulate(world: int, roots: list[int], nbytes: int, piece: int, slots: int, lanes: int, seed: int) -> None:
    """Run the broadcasts from ``roots`` one after another on every rank, each (rank, stream) a queue of its
    plan's operations, the next operation picked at random among those that can run: a wait once its counter
    got there, a lane's operations once the caller's stream passed the fork, the join once the lanes are done;
    a rank starts a call once every stream of its finished the one before."""
    rng = random.Random(seed)
    streams = 1 + LANES
    windows = [[None] * (chain.RING_AT + slots * piece) for _ in range(world)]
    counters = [[0] * chain.RING_AT for _ in range(world)]
    for c in counters:
        c[FREE] = ROUND_DONE
    tensors = [[[None] * nbytes for _ in range(world)] for _ in roots]
    for call, root in enumerate(roots):
        tensors[call][root] = [(call, i) for i in range(nbytes)]
    queues = [
        [
            [[op for op in plan(r, root, world, nbytes, piece, slots, lanes) if op.stream == s] for s in range(streams)]
            for r in range(world)
        ]
        for root in roots
    ]
    at = [0] * world  # the call each rank is in
    forked = [False] * world

    def place(rank: int, call: int, where: tuple):
        return (tensors[call][rank], where[1]) if where[0] == "tensor" else (windows[where[1]], where[2])

    def runnable(r: int, s: int, op) -> bool:
        if s != CALLER and not forked[r]:
            return False
        if op.kind == "join":
            return not any(queues[at[r]][r][1:])
        if op.kind != "wait":
            return True
        value = counters[op.rank][op.counter]
        return value == op.value if op.exact else _reached(value, op.value)

    while True:
        ready = []
        for r in range(world):
            while at[r] < len(roots) and not any(queues[at[r]][r]):
                at[r] += 1
                forked[r] = False
            if at[r] < len(roots):
                mine = queues[at[r]][r]
                ready += [(r, s) for s in range(streams) if mine[s] and runnable(r, s, mine[s][0])]
        if not ready:
            assert all(a == len(roots) for a in at), f"deadlock: ranks at calls {at}"
            break
        r, s = rng.choice(ready)
        call = at[r]
        op = queues[call][r][s].pop(0)
        if op.kind == "copy":
            dst, d = place(r, call, op.dst)
            src, o = place(r, call, op.src)
            dst[d : d + op.nbytes] = src[o : o + op.nbytes]
        elif op.kind == "write":
            counters[op.rank][op.counter] = op.value
        elif op.kind == "fork":
            forked[r] = True
    for call, root in enumerate(roots):
        for r in range(world):
            assert tensors[call][r] == tensors[call][root], (call, root, r)
    for r in range(world):
        want = [0] * chain.RING_AT
        want[FREE] = ROUND_DONE
        assert counters[r] == want, (r, counters[r][:8])


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 5),
    roots=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    nbytes=st.integers(1, 40),
    piece=st.integers(1, 7),
    slots=st.integers(1, 3),
    lanes=st.integers(1, LANES),
    seed=st.integers(0, 2**16),
)
def test_a_chain_delivers_the_roots_buffer_and_restores_its_counters_in_any_interleaving(
    world, roots, nbytes, piece, slots, lanes, seed
):
    _simulate(world, [r % world for r in roots], nbytes, piece, slots, lanes, seed)


def test_a_rank_in_the_middle_forwards_on_its_lanes_and_frees_a_slot_only_once_forwarded():
    ops = plan(rank=1, root=0, world=3, nbytes=10, piece=4, slots=2, lanes=2)
    assert [op.kind for op in ops[:3]] == ["wait", "write", "fork"]  # the round before taken, cleared, then lanes
    assert ops[0].exact and ops[0].value == ROUND_DONE and ops[-1].kind == "join"
    pushes = [op for op in ops if op.kind == "copy" and op.dst[0] == "slot"]
    assert [op.stream for op in pushes] == [1, 2, 1]  # pieces dealt round-robin over the lanes
    frees = [op for op in ops if op.kind == "write" and op.counter == FREE and op.rank == 0]  # the predecessor's
    assert [op.value for op in frees] == [1, 2, ROUND_DONE] and {op.stream for op in frees} == {CALLER}
    waits = [(op.counter, op.value) for op in ops if op.stream == CALLER and op.kind == "wait"]
    assert (FORWARDED + 1, 1) in waits and (READY + 1, 1) in waits  # piece 1: lane 1's first
    root = plan(rank=0, root=0, world=3, nbytes=10, piece=4, slots=2)
    assert not any(op.kind == "copy" and op.dst[0] == "tensor" for op in root)  # the root only pushes


@pytest.mark.parametrize(
    ("nbytes", "want"),
    [
        (1, chain.MIN_PIECE_BYTES),
        (64 << 20, 16 << 20),
        (1 << 30, chain.MAX_SLOT_BYTES),
        ((64 << 20) + 3, (16 << 20) + 256),
    ],
)
def test_pieces_aim_at_four_between_the_bounds_on_256_byte_boundaries(nbytes, want):
    assert chain.pieces(nbytes, 4) == want


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_chain_on_real_processes_matches_torch_distributed(pool, world):
    problems = pool.run(jobs.chain_broadcasts, world, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


def test_a_missing_peer_stops_the_chain_within_the_groups_timeout_and_is_named(pool):
    answer, _ = pool.run(jobs.chain_missing_peer, 2.0, ranks=2)
    seconds, message, dropped = answer.split("|")
    assert float(seconds) < 15
    assert "broadcast/ring: rank 0 (global 0) timed out in the chain broadcast" in message
    assert "for rank 1 to push a piece" in message
    assert dropped == "dropped=True"  # its counters cannot be trusted again: the next call makes it afresh
