"""The direct chain broadcast and reduce (dtrain.comm.peer.direct): their plans, run by a checker that interleaves
every rank's stream at random and scribbles over a rank's tensor as soon as its stream leaves the call, deliver the
root's buffer (reduce into the root every rank's input, no other rank's tensor written) and leave every counter at
0 whatever the order, whichever roots follow each other and however broadcasts and reduces mix; its host
mailbox on real processes passes every post in order, holds a poster a full ring ahead, and names a predecessor
that never posts; its executor on real processes, over host memory standing in for the GPU's (tensors in
/dev/shm files, named by path), matches torch.distributed's broadcast; and where a process cannot export its
tensors the broadcast is not taken this way."""

from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm.peer import chain, direct
from dtrain.comm.peer.direct import DONE, READY, plan
from tests.jobs import peer as jobs


def _reached(value: int, target: int) -> bool:
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


def _simulate(world: int, calls: list[tuple[str, int]], nbytes: int, piece: int, seed: int) -> None:
    """Run the calls (``("broadcast" | "reduce", root)``) one after another on every rank, each rank's plan a
    queue of operations on its stream, the next operation picked at random among the ranks whose next one can run;
    a rank starts a call once it finished the one before, and its tensor of a call is overwritten the moment it
    leaves the call (the caller reusing it), so a successor that read it later would copy the scribble. A reduce's
    element is the set of (call, rank) inputs combined into it; a rank in the middle of its chain keeps its partial
    in one buffer of its own for every call, so a successor reading it late would read another call's."""
    rng = random.Random(seed)
    counters = [[0, 0] for _ in range(world)]
    tensors = []
    for c, (kind, root) in enumerate(calls):
        if kind == "broadcast":
            row = [[("empty", c, r)] * nbytes for r in range(world)]
            row[root] = [(c, i) for i in range(nbytes)]
        else:
            row = [[frozenset({(c, r, i)}) for i in range(nbytes)] for r in range(world)]
        tensors.append(row)
    inputs = [[list(t) for t in row] for row in tensors]
    partial = [[None] * nbytes for _ in range(world)]
    results = [[None] * world for _ in calls]
    queues = [
        [list(plan(r, root, world, nbytes, piece, kind == "reduce")) for r in range(world)] for kind, root in calls
    ]
    at = [0] * world

    def runnable(op) -> bool:
        if op.kind != "wait":
            return True
        value = counters[op.rank][op.counter]
        return value == op.value if op.exact else _reached(value, op.value)

    def partial_of(call: int, r: int):
        """What rank ``r`` of a reduce exposes to its successor: its input (the chain's first), else its partial."""
        root = calls[call][1]
        return tensors[call][r] if r == (root + 1) % world else partial[r]

    while True:
        for r in range(world):
            while at[r] < len(calls) and not queues[at[r]][r]:
                results[at[r]][r] = list(tensors[at[r]][r])
                tensors[at[r]][r] = [("scribbled", at[r], r)] * nbytes  # the caller reuses its tensor
                at[r] += 1
        ready = [r for r in range(world) if at[r] < len(calls) and runnable(queues[at[r]][r][0])]
        if not ready:
            assert all(a == len(calls) for a in at), f"deadlock: ranks at calls {at}"
            break
        r = rng.choice(ready)
        call = at[r]
        op = queues[call][r].pop(0)
        prev = (r - 1) % world
        if op.kind == "copy":
            tensors[call][r][op.at : op.at + op.nbytes] = tensors[call][prev][op.at : op.at + op.nbytes]
        elif op.kind == "combine":
            out = tensors[call][r] if r == calls[call][1] else partial[r]
            peer = partial_of(call, prev)
            for i in range(op.at, op.at + op.nbytes):
                assert isinstance(peer[i], frozenset), (call, r, i, peer[i])
                out[i] = tensors[call][r][i] | peer[i]
        elif op.kind == "write":
            counters[op.rank][op.counter] = op.value
    for call, (kind, root) in enumerate(calls):
        for r in range(world):
            if kind == "broadcast":
                want = [(call, i) for i in range(nbytes)]
            elif r == root:
                want = [frozenset((call, q, i) for q in range(world)) for i in range(nbytes)]
            else:
                want = inputs[call][r]  # read, never written
            assert results[call][r] == want, (call, kind, root, r)
    assert counters == [[0, 0]] * world


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(2, 5),
    roots=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    nbytes=st.integers(1, 40),
    piece=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_a_direct_chain_delivers_the_roots_buffer_and_clears_its_counters_in_any_interleaving(
    world, roots, nbytes, piece, seed
):
    _simulate(world, [("broadcast", r % world) for r in roots], nbytes, piece, seed)


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(2, 5),
    calls=st.lists(st.tuples(st.sampled_from(["broadcast", "reduce"]), st.integers(0, 4)), min_size=1, max_size=5),
    nbytes=st.integers(1, 24),
    piece=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_a_direct_reduce_combines_every_input_into_the_root_only_in_any_interleaving_and_mix(
    world, calls, nbytes, piece, seed
):
    _simulate(world, [(kind, r % world) for kind, r in calls], nbytes, piece, seed)


def test_a_reduce_chain_starts_after_its_root_and_ends_at_it():
    first = plan(rank=2, root=1, world=4, nbytes=10, piece=4, reduce=True)
    assert [(op.kind, op.rank, op.counter, op.value) for op in first] == [
        ("write", 3, READY, 3),
        ("wait", 2, DONE, 1),
        ("write", 2, DONE, 0),
    ]
    root = plan(rank=1, root=1, world=4, nbytes=10, piece=4, reduce=True)
    assert [(op.at, op.nbytes) for op in root if op.kind == "combine"] == [(0, 4), (4, 4), (8, 2)]
    assert not [op for op in root if op.kind == "write" and op.counter == READY and op.rank != 1]  # passes none on
    assert [op.kind for op in plan(rank=3, root=1, world=4, nbytes=10, piece=4, reduce=True)].count("combine") == 3


def test_the_root_raises_its_successors_count_at_once_and_every_wait_is_on_the_waiters_own_window():
    root = plan(rank=0, root=0, world=3, nbytes=10, piece=4)
    assert [(op.kind, op.rank, op.counter, op.value) for op in root] == [
        ("write", 1, READY, 3),
        ("wait", 0, DONE, 1),
        ("write", 0, DONE, 0),
    ]
    last = plan(rank=2, root=0, world=3, nbytes=10, piece=4)
    tail = [(op.kind, op.rank, op.counter, op.value) for op in last[-2:]]
    assert tail == [("write", 2, READY, 0), ("write", 1, DONE, 1)]  # its own count cleared, then the predecessor told
    middle = plan(rank=1, root=0, world=3, nbytes=10, piece=4)
    copies = [(op.at, op.nbytes) for op in middle if op.kind == "copy"]
    assert copies == [(0, 4), (4, 4), (8, 2)]
    assert [op.value for op in middle if op.kind == "write" and op.rank == 2 and op.counter == READY] == [1, 2, 3]
    for rank, ops in enumerate((root, middle, last)):
        assert all(op.rank == rank for op in ops if op.kind == "wait")


def test_two_ranks_copy_the_whole_buffer_at_once_and_more_pipeline_in_the_chains_pieces():
    assert direct.pieces(1 << 30, 2) == 1 << 30
    assert direct.pieces(1 << 30, 4) == chain.pieces(1 << 30, 4)


def test_tensors_are_not_exported_off_cuda_or_from_expandable_segments(monkeypatch):
    assert not direct.exportable(torch.device("cpu"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not direct.exportable(torch.device("cuda", 0))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    if direct._ipc() is None:  # no CUDA driver here: nothing to export with
        assert not direct.exportable(torch.device("cuda", 0))


@pytest.mark.parametrize("world", [2, 3])
def test_the_mailbox_on_real_processes_passes_every_post_in_order_around_its_ring(pool, world):
    problems = pool.run(jobs.direct_mailbox, world, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


def test_a_predecessor_that_never_posts_is_named_within_the_timeout(pool):
    got = pool.run(jobs.direct_mailbox_missing_post, 0.5, ranks=2)
    seconds, message = got[1].split("|", 1)
    assert float(seconds) < 5 and "rank 0 to post its tensor" in message


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_executor_on_real_processes_matches_torch_distributed_and_keeps_its_mappings(pool, world):
    problems = pool.run(jobs.direct_broadcasts, world, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_reduce_on_real_processes_matches_torch_distributed_and_writes_only_the_roots_tensor(pool, world):
    problems = pool.run(jobs.direct_reduces, world, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


def test_a_tensor_that_cannot_be_named_fails_on_both_ranks_naming_the_one_at_fault(pool):
    got = pool.run(jobs.direct_refused, ranks=2)
    assert got[0].startswith("DirectRefused: no shared file holds")
    assert got[1] == "DirectRefused: rank 0 could not name its tensor's allocation to this rank"


def test_a_rank_mid_chain_that_cannot_name_its_memory_fails_every_rank_after_it_and_wedges_none(pool):
    got = pool.run(jobs.direct_refused_mid_chain, 3, ranks=3)
    refused = "DirectRefused: rank {} could not name its tensor's allocation to this rank"
    private = "DirectRefused: no shared file holds"
    # the broadcast from 0: rank 1 at fault, rank 2 after it; rank 0 before it finishes its round
    assert got[0][0] == "ok" and got[1][0].startswith(private) and got[2][0] == refused.format(1)
    # the reduce into 0 along 1, 2, 0: rank 1 at fault, then 2 and 0
    assert got[0][2] == refused.format(2) and got[1][2].startswith(private) and got[2][2] == refused.format(1)
    # rank 2 cannot name its partial after a good post from rank 1: it closes rank 1's round, 0 fails after it
    assert [g[4] for g in got] == [refused.format(2), "ok", "DirectRefused: the partial buffer is private"]
    for g in got:  # and every call after each runs on every rank
        assert [x.split()[-1] for x in g[1::2]] == ["good"] * 3


def test_a_post_is_checked_against_the_mapping_before_anything_reads_through_it():
    assert direct.checked_post(0, 64, 64, 4, 0, "broadcast") == 0
    assert direct.checked_post(32, 32, 64, 4, 0, "broadcast") == 32
    for offset, nbytes, why in (
        (4, 64, "bytes [4, 68) of an allocation of 64 bytes"),
        (68, 0, "bytes [68, 68) of an allocation of 64 bytes"),
        (2**64 - 8, 16, f"bytes [{2**64 - 8}, {2**64 + 8})"),
        (6, 4, "an offset of 6 bytes into its allocation, not a multiple of the element size 4"),
    ):
        with pytest.raises(ValueError, match=r"^reduce: rank 3 posted " + re.escape(why)):
            direct.checked_post(offset, nbytes, 64, 4, 3, "reduce")


def test_a_post_past_the_predecessors_allocation_fails_the_reader_and_wedges_neither_rank(pool):
    got = pool.run(jobs.direct_bad_posts, ranks=2)
    past = "ValueError: {}: rank 0 posted bytes [64, 128) of an allocation of 64 bytes"
    odd = "ValueError: {}: rank 0 posted an offset of 2 bytes into its allocation, not a multiple of the element size 4"
    # rank 0 finishes its part (its reader drains its round), rank 1 reads nothing through the post
    assert got[0] == ["ok", "ok", "ok", "ok", "good"]
    assert [g.split(";")[0] for g in got[1][:4]] == [
        past.format("broadcast"),
        odd.format("broadcast"),
        past.format("reduce"),
        odd.format("reduce"),
    ]
    assert got[1][4] == "good"
