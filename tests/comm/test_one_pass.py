"""The one-pass paths of all-gather, reduce-scatter, all-to-all and broadcast on CUDA symmetric memory
(dtrain.comm.peer.fused.one_pass): the one-round schedules they run, which calls take them, and the pass itself
on CPU stand-ins for the windows (one thread a rank, a thread barrier for the device barrier). The CUDA kernels
need GPUs: `dtrain bench verify` checks them against NCCL's result."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from dtrain.comm import api
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.check import check
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.peer import fused, kernels
from tests.jobs import comm as jobs

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_the_one_pass_schedules_are_one_round_and_prove_their_collective():
    """One round each, but the scatter-allgather broadcast's two (one on two ranks), which its kernel runs with a
    barrier between them."""
    for world in (2, 3, 4, 8):
        for (coll, algorithm), form in fused.ONE_PASS.items():
            rooted = coll in (Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER)
            schedule = registry.build(coll, algorithm, world, root=world - 1 if rooted else None)
            report = check(schedule)  # raises where a rank ends without what the collective promises
            one_way = ("broadcast", "rooted", "gather_to", "scatter_from")
            transfers = world - 1 if form in one_way else {"relay": (world - 1) ** 2}.get(form, world * (world - 1))
            rounds = 2 if form == "relay" and world > 2 else 1
            assert report.num_rounds == rounds and report.num_transfers == transfers, (coll, world)


def test_which_calls_run_in_one_pass(monkeypatch):
    from dtrain.comm.peer import kernels

    monkeypatch.setitem(fused._state, "present", True)  # as on a GPU whose torch has the kernels
    monkeypatch.delenv("DTRAIN_COMM_ONE_PASS", raising=False)  # on by default
    rs, small, cap = Collective.REDUCE_SCATTER, 1 << 20, fused.ONE_PASS_MAX_BYTES
    # without Triton a reduce-scatter's pass is torch's one-shot kernel, which takes whole 4-byte words only
    monkeypatch.setattr(kernels, "triton_ready", lambda: False)
    assert fused.one_pass_form(rs, "direct", torch.bfloat16, "sum", CUDA, small) is None
    assert fused.one_pass_form(rs, "direct", torch.float32, "sum", CUDA, small) == "scatter"
    monkeypatch.setattr(kernels, "triton_ready", lambda: True)  # as on a GPU with Triton
    for (coll, algorithm), form in fused.ONE_PASS.items():
        assert fused.one_pass_form(coll, algorithm, torch.bfloat16, "sum", CUDA, small) == form
        assert fused.one_pass_form(coll, algorithm, torch.bfloat16, "sum", CUDA, cap) == form
        assert fused.one_pass_form(coll, algorithm, torch.bfloat16, "sum", CUDA, cap + 1) is None  # a round a time
        assert fused.one_pass_form(coll, algorithm, torch.float32, "sum", CPU, small) is None
        assert fused.one_pass_form(coll, "ring", torch.float32, "sum", CUDA, small) is None
    assert fused.one_pass_form(rs, "direct", torch.float32, "avg", CUDA, small) == "scatter"
    assert fused.one_pass_form(rs, "direct", torch.float32, "max", CUDA, small) is None  # the kernel only sums
    assert fused.one_pass_form(rs, "direct", torch.float16, "sum", CUDA, small) is None
    rd = Collective.REDUCE  # the reduce's root sums with the same kernel, the same sums
    assert fused.one_pass_form(rd, "star", torch.float32, "avg", CUDA, small) == "rooted"
    assert fused.one_pass_form(rd, "star", torch.float32, "max", CUDA, small) is None
    assert fused.one_pass_form(rd, "star", torch.int32, "sum", CUDA, small) is None
    assert api._one_pass_or_native(rd, "auto", "star", torch.float32, "prod", CUDA, small) == "native"
    assert fused.one_pass_form(Collective.ALL_GATHER, "direct", torch.int64, "sum", CUDA, small) == "gather"  # copies
    # auto falls back to NCCL's where its rule names a one-pass schedule the call cannot run in one pass
    assert api._one_pass_or_native(rs, "auto", "direct", torch.float32, "max", CUDA, small) == "native"
    assert api._one_pass_or_native(rs, "auto", "direct", torch.float32, "sum", CUDA, small) == "direct"
    assert api._one_pass_or_native(rs, "direct", "direct", torch.float32, "max", CUDA, small) == "direct"  # as named
    # above the one-pass range a rule naming the schedule means the round-at-a-time plan it measured
    assert api._one_pass_or_native(rs, "auto", "direct", torch.float32, "max", CUDA, cap + 1) == "direct"
    assert api._one_pass_or_native(rs, "auto", "direct", torch.float32, "max", CPU, small) == "direct"
    monkeypatch.setenv("DTRAIN_COMM_ONE_PASS", "0")  # turned off: the rules measured the one pass, NCCL's runs
    assert all(fused.one_pass_form(c, a, torch.bfloat16, "sum", CUDA, small) is None for c, a in fused.ONE_PASS)
    assert api._one_pass_or_native(rs, "auto", "direct", torch.float32, "sum", CUDA, small) == "native"
    monkeypatch.setenv("DTRAIN_COMM_ONE_PASS", "1")
    monkeypatch.setenv("DTRAIN_COMM_FUSED", "0")
    assert fused.one_pass_form(Collective.ALL_GATHER, "direct", torch.float32, "sum", CUDA, small) is None
    ag = Collective.ALL_GATHER
    assert api._one_pass_or_native(ag, "auto", "direct", torch.float32, "sum", CUDA, small) == "native"
    monkeypatch.delenv("DTRAIN_COMM_FUSED")
    monkeypatch.setitem(fused._state, "present", False)  # a torch without the kernels
    assert fused.one_pass_form(Collective.BROADCAST, "star", torch.float32, "sum", CUDA, small) is None


class _CudaLike:
    """What :func:`api._declined` reads of a CUDA tensor (none can be made without a GPU)."""

    is_cuda = True

    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4


def test_auto_runs_nccl_where_the_one_pass_it_chose_declines():
    """A call ``auto`` gave a one-pass schedule that :func:`api._one_pass` could not run (a timeout, the group off
    the peer transport: the same on every rank) runs NCCL's collective; CPU calls and sizes above the one-pass
    range keep the schedule, which the rules measured a round at a time."""
    small, big = _CudaLike(256), _CudaLike(fused.ONE_PASS_MAX_BYTES // 4 + 1)
    assert api._declined(Collective.ALL_GATHER, "auto", "direct", small)
    assert api._declined(Collective.BROADCAST, "auto", "star@peer", small)
    assert not api._declined(Collective.BROADCAST, "auto", "ring", small)  # not a one-pass schedule
    assert not api._declined(Collective.ALL_GATHER, "direct", "direct", small)  # named: the plan runs
    assert not api._declined(Collective.ALL_GATHER, "auto", "direct", torch.empty(256))  # CPU
    assert not api._declined(Collective.REDUCE_SCATTER, "auto", "direct", big)


def _each_rank(rank_main, world: int) -> None:
    """``rank_main(rank)`` on one thread a rank, until every thread ends (30 s at most each)."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


class _Handle:
    def __init__(self, gate: threading.Barrier) -> None:
        self.gate = gate

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.gate.wait(timeout=10)


class _Window:
    """A CPU stand-in for a CUDA PeerWindow: every rank's buffer in one process, the barrier a thread barrier."""

    def __init__(self, rank: int, buffers: list[torch.Tensor], gate: threading.Barrier, by_address: str) -> None:
        self.rank, self.world_size, self.buffers = rank, len(buffers), buffers
        self.pointers = torch.tensor([b.data_ptr() for b in buffers]) if by_address else None
        # the signal pads' addresses: any distinct numbers do for the stand-in, which never reads them
        self.pads = torch.arange(len(buffers)) + 1 if by_address == "one kernel" else None
        self.channels = 2048 // (4 * len(buffers))
        self.nbytes, self._mine, self._handle = buffers[rank].numel(), buffers[rank], _Handle(gate)
        self.group_name, self.bank, self.pending, self.device = "stand-in", 0, False, torch.device("cpu")

    def stall_limit(self, timeout):
        return timedelta(seconds=10)

    def barrier(self) -> None:
        self._handle.barrier()


def test_the_gather_kernel_copies_in_the_widest_word_that_divides_offset_size_and_address():
    assert kernels.word_bytes(0, 24, 1 << 20) == 8
    assert kernels.word_bytes(20, 40, 256) == 4
    assert kernels.word_bytes(0, 6, 512) == 2
    assert kernels.word_bytes(8, 16, 513) == 1


@pytest.mark.parametrize(
    ("world", "by_address", "m"),
    [(2, "", 6), (4, "", 6), (2, "gather", 6), (4, "gather", 5), (2, "one kernel", 6), (4, "one kernel", 5)],
)
def test_one_pass_gives_each_collectives_result_call_after_call(monkeypatch, world, by_address, m):
    """Through the peers' windows as tensors (``by_address`` empty: the copies of a torch without Triton) and
    through their addresses: the gather kernel after a copy in and a barrier, or the exchange kernel that does all
    three (here CPU stand-ins that look the addresses up and copy the bytes the kernels would: the offsets, block
    sizes and sources one_pass gives them, a thread barrier for the signal pads)."""
    buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in range(world)]
    gate = threading.Barrier(world)
    at_address = {b.data_ptr(): b for b in buffers}
    copies: list[int] = []
    kinds: list[str] = []

    def exchange(pointers, pads, rank, nbytes, world_, form, spins, programs=32, root=0, dtype=None):
        assert world_ == world and len(pads) == world and programs == min(256 // world, 128)
        assert spins >= 10_000  # the group's limit of 10 s: a microsecond or more a round
        blocks = world if form in ("exchange", "scatter", "scatter_from") else 1

        def launch(out, inp, at):
            window = at_address[int(pointers[rank])]
            assert form != "relay" or world > 2  # two ranks: the broadcast form
            if form not in ("broadcast", "relay", "scatter_from") or rank == root:
                window[at : at + blocks * nbytes].copy_(inp.view(-1).view(torch.uint8))
            gate.wait(timeout=10)
            flat = out.view(-1).view(torch.uint8)
            if form == "scatter":
                source = slice(at + rank * nbytes, at + (rank + 1) * nbytes)
                out.copy_(sum(at_address[int(p)][source].view(dtype) for p in pointers))
            elif form == "rooted":
                if rank == root:
                    out.copy_(sum(at_address[int(p)][at : at + nbytes].view(dtype) for p in pointers))
            elif form == "scatter_from":
                source = at + rank * nbytes
                flat.copy_(at_address[int(pointers[root])][source : source + nbytes])
            elif form == "gather_to":
                if rank == root:
                    for r in range(world):
                        flat[r * nbytes : (r + 1) * nbytes].copy_(at_address[int(pointers[r])][at : at + nbytes])
            elif form in ("broadcast", "relay"):
                if form == "relay":
                    gate.wait(timeout=10)  # its second barrier
                if rank != root:
                    flat.copy_(at_address[int(pointers[root])][at : at + nbytes])
            else:
                source = at + (rank * nbytes if blocks > 1 else 0)
                for r in range(world):
                    flat[r * nbytes : (r + 1) * nbytes].copy_(at_address[int(pointers[r])][source : source + nbytes])
            copies.append(kernels.word_bytes(at, nbytes, out.data_ptr(), inp.data_ptr()))
            kinds.append("one kernel" if form != "relay" else "relay kernel")
            return True

        return launch

    monkeypatch.setattr(kernels, "exchange", exchange)

    def gather(out, pointers, offset, nbytes, blocks, root=-1):
        flat = out.view(-1).view(torch.uint8)
        for r in range(blocks):
            source = at_address[int(pointers[root if root >= 0 else r])]
            flat[r * nbytes : (r + 1) * nbytes].copy_(source[offset : offset + nbytes])
        copies.append(kernels.word_bytes(offset, nbytes, out.data_ptr()))
        kinds.append("gather")
        return True

    monkeypatch.setattr(kernels, "gather", gather)

    def reduce_block(block, group_name, out):  # the one-shot kernel: a barrier, the sum over peers, a barrier
        gate.wait(timeout=10)
        at, n = block.storage_offset(), block.numel()
        out.copy_(sum(b.view(block.dtype)[at : at + n] for b in buffers))
        gate.wait(timeout=10)

    monkeypatch.setattr(fused, "reduce_block", reduce_block)
    failures = []

    def rank_main(rank: int) -> None:
        try:
            passes(rank)
        except Exception as err:  # a rank that fails fails the test
            failures.append((rank, repr(err)))
            gate.abort()

    def passes(rank: int) -> None:
        window = _Window(rank, buffers, gate, by_address)
        runs = {
            form: fused.one_pass(form, window, torch.float32, m * (1 if form == "gather" else world), root=world - 1)
            for form in ("gather", "scatter", "exchange", "broadcast", "relay", "rooted", "gather_to")
        }
        runs["scatter_from"] = fused.one_pass("scatter_from", window, torch.float32, m * world, root=world - 1)
        for call in range(3):  # the halves alternate; every call must still see this call's data
            base = 100 * call + 10 * rank
            part = torch.arange(m, dtype=torch.float32) + base
            full = torch.arange(m * world, dtype=torch.float32) + base
            out = torch.empty(m * world)
            runs["gather"](out, part)
            want = torch.cat([torch.arange(m, dtype=torch.float32) + 100 * call + 10 * r for r in range(world)])
            block = torch.empty(m)
            runs["scatter"](block, full)
            summed = sum(torch.arange(m * world, dtype=torch.float32) + 100 * call + 10 * r for r in range(world))
            swapped = torch.empty(m * world)
            runs["exchange"](swapped, full)
            mine = slice(rank * m, (rank + 1) * m)
            theirs = torch.cat(
                [(torch.arange(m * world, dtype=torch.float32) + 100 * call + 10 * r)[mine] for r in range(world)]
            )
            sent = full.clone()
            runs["broadcast"](sent, sent)
            relayed = full.clone()
            runs["relay"](relayed, relayed)
            reduced = full.clone()
            runs["rooted"](reduced, reduced)
            collected = torch.full((m * world * world,), -1.0) if rank == world - 1 else full.clone()
            runs["gather_to"](collected, full)  # a rank but the root: its input stands in for the output
            dealt = torch.full((m,), -1.0)
            runs["scatter_from"](dealt, full if rank == world - 1 else dealt)
            everyone = torch.cat(
                [torch.arange(m * world, dtype=torch.float32) + 100 * call + 10 * r for r in range(world)]
            )
            root = torch.arange(m * world, dtype=torch.float32) + 100 * call + 10 * (world - 1)
            ok = (
                torch.equal(out, want),
                torch.equal(block, summed[mine]),
                torch.equal(swapped, theirs),
                torch.equal(sent, root),
                torch.equal(relayed, root),
                torch.equal(reduced, summed if rank == world - 1 else full),  # written on the root alone
                torch.equal(collected, everyone if rank == world - 1 else full),
                torch.equal(dealt, root[mine]),
            )
            if not all(ok):
                failures.append((rank, call, ok))

    _each_rank(rank_main, world)
    assert not failures
    # by address: the all-gather and the all-to-all of 3 calls on every rank through the gather kernel, and the
    # reduce-scatter, both broadcasts, the reduce, the gather and the scatter too through the exchange kernel (two
    # ranks: the relay as the broadcast form); a block of 5 float32 elements is copied in 4-byte words
    assert len(copies) == {"": 0, "gather": 3 * 2 * world, "one kernel": 3 * 8 * world}[by_address]
    assert not copies or min(copies) == (8 if m % 2 == 0 else 4)
    relay = {"relay kernel"} if by_address == "one kernel" and world > 2 else set()
    assert set(kinds) == ({by_address} | relay if by_address else set())


def test_a_one_pass_call_is_kept_under_the_key_its_next_call_asks_for():
    # all_gather and all_to_all ask _fast with nothing besides the tensors, reduce_scatter with its op,
    # broadcast with its root: a one-pass call kept under another key would go the long way every time
    assert api._kept_extra(Collective.ALL_GATHER, "sum", 0) is None
    assert api._kept_extra(Collective.ALL_TO_ALL, "sum", 0) is None
    assert api._kept_extra(Collective.REDUCE_SCATTER, "avg", 0) == "avg"
    assert api._kept_extra(Collective.BROADCAST, "sum", 3) == 3
    assert api._kept_extra(Collective.REDUCE, "avg", 1) == (1, "avg")  # as comm.reduce asks _fast
    assert api._kept_extra(Collective.GATHER, "sum", 2) == 2 and api._kept_extra(Collective.SCATTER, "sum", 0) == 0


def test_a_repeated_call_runs_what_the_first_kept(pool):
    answers = pool.run(jobs.repeated_calls_take_the_kept_path, ranks=2)
    for answer in answers:
        assert answer["right"] and answer["kept"]
        # each collective resolved once: the second call of each went the short way
        assert sorted(answer["resolved"]) == sorted(
            ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"]
        )
        # Gloo's own calls (auto is native here): the second of each through the process group's binding, not
        # torch.distributed's functions
        assert answer["through_torch"] == []


@pytest.mark.parametrize(("form", "kernel_form"), [("one", "reduce"), ("two", "two_shot")])
def test_the_all_reduces_through_the_exchange_kernel_alternate_halves_and_sum_in_place(monkeypatch, form, kernel_form):
    """fused.run_fused's one-shot and two-shot forms through the exchange kernel (here a CPU stand-in: this rank's
    tensor into its window at the offset given, a thread barrier, the sum of every window there back into the
    tensor; the two-shot kernel is given a rank's block): each call lands in the other half of the window and
    leaves its peers reading (pending), and every rank ends with the sum, call after call; a window without two
    halves of room for the tensor declines it, and the two-shot kernel a tensor the ranks' blocks do not divide."""
    world, m = 3, 12
    buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in range(world)]
    gate = threading.Barrier(world)
    at_address = {b.data_ptr(): b for b in buffers}
    offsets: list[int] = []
    blocks = world if form == "two" else 1

    def exchange(pointers, pads, rank, nbytes, world_, kind, spins, programs=32, root=0, dtype=None):
        assert kind == kernel_form and world_ == world and dtype == torch.float32 and nbytes == m * 4 // blocks
        channels = 2048 // (4 * world)  # the stand-in pad's
        assert programs == (min(256, channels) if form == "two" else min(256 // world, 128, channels))
        nbytes *= blocks

        def launch(out, inp, at):
            at_address[int(pointers[rank])][at : at + nbytes].copy_(inp.view(torch.uint8))
            gate.wait(timeout=10)
            total = sum(at_address[int(p)][at : at + nbytes].view(dtype) for p in pointers)
            gate.wait(timeout=10)  # every rank has read before any writes its result over its input
            out.copy_(total)
            offsets.append(at)
            return True

        return launch

    monkeypatch.setattr(kernels, "exchange", exchange)
    failures, states = [], []

    def rank_main(rank: int) -> None:
        try:
            window = _Window(rank, buffers, gate, "one kernel")
            for call in range(3):
                work = torch.arange(m, dtype=torch.float32) + 10 * rank + call
                fused.run_fused(form, work, window)
                want = sum(torch.arange(m, dtype=torch.float32) + 10 * r + call for r in range(world))
                if not torch.equal(work, want):
                    failures.append((rank, call))
                states.append((window.bank, window.pending))
            small = _Window(rank, [b[:64] for b in buffers], gate, "one kernel")
            assert fused.reducer(small, torch.zeros(m), form) is None  # 48 bytes do not fit twice in 64
            if form == "two":
                assert fused.reducer(window, torch.zeros(m + 1), form) is None  # blocks of 13 / 3 elements
        except Exception as err:  # a rank that fails fails the test
            failures.append((rank, repr(err)))
            gate.abort()

    _each_rank(rank_main, world)
    assert not failures
    half = 4096 // 2 // fused.ALIGN * fused.ALIGN
    assert sorted(set(offsets)) == [0, half] and len(offsets) == 3 * world
    assert all(pending for _, pending in states)


@pytest.mark.parametrize(
    ("world", "form", "numel", "dtype", "programs"),
    [(2, "gather", 700, "float32", 4), (3, "exchange", 301, "float32", 2), (3, "broadcast", 701, "float32", 3),
     (4, "scatter", 250, "bfloat16", 4), (3, "reduce", 333, "float32", 2), (3, "two_shot", 301, "float32", 3),
     (4, "two_shot", 130, "bfloat16", 2), (3, "relay", 701, "float32", 3),
     (4, "relay", 517, "bfloat16", 2), (3, "rooted", 333, "float32", 2), (2, "rooted", 130, "bfloat16", 3),
     (3, "gather_to", 301, "float32", 2), (4, "scatter_from", 257, "bfloat16", 3)],
)  # fmt: skip
def test_the_exchange_kernel_under_tritons_interpreter_across_processes(tmp_path, world, form, numel, dtype, programs):
    """The exchange kernel itself, its signal-pad barrier included, run by Triton's interpreter in one process a
    rank over windows and pads in /dev/shm that every rank maps (where Triton is installed: GPU machines; CUDA's
    own runs are `dtrain bench verify`'s). A barrier that let a program read before its peers wrote would fail
    it. Rank 1's tensors sit one element into their buffers where the form copies words wider than an element,
    so every rank must copy in the same word whatever its own tensors' addresses."""
    pytest.importorskip("triton")
    import multiprocessing
    import os
    import uuid

    from tests.jobs import exchange

    stem = f"/dev/shm/dtrain-test-{uuid.uuid4().hex[:8]}"
    for r in range(world):
        with open(f"{stem}-w{r}", "wb") as f:
            f.write(b"\0" * 2 * exchange.HALF)
        with open(f"{stem}-p{r}", "wb") as f:
            f.write(b"\0" * exchange.PAD)
    context = multiprocessing.get_context("spawn")
    os.environ["TRITON_INTERPRET"] = "1"  # read by the children at their first import of triton
    ranks = []
    try:
        ranks = [
            context.Process(target=exchange.run_rank, args=(r, world, stem, form, numel, dtype, programs, True))
            for r in range(world)
        ]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=120)
        assert [p.exitcode for p in ranks] == [0] * world
    finally:
        for p in ranks:
            if p.is_alive():  # a rank left waiting at a barrier its peers failed before
                p.kill()
        del os.environ["TRITON_INTERPRET"]
        for r in range(world):
            for kind in "wp":
                if os.path.exists(f"{stem}-{kind}{r}"):
                    os.unlink(f"{stem}-{kind}{r}")


def test_the_exchange_kernel_faults_when_a_peer_never_comes(tmp_path):
    """Under Triton's interpreter (where Triton is installed): a rank alone at the kernel's barrier waits its
    rounds, then its process ends by a fault, as torch's device barrier traps, instead of reading peers that never
    wrote and going on with the signal pads out of step."""
    pytest.importorskip("triton")
    import multiprocessing
    import os
    import uuid

    from tests.jobs import exchange

    stem = f"/dev/shm/dtrain-test-{uuid.uuid4().hex[:8]}"
    for r in range(2):
        with open(f"{stem}-w{r}", "wb") as f:
            f.write(b"\0" * 2 * exchange.HALF)
        with open(f"{stem}-p{r}", "wb") as f:
            f.write(b"\0" * exchange.PAD)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        rank = multiprocessing.get_context("spawn").Process(target=exchange.alone, args=(stem, 2, 50))
        rank.start()
        rank.join(timeout=120)
        assert rank.exitcode is not None and rank.exitcode < 0  # ended by a signal, not returned
    finally:
        del os.environ["TRITON_INTERPRET"]
        for r in range(2):
            for kind in "wp":
                if os.path.exists(f"{stem}-{kind}{r}"):
                    os.unlink(f"{stem}-{kind}{r}")


@pytest.mark.parametrize(
    ("form", "blocks"), [(0, 1), (0, 4), (1, 1), (2, 4), (3, 1), (4, 4), (5, 1), (6, 1), (7, 1), (8, 4)]
)
def test_the_exchange_kernel_compiles_for_hopper_with_system_scope_signals(form, blocks):
    """Every form of the exchange kernel compiles to an sm_90 binary (Triton's own ptxas, no GPU needed; where
    Triton is installed), its signals compare-and-swaps with release and acquire semantics at system scope, and
    its barrier's fault path (a load far outside any mapping) kept."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dtrain.comm.peer import triton as kernel_source

    words = {"ptrs": "*i64", "pads": "*i64", "out": "*i64", "inp": "*i64"}
    scalars = {"rank": "i32", "at": "i64", "n": "i64", "spins": "i32", "root": "i32"}
    constants = {"WORLD": 4, "LANES": 4, "BLOCKS": blocks, "FORM": form, "BLOCK": 2048}
    source = ASTSource(
        fn=kernel_source.exchange_kernel,
        signature={**words, **scalars, **dict.fromkeys(constants, "constexpr")},
        constexprs=constants,
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]
    assert "atom.global.release.sys.cas.b32" in ptx and "atom.global.acquire.sys.cas.b32" in ptx
    assert str(8 << 40) in ptx  # the fault's byte offset: 2**40 int64 slots past the pads' addresses


def test_auto_takes_the_two_shot_only_where_the_exchange_kernel_runs_it(monkeypatch):
    """The rules measured the two-shot all-reduce as the exchange kernel: a size the ranks' blocks do not divide,
    one past the kernel's limit, or a process without Triton would run torch's two-shot kernel, slower than NCCL's,
    so `auto` runs NCCL's there; the one-shot is unaffected."""
    monkeypatch.setitem(kernels._state, "kernel", object())  # as where Triton compiled the kernel
    assert fused.measured("direct", torch.zeros(1024), 4)
    assert not fused.measured("direct", torch.zeros(1026), 4)  # blocks of 256.5 elements
    big = fused.TWO_SHOT_MAX_BYTES // 4 + 4
    assert not fused.measured("direct", torch.empty(big), 4)
    assert fused.measured("one_shot", torch.zeros(1026), 4)
    monkeypatch.setitem(kernels._state, "kernel", None)  # no Triton
    assert not fused.measured("direct", torch.zeros(1024), 4)
