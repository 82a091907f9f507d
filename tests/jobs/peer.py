"""Jobs for the peer-memory transport tests: the collective checks of tests.jobs.comm, run with
DTRAIN_COMM_TRANSPORT=peer (windows in /dev/shm, Gloo's monitored barrier between rounds)."""

from __future__ import annotations

import itertools
import os

import torch

from tests.jobs import comm as comm_jobs


def _with_peer(fn, *args, **kwargs):
    os.environ["DTRAIN_COMM_TRANSPORT"] = "peer"
    try:
        return fn(*args, **kwargs)
    finally:
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)


def check_collective(*args, **kwargs):
    return _with_peer(comm_jobs.check_collective, *args, **kwargs)


def check_collective_push(*args, **kwargs):
    os.environ["DTRAIN_COMM_PEER_MODE"] = "push"
    try:
        return _with_peer(comm_jobs.check_collective, *args, **kwargs)
    finally:
        os.environ.pop("DTRAIN_COMM_PEER_MODE", None)


def check_against_native(*args, **kwargs):
    return _with_peer(comm_jobs.check_against_native, *args, **kwargs)


def missing_peer(*args, **kwargs):
    return _with_peer(comm_jobs.missing_peer, *args, **kwargs)


def private_shm() -> str:
    """Rank 1 behaves as if it did not share /dev/shm with rank 0 (containers with one host name but private
    IPC); every rank must get a ValueError, and no window file may stay behind."""
    import datetime

    import torch
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm.peer import window as peer

    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30), use_local_synchronization=True)
    real = peer._has_size
    if rank == 1:
        peer._has_size = lambda path, nbytes: path.endswith(f"-{rank}") and real(path, nbytes)
    os.environ["DTRAIN_COMM_TRANSPORT"] = "peer"
    try:
        comm.all_reduce(torch.ones(8), group=group, algorithm="ring")
    except ValueError as err:
        return str(err)
    finally:
        peer._has_size = real
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return "no error"


def rendezvous_counts_differ() -> str:
    """Rank 0 has made one more window than the others (a subgroup's): the check that stands in front of
    torch's CUDA rendezvous must refuse on every rank instead of letting it hang."""
    import torch
    import torch.distributed as dist

    from dtrain.comm.peer import window as peer
    from dtrain.testing.pool import group_of

    saved = peer._RENDEZVOUS[0]
    if dist.get_rank() == 0:
        peer._RENDEZVOUS[0] += 1
    try:
        peer._same_rendezvous_count(group_of(3), torch.device("cpu"))
    except ValueError as err:
        return str(err)
    finally:
        peer._RENDEZVOUS[0] = saved
    return "no error"


def auto_falls_back_when_a_window_is_refused() -> dict:
    """``DTRAIN_COMM_TRANSPORT=auto`` on a group the peer transport would serve (the CUDA rule stood in for on
    the CPU), whose window is refused on every rank alike, as torch's rendezvous check refuses it: the call
    must still be right, over point-to-point, with a warning, and the group must stay there."""
    import warnings

    import torch
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm import api
    from dtrain.comm.peer import window as peer
    from dtrain.comm.state import group_state
    from dtrain.testing.pool import group_of

    group = group_of(3)
    real_default, real_map = peer.peer_default, peer.PeerWindow._map_shared_files
    peer.peer_default = lambda g, d: peer.peer_available(g, d)  # as on CUDA

    def refused(self):
        peer._same_rendezvous_count(self.group, self.device)  # every rank counts alike here: passes
        raise peer.PeerUnavailable("refused for the test")

    peer.PeerWindow._map_shared_files = refused
    peer.close_windows(group)  # an earlier test's window for this group would be found instead of made
    saved = os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    try:
        chose = api.transport_name(group, torch.device("cpu"))
        x = torch.full((10,), float(dist.get_rank() + 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_reduce(x, group=group, algorithm="ring")
        after = api.transport_name(group, torch.device("cpu"))
        return {
            "before": chose,
            "after": after,
            "right": bool((x == 6).all()),
            "warned": any("point-to-point transport from now on" in str(w.message) for w in caught),
        }
    finally:
        peer.peer_default, peer.PeerWindow._map_shared_files = real_default, real_map
        group_state(group).fell_back = False
        if saved is not None:
            os.environ["DTRAIN_COMM_TRANSPORT"] = saved


def reduce_scatter_without_a_copy(algorithm: str) -> dict:
    """A pushed reduce-scatter on 3 ranks: whether it ran out of place (the input read, the result written
    straight into the output), and whether the result is right and the input untouched."""
    import torch
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm.peer import window as peer
    from dtrain.testing.pool import group_of

    group, rank = group_of(3), dist.get_rank()
    seen = []
    real = peer.run_push

    def spy(*args, **kwargs):
        seen.append("out" in kwargs)
        return real(*args, **kwargs)

    peer.run_push = spy
    os.environ["DTRAIN_COMM_PEER_MODE"] = "push"
    try:
        x = torch.arange(12, dtype=torch.float32) * (rank + 1)
        before = x.clone()
        out = torch.empty(4)
        _with_peer(comm.reduce_scatter, out, x, group=group, algorithm=algorithm)
        want = (torch.arange(12, dtype=torch.float32) * 6)[rank * 4 : rank * 4 + 4]
        return {"out_of_place": seen == [True], "right": torch.equal(out, want), "input": torch.equal(x, before)}
    finally:
        peer.run_push = real
        os.environ.pop("DTRAIN_COMM_PEER_MODE", None)


def chain_broadcasts(world: int) -> list[str]:
    """The chain broadcast (dtrain.comm.peer.chain) on the group of ranks 0..world-1: in small pieces through
    rings of two slots (slots reused within a call), roots changing from call to call, each result against
    torch.distributed's broadcast of the same tensor; then through ``comm.broadcast(algorithm="ring")`` on the
    peer transport, which runs it in its own pieces (its size band moved down to these sizes). Returns the
    mismatches."""
    import torch
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm.peer import chain
    from dtrain.comm.peer.chain import ChainBroadcast
    from dtrain.comm.state import group_state
    from dtrain.testing.pool import group_of

    group = group_of(world)
    rank = dist.get_rank(group)
    device = torch.device("cpu")
    runner = ChainBroadcast(group, device, slot_bytes=256, slots=2)
    problems = []
    cases = [(0, 5000, 256), (world - 1, 777, 256), (1 % world, 1, 256), (0, 4096, 200), (world // 2, 3000, 128)]
    for call, (root, numel, piece) in enumerate(cases):
        g = torch.Generator().manual_seed(1000 * call + rank)
        mine = torch.randint(-(2**30), 2**30, (numel,), generator=g, dtype=torch.int32)
        want = mine.clone()
        dist.broadcast(want, dist.get_global_rank(group, root), group=group)
        got = mine.clone()
        runner(got.view(torch.uint8), root, piece)
        if not torch.equal(got, want):
            problems.append(f"chain world={world} call={call} root={root} bytes={4 * numel}: differs from torch's")
    os.environ["DTRAIN_COMM_TRANSPORT"] = "peer"
    saved, chain.CHAIN_FROM_BYTES = chain.CHAIN_FROM_BYTES, 1024  # the chain's band, moved down to these sizes
    try:
        for root, dtype in ((0, torch.float32), (world - 1, torch.bfloat16)):
            x = torch.arange(3 * 1024 + 5, dtype=dtype) * (rank + 1)
            want = x.clone()
            dist.broadcast(want, dist.get_global_rank(group, root), group=group)
            comm.broadcast(x, root, group=group, algorithm="ring")
            if not torch.equal(x, want):
                problems.append(f"comm.broadcast ring world={world} root={root} {dtype}: differs from torch's")
        if ("chain", device) not in group_state(group).windows:
            problems.append("comm.broadcast ring on the peer transport did not run the chain")
    finally:
        chain.CHAIN_FROM_BYTES = saved
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return problems


def chain_missing_peer(timeout_s: float) -> str:
    """Ranks 0 and 1, a fresh group with a ``timeout_s`` timeout, on the peer transport: one chain broadcast
    together (the chain's windows made), then rank 0 broadcasts from rank 1, which never calls. Returns
    "seconds|message" of the CommTimeoutError on rank 0, and whether the next call made the chain afresh."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm.peer import chain
    from dtrain.comm.state import group_state

    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)
    os.environ["DTRAIN_COMM_TRANSPORT"] = "peer"
    saved, chain.CHAIN_FROM_BYTES = chain.CHAIN_FROM_BYTES, 1024
    try:
        comm.broadcast(torch.ones(1024), 0, group=group, algorithm="ring")
        if rank == 1:
            return ""
        start = time.monotonic()
        try:
            comm.broadcast(torch.ones(1024), 1, group=group, algorithm="ring")
        except comm.CommTimeoutError as err:
            dropped = ("chain", torch.device("cpu")) not in group_state(group).windows
            return f"{time.monotonic() - start:.1f}|{err}|dropped={dropped}"
        return "no error"
    finally:
        chain.CHAIN_FROM_BYTES = saved
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)


def direct_mailbox(world: int) -> list[str]:
    """The direct broadcast's host mailbox (dtrain.comm.peer.direct.Mailbox) on ranks 0..world-1 as one chain
    passes it (from rank 0): rank 0 posts three rings' worth, a rank in the middle takes each post and posts its
    own, the last takes slowly, so the posters run a full ring ahead and wait. Every post must arrive whole and in
    order. Returns the mismatches."""
    import datetime
    import time

    import torch

    from dtrain.comm.peer.direct import MAIL_SLOTS, Mailbox
    from dtrain.testing.pool import group_of

    group = group_of(world)
    box = Mailbox(group, torch.device("cpu"))
    rank, prev = box.rank, box.rank - 1
    timeout = datetime.timedelta(seconds=30)
    problems = []
    for k in range(3 * MAIL_SLOTS):
        if rank > 0:
            if rank == world - 1 and k % 16 == 0:
                time.sleep(0.002)
            handle, offset, nbytes = box.take(timeout)
            if (handle, offset, nbytes) != (bytes([prev, k % 256]) * 32, 1000 * prev + k, 7 * k + 1):
                problems.append(f"rank {rank} post {k}: got offset {offset}, bytes {nbytes}")
        if rank < world - 1:
            box.post(bytes([rank, k % 256]) * 32, 1000 * rank + k, 7 * k + 1, timeout)
    return problems


def direct_mailbox_missing_post(timeout_s: float) -> str:
    """Ranks 0 and 1: rank 1 takes a post rank 0 never makes. Returns "seconds|message" on rank 1."""
    import datetime
    import time

    import torch

    from dtrain.comm.peer.chain import ChainStalled
    from dtrain.comm.peer.direct import Mailbox
    from dtrain.testing.pool import group_of

    box = Mailbox(group_of(2), torch.device("cpu"))
    if box.rank == 0:
        return ""
    start = time.monotonic()
    try:
        box.take(datetime.timedelta(seconds=timeout_s))
    except ChainStalled as err:
        return f"{time.monotonic() - start:.1f}|{err}"
    return "no error"


class SharedFileMemory:
    """Host memory standing in for a GPU's under the direct chain (dtrain.comm.peer.direct.CudaMemory's methods):
    tensors in /dev/shm files, an allocation named by its file's path and mapped by opening the file; a plan's
    copies and combining done by the host, its waits spinning on the counters in the CPU windows."""

    def __init__(self) -> None:
        self.files: list[tuple[int, int, str]] = []  # (address, bytes, path) of this rank's tensors
        self.kept: list[torch.Tensor] = []  # each alive to the end, so no address is used twice
        self.held: dict[int, torch.Tensor] = {}  # mapped address -> the mapping
        self.opened = 0
        self.closed = 0

    def tensor(self, numel: int, dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = f"/dev/shm/dtrain-test-direct-{os.getpid()}-{next(_FILES)}"
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 1))
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.files.append((t.data_ptr(), nbytes, path))
        self.kept.append(t)
        return t

    def buffer(self, nbytes: int) -> torch.Tensor:
        return self.tensor(nbytes, torch.uint8)

    def unlink(self) -> None:
        for _, _, path in self.files:
            if os.path.exists(path):
                os.unlink(path)

    def counters(self, window) -> list[int]:
        from dtrain.comm.peer.direct import COUNTER_BYTES

        window.buffers[window.rank][:COUNTER_BYTES].zero_()
        return [b.data_ptr() for b in window.buffers]

    def name(self, address: int) -> tuple[bytes, int]:
        from dtrain.comm.peer.direct import DirectRefused

        for start, nbytes, path in self.files:
            if start <= address < start + max(nbytes, 1):
                return path.encode().ljust(64, b"\0"), address - start
        raise DirectRefused(f"no shared file holds {address:#x}")

    def open(self, handle: bytes) -> int:
        path = handle.rstrip(b"\0").decode()
        t = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
        self.held[t.data_ptr()] = t
        self.opened += 1
        return t.data_ptr()

    def extent(self, address: int) -> int:
        return self.held[address].numel()

    def close(self, address: int) -> None:
        del self.held[address]
        self.closed += 1

    def capturing(self) -> bool:
        return False

    def view(self, address: int, nbytes: int, dtype) -> torch.Tensor:
        import ctypes

        return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)

    def run(self, ops, address: int, source: int, base: list[int], timeout, combine=None) -> None:
        import ctypes

        from dtrain.comm.peer.chain import ChainStalled
        from dtrain.comm.peer.direct import combine_into, piece_of
        from dtrain.comm.peer.window import spin_until

        for op in ops:
            if op.kind == "copy":
                ctypes.memmove(address + op.at, source + op.at, op.nbytes)
                continue
            if op.kind == "combine":
                peer = self.view(source + op.at, op.nbytes, combine.out.dtype)
                out, own = piece_of(combine.out, op.at, op.nbytes), piece_of(combine.own, op.at, op.nbytes)
                combine_into(out, own, peer, combine.op)
                continue
            cell = ctypes.c_uint32.from_address(base[op.rank] + 4 * op.counter)
            if op.kind == "write":
                cell.value = op.value
                continue

            def done(c=cell, v=op.value, exact=op.exact) -> bool:
                return c.value == v if exact else ((c.value - v) & 0xFFFFFFFF) < 0x80000000

            try:
                spin_until(done, lambda: timeout, lambda o=op: f"counter {o.counter} of rank {o.rank} at {o.value}")
            except RuntimeError as err:
                raise ChainStalled(str(err)) from err


_FILES = itertools.count()


def direct_broadcasts(world: int) -> list[str]:
    """The direct broadcast's executor (dtrain.comm.peer.direct.DirectChain) on ranks 0..world-1 over host
    memory (:class:`SharedFileMemory`), pieces of 256 bytes: roots changing from call to call, sizes within a piece
    and across several, the same tensors again and fresh ones, each result against torch.distributed's broadcast
    of the same data; the same tensors map nothing new, fresh ones past the cap evict the oldest mappings. Returns
    the mismatches."""
    import datetime

    import torch.distributed as dist

    from dtrain.comm.peer import direct
    from dtrain.comm.peer.direct import MAPPED_MAX, DirectChain
    from dtrain.testing.pool import group_of

    group = group_of(world)
    rank = dist.get_rank(group)
    memory = SharedFileMemory()
    saved, direct.pieces = direct.pieces, lambda nbytes, world: 256
    problems: list[str] = []
    try:
        chain = DirectChain(group, torch.device("cpu"), memory=memory)
        timeout = datetime.timedelta(seconds=60)
        same = memory.tensor(700, torch.int32)
        cases = [(0, 700, True), (world - 1, 700, True), (1 % world, 1, False), (0, 700, True)]
        cases.append((world // 2, 999, False))
        for call, (root, numel, reuse) in enumerate(cases):
            g = torch.Generator().manual_seed(100 * call + rank)
            data = torch.randint(-(2**30), 2**30, (numel,), generator=g, dtype=torch.int32)
            want = data.clone()
            dist.broadcast(want, dist.get_global_rank(group, root), group=group)
            t = same if reuse else memory.tensor(numel, torch.int32)
            t.copy_(data)
            dist.barrier(group=group)  # every tensor filled before any rank reads a peer's
            chain.broadcast(t, root, timeout)
            dist.barrier(group=group)
            if not torch.equal(t, want):
                problems.append(f"world={world} call={call} root={root} numel={numel}: differs from torch's")
        before = chain.mapped
        for _ in range(3):  # the same tensor again: nothing new to map
            dist.barrier(group=group)
            chain.broadcast(same, 0, timeout)
        if chain.mapped != before:
            problems.append(f"rank {rank}: the same tensors mapped {chain.mapped - before} more allocations")
        for k in range(MAPPED_MAX + 3):  # fresh tensors: a new allocation each call
            t = memory.tensor(64, torch.int32)
            t.fill_(k if rank == 0 else -1)
            dist.barrier(group=group)
            chain.broadcast(t, 0, timeout)
            if not torch.equal(t, torch.full((64,), k, dtype=torch.int32)):
                problems.append(f"rank {rank}: fresh tensor {k} differs")
        if rank != 0 and (chain.mapped != MAPPED_MAX or memory.closed < 3):
            problems.append(f"rank {rank}: {chain.mapped} mappings kept, {memory.closed} closed")
        dist.barrier(group=group)
        from dtrain.comm.peer.window import close_windows
        from dtrain.comm.state import group_state

        group_state(group).windows[("direct", torch.device("cpu"))] = chain
        held, closed = chain.mapped, memory.closed
        close_windows(group)  # forgetting the group's windows unmaps what the chain mapped
        if chain.mapped or memory.closed != closed + held:
            problems.append(f"rank {rank}: close_windows left {chain.mapped} of {held} mappings")
    finally:
        direct.pieces = saved
        dist.barrier(group=group)
        memory.unlink()
    return problems


def direct_reduces(world: int) -> list[str]:
    """The direct chain's reduce (dtrain.comm.peer.direct.DirectChain.reduce) on ranks 0..world-1 over host memory
    (:class:`SharedFileMemory`), pieces of 256 bytes: roots changing from call to call, every reduction, sizes
    within a piece and across several, the same tensors and fresh ones, broadcasts between the reduces on the same
    chain; each root's result against torch.distributed's reduce of the same data, every other rank's tensor as it
    was. Returns the mismatches."""
    import datetime

    import torch.distributed as dist

    from dtrain.comm.peer import direct
    from dtrain.comm.peer.direct import DirectChain
    from dtrain.testing.pool import group_of

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
    group = group_of(world)
    rank = dist.get_rank(group)
    memory = SharedFileMemory()
    saved, direct.pieces = direct.pieces, lambda nbytes, world: 256
    problems: list[str] = []
    try:
        chain = DirectChain(group, torch.device("cpu"), memory=memory)
        timeout = datetime.timedelta(seconds=60)
        same = memory.tensor(700, torch.int32)
        cases = [(0, "sum", 700, True), (world - 1, "max", 700, True), (1 % world, "sum", 1, False)]
        cases += [(world // 2, "min", 999, False), (0, "prod", 700, True), (world - 1, "sum", 700, False)]
        for call, (root, op, numel, reuse) in enumerate(cases):
            g = torch.Generator().manual_seed(100 * call + rank)
            low, high = (-3, 4) if op == "prod" else (-(2**20), 2**20)
            data = torch.randint(low, high, (numel,), generator=g, dtype=torch.int32)
            want = data.clone()
            dist.reduce(want, dist.get_global_rank(group, root), op=ops[op], group=group)
            t = same if reuse else memory.tensor(numel, torch.int32)
            t.copy_(data)
            dist.barrier(group=group)  # every tensor filled before any rank reads a peer's
            chain.reduce(t, root, op, timeout)
            dist.barrier(group=group)
            expect = want if rank == root else data
            if not torch.equal(t, expect):
                what = "differs from torch's" if rank == root else "was written"
                problems.append(f"world={world} call={call} root={root} op={op} numel={numel}: rank {rank} {what}")
            if call == 2:  # a broadcast between reduces, on the same chain and mailbox
                b = memory.tensor(300, torch.int32)
                b.fill_(7 if rank == 0 else -1)
                dist.barrier(group=group)
                chain.broadcast(b, 0, timeout)
                if not torch.equal(b, torch.full((300,), 7, dtype=torch.int32)):
                    problems.append(f"world={world}: rank {rank}'s broadcast between reduces differs")
        x = memory.tensor(2000, torch.float32)
        g = torch.Generator().manual_seed(rank)
        data = torch.randn(2000, generator=g)
        want = data.clone()
        dist.reduce(want, dist.get_global_rank(group, 0), group=group)
        x.copy_(data)
        dist.barrier(group=group)
        chain.reduce(x, 0, "sum", timeout)
        dist.barrier(group=group)
        if rank == 0 and not torch.allclose(x, want, rtol=1e-5, atol=1e-5):
            problems.append(f"world={world}: float32 sum differs from torch's")
        before = chain.mapped
        for _ in range(3):  # the same tensors again: nothing new to map, the middle ranks' partials reused
            dist.barrier(group=group)
            chain.reduce(same, 0, "sum", timeout)
        if chain.mapped != before:
            problems.append(f"rank {rank}: the same tensors mapped {chain.mapped - before} more allocations")
        dist.barrier(group=group)
    finally:
        direct.pieces = saved
        dist.barrier(group=group)
        memory.unlink()
    return problems


def direct_refused_mid_chain(world: int) -> list[str]:
    """Ranks 0..world-1 (three or more) over host memory: calls in which one rank cannot name its memory, each
    followed by a good call on the same chain. A broadcast from rank 0 where rank 1's tensor is private; a reduce
    into rank 0 whose first rank (1) passes a private tensor; a reduce into rank 0 where rank 2 (in the middle of
    the chain 1, 2, ..., 0) cannot name its partial buffer. Returns, per call, what this rank raised ("ok" where it
    raised nothing), and "good" or what differed for the calls after them: every rank after the one at fault along
    the chain raises, none waits for ever, and the next call runs."""
    import datetime

    import torch.distributed as dist

    from dtrain.comm.peer import direct
    from dtrain.comm.peer.direct import DirectChain, DirectRefused
    from dtrain.testing.pool import group_of

    group = group_of(world)
    rank = dist.get_rank(group)
    memory = SharedFileMemory()
    saved, direct.pieces = direct.pieces, lambda nbytes, world: 64
    timeout = datetime.timedelta(seconds=20)
    got: list[str] = []

    def attempt(fn) -> None:
        try:
            fn()
            got.append("ok")
        except DirectRefused as err:
            got.append(f"DirectRefused: {err}")

    def good_calls(tag: str) -> None:
        b = memory.tensor(100, torch.int32)
        b.fill_(5 if rank == 0 else -1)
        r = memory.tensor(100, torch.int32)
        r.fill_(rank + 1)
        dist.barrier(group=group)
        chain.broadcast(b, 0, timeout)
        chain.reduce(r, 0, "sum", timeout)
        dist.barrier(group=group)
        right = torch.equal(b, torch.full((100,), 5, dtype=torch.int32)) and torch.equal(
            r, torch.full((100,), world * (world + 1) // 2 if rank == 0 else rank + 1, dtype=torch.int32)
        )
        got.append(f"{tag} good" if right else f"{tag} differs")

    try:
        chain = DirectChain(group, torch.device("cpu"), memory=memory)
        t = torch.zeros(100, dtype=torch.int32) if rank == 1 else memory.tensor(100, torch.int32)
        dist.barrier(group=group)
        attempt(lambda: chain.broadcast(t, 0, timeout))
        good_calls("after the broadcast")
        t = torch.ones(100, dtype=torch.int32) if rank == 1 else memory.tensor(100, torch.int32).fill_(1)
        dist.barrier(group=group)
        attempt(lambda: chain.reduce(t, 0, "sum", timeout))
        good_calls("after the first rank's refusal")
        t = memory.tensor(100, torch.int32).fill_(1)
        named = memory.name
        if rank == 2:  # its partial buffer cannot be named; its own input is never exposed in a reduce
            memory.name = lambda address: (_ for _ in ()).throw(DirectRefused("the partial buffer is private"))
        dist.barrier(group=group)
        attempt(lambda: chain.reduce(t, 0, "sum", timeout))
        memory.name = named
        good_calls("after the middle rank's refusal")
    finally:
        direct.pieces = saved
        dist.barrier(group=group)
        memory.unlink()
    return got


def direct_refused() -> str:
    """Ranks 0 and 1: rank 0 broadcasts a tensor it cannot name (private memory, not a shared file). Returns the
    error each rank raised."""
    import datetime

    import torch.distributed as dist

    from dtrain.comm.peer.direct import DirectChain, DirectRefused
    from dtrain.testing.pool import group_of

    group = group_of(2)
    memory = SharedFileMemory()
    chain = DirectChain(group, torch.device("cpu"), memory=memory)
    t = torch.zeros(16) if dist.get_rank(group) == 0 else memory.tensor(16, torch.float32)
    try:
        chain.broadcast(t, 0, datetime.timedelta(seconds=10))
    except DirectRefused as err:
        return f"DirectRefused: {err}"
    finally:
        dist.barrier(group=group)
        memory.unlink()
    return "no error"


def direct_bad_posts() -> list[str]:
    """Ranks 0 and 1 over host memory: rank 0 posts its tensor's allocation with the offset moved past its end,
    then off the element size, then as it is, broadcasting and reducing 16 float32. Returns, per call, what this
    rank raised ("ok" where it raised nothing), then whether a good broadcast and reduce after them came out
    right."""
    import datetime

    import torch.distributed as dist

    from dtrain.comm.peer.direct import DirectChain
    from dtrain.testing.pool import group_of

    group = group_of(2)
    rank = dist.get_rank(group)
    memory = SharedFileMemory()
    timeout = datetime.timedelta(seconds=20)
    got: list[str] = []
    named = memory.name
    try:
        chain = DirectChain(group, torch.device("cpu"), memory=memory)
        for kind, root, shift in (("broadcast", 0, 64), ("broadcast", 0, 2), ("reduce", 1, 64), ("reduce", 1, 2)):
            t = memory.tensor(16, torch.float32).fill_(rank + 1)
            if rank == 0:
                memory.name = lambda address, s=shift: (named(address)[0], named(address)[1] + s)
            dist.barrier(group=group)
            try:
                chain.broadcast(t, root, timeout) if kind == "broadcast" else chain.reduce(t, root, "sum", timeout)
                got.append("ok")
            except ValueError as err:
                got.append(f"ValueError: {err}")
            memory.name = named
        b = memory.tensor(16, torch.float32).fill_(rank + 1)
        r = memory.tensor(16, torch.float32).fill_(rank + 1)
        dist.barrier(group=group)
        chain.broadcast(b, 0, timeout)
        chain.reduce(r, 1, "sum", timeout)
        right = torch.equal(b, torch.ones(16)) and torch.equal(r, torch.full((16,), 3.0 if rank == 1 else 1.0))
        got.append("good" if right else f"differs: {b.tolist()} {r.tolist()}")
    finally:
        memory.name = named
        dist.barrier(group=group)
        memory.unlink()
    return got


def window_named_by(tag: bytes) -> str:
    """Ranks 0 and 1 make a CPU window whose file name rank 0 sends as ``tag`` (its broadcast of the name carries
    those bytes instead of the name it made). Returns what this rank raised, or "ok" and where the files were."""
    import torch.distributed as dist

    from dtrain.comm.peer import window as peer_window
    from dtrain.testing.pool import group_of

    group = group_of(2)
    real = peer_window.dist

    class _Dist:  # rank 0's broadcast of the name sends ``tag``
        def __getattr__(self, name):
            return getattr(real, name)

        def broadcast(self, t, src, group=None):
            if dist.get_rank() == src and t.dtype == torch.uint8 and t.numel() == 64:
                t.copy_(torch.frombuffer(bytearray(tag), dtype=torch.uint8))
            return real.broadcast(t, src, group=group)

    peer_window.dist = _Dist()
    try:
        made = peer_window.PeerWindow(group, torch.device("cpu"), 256)
        made.barrier()
        return "ok"
    except ValueError as err:
        return f"ValueError: {err}"
    finally:
        peer_window.dist = real
        dist.barrier(group=group)
