"""The runtime alone, without processes: every algorithm's plan run by W threads over in-memory queues.

This reaches world sizes (up to 16) and uneven sizes the process pool does not, in well under a second each;
the pool tests then check the same runtime over real Gloo.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from dtrain.comm.ir.algorithms import build, names
from dtrain.comm.ir.schedule import BLOCK_COLLECTIVES, Collective
from dtrain.comm.p2p.runtime import compile_plan, run_schedule


class _Message:
    def __init__(self, box: queue.Queue, target: torch.Tensor | None) -> None:
        self.box, self.target = box, target

    def wait(self, timeout=None) -> None:
        if self.target is not None:
            self.target.copy_(self.box.get(timeout=10))


class _Pending:
    def __init__(self, peer: int, is_send: bool, work: _Message, nbytes: int) -> None:
        self.peer, self.is_send, self.work, self.nbytes = peer, is_send, work, nbytes

    def wait(self, timeout=None) -> None:
        self.work.wait()


class ThreadTransport:
    """Rank ``rank`` of ``world`` threads; one FIFO per ordered pair of ranks."""

    def __init__(self, rank: int, boxes: dict[tuple[int, int], queue.Queue]) -> None:
        self.rank, self.boxes = rank, boxes
        self.world_size = 1 + max(max(k) for k in boxes) if boxes else 1

    def global_rank(self, r: int) -> int:
        return r

    def start(self, sends, recvs):
        out = []
        for peer, t in sends:
            self.boxes[(self.rank, peer)].put(t.clone())
            out.append(_Pending(peer, True, _Message(self.boxes[(self.rank, peer)], None), 0))
        for peer, t in recvs:
            out.append(_Pending(peer, False, _Message(self.boxes[(peer, self.rank)], t), 0))
        return out


def _run_threads(schedule, works: list[torch.Tensor], op: str, lanes: int = 1) -> None:
    world = schedule.world_size
    boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world) if a != b}
    errors = []

    def rank_main(r: int) -> None:
        try:
            transport = ThreadTransport(r, boxes)
            transport.world_size = world
            run_schedule(schedule, works[r], transport, op, lanes=lanes)
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _expected(coll: Collective, inputs: torch.Tensor, rank: int, root: int | None) -> torch.Tensor | None:
    world = inputs.shape[0]
    if coll == Collective.BARRIER:  # its terms are sets: run with max, where seeing a rank twice is harmless
        return inputs.amax(0)
    if coll == Collective.ALL_REDUCE or (coll == Collective.REDUCE and rank == root):
        return inputs.sum(0)
    if coll == Collective.REDUCE:
        return None
    if coll == Collective.BROADCAST:
        return inputs[root]
    if coll == Collective.SCAN:
        return inputs[: rank + 1].sum(0)
    blocks = inputs.view(world, world, -1)  # (rank, block, element)
    if coll == Collective.ALL_GATHER or (coll == Collective.GATHER and rank == root):
        return blocks[torch.arange(world), torch.arange(world)].reshape(-1)
    if coll == Collective.REDUCE_SCATTER:
        return blocks.sum(0)[rank]
    if coll == Collective.SCATTER:
        return blocks[root, rank]
    if coll == Collective.ALL_TO_ALL:
        return blocks[:, rank].reshape(-1)
    return None


def _result(coll: Collective, work: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if coll in (Collective.REDUCE_SCATTER, Collective.SCATTER):
        return work.view(world, -1)[rank]
    return work


def _cases():
    for coll in Collective:
        for algorithm in names(coll):
            for world in (1, 2, 5, 7, 8, 16):
                if algorithm == "hierarchical":
                    yield from ((coll, algorithm, world, local) for local in (1, 2, 4) if world % local == 0)
                else:
                    yield coll, algorithm, world, None


@pytest.mark.parametrize(("coll", "algorithm", "world", "local_size"), list(_cases()))
@pytest.mark.parametrize("block", [0, 1, 7, 33])
def test_every_plan_computes_its_collective(coll, algorithm, world, local_size, block):
    _check_plan(coll, algorithm, world, local_size, block, lanes=1)


@pytest.mark.parametrize(("coll", "algorithm", "world", "local_size"), [c for c in _cases() if c[2] in (5, 8)])
@pytest.mark.parametrize(("block", "lanes"), [(7, 2), (33, 3), (2, 4)])
def test_every_plan_computes_its_collective_in_lanes(coll, algorithm, world, local_size, block, lanes):
    _check_plan(coll, algorithm, world, local_size, block, lanes)


def _check_plan(coll, algorithm, world, local_size, block, lanes):
    rooted = (Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER)
    root = world - 1 if coll in rooted else None
    schedule = build(coll, algorithm, world, root=root, pipeline=3, local_size=local_size)
    numel = block * world if coll in BLOCK_COLLECTIVES else block
    inputs = torch.randint(-9, 10, (world, numel), dtype=torch.int64)
    if coll in (Collective.ALL_GATHER, Collective.GATHER):
        # A rank's input is its own block; the rest of its buffer is garbage the algorithm must overwrite.
        own = [inputs[r].view(world, -1)[r].clone() for r in range(world)]
        works = [torch.full((numel,), -99, dtype=torch.int64) for _ in range(world)]
        for r in range(world):
            works[r].view(world, -1)[r] = own[r]
        gathered = torch.cat(own) if numel else torch.empty(0, dtype=torch.int64)
    else:
        works = [inputs[r].clone() for r in range(world)]
    _run_threads(schedule, works, "max" if coll == Collective.BARRIER else "sum", lanes)
    for r in range(world):
        if coll in (Collective.ALL_GATHER, Collective.GATHER):
            want = gathered if coll == Collective.ALL_GATHER or r == root else None
        else:
            want = _expected(coll, inputs, r, root)
        if want is not None:
            assert torch.equal(_result(coll, works[r], r, world), want), (r, works[r], want)


def test_direct_reduce_scatter_reduces_incoming_blocks_in_one_pass():
    plan = compile_plan(build(Collective.REDUCE_SCATTER, "direct", 4), 0, 4 * 8)
    (round_,) = plan.rounds
    assert [(a.offset, a.length, a.count, a.reduce) for a in round_.applies] == [(0, 8, 3, True)]


def test_ring_all_gather_receives_in_place():
    plan = compile_plan(build(Collective.ALL_GATHER, "ring", 4), 1, 4 * 8)
    assert all(r.target is not None for rp in plan.rounds for r in rp.recvs)
    assert plan.scratch == 0


def test_lanes_slice_every_chunk_and_keep_their_own_scratch():
    plan = compile_plan(build(Collective.REDUCE_SCATTER, "direct", 4), 0, 4 * 10, 2)
    assert [rp.lane for rp in plan.rounds] == [0, 1]
    first, second = (rp.applies[0] for rp in plan.rounds)
    assert (first.offset, first.length, second.offset, second.length) == (0, 5, 5, 5)
    assert second.scratch >= first.scratch + first.count * first.length
