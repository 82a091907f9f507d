"""Jobs for tests/comm/test_peer_channels.py: peer channels between Gloo processes (windows in /dev/shm)."""

from __future__ import annotations

import torch

from dtrain.comm.peer.channels import Channel, PeerChannels
from dtrain.testing.pool import group_of

# (shape, dtype) of the k-th message, cycling: a scalar, 16-bit floats, 64-bit ints, booleans, bytes
SHAPES = [
    ((), torch.float32),
    ((5, 3), torch.bfloat16),
    ((100,), torch.int64),
    ((7,), torch.bool),
    ((2, 2, 2), torch.uint8),
]


def _message(sender: int, k: int) -> torch.Tensor:
    shape, dtype = SHAPES[k % len(SHAPES)]
    g = torch.Generator().manual_seed(100 * sender + k)
    values = torch.randn(shape, generator=g) * 50
    return values > 0 if dtype == torch.bool else values.to(dtype)


def ring(p: int, messages: int, slots: int) -> list[bool]:
    """Each rank sends the next ``messages`` messages through a ring of ``slots`` slots, posting all its receives
    first and taking them last to first (a take brings the ones before it out of the ring too); returns, per
    message, whether it arrived equal to what was sent."""
    group = group_of(p)
    rank = torch.distributed.get_rank(group)
    prv = (rank - 1) % p
    chans = PeerChannels(group, torch.device("cpu"), [Channel(r, (r + 1) % p, 1024, slots) for r in range(p)])
    ok = []
    done = 0
    while done < messages:
        batch = range(done, min(messages, done + slots))  # a full ring at most: the sender never waits on itself
        for k in batch:
            chans.send(rank, _message(rank, k))
        posted = [chans.post(prv, *SHAPES[k % len(SHAPES)]) for k in batch]
        got = [r.wait() for r in reversed(posted)][::-1]
        ok += [torch.equal(g, _message(prv, k)) for g, k in zip(got, batch, strict=True)]
        done += len(batch)
    torch.distributed.barrier(group)
    return ok


def refusals() -> list[str]:
    """What a bad channel, a message larger than its slot and a send on another rank's channel say."""
    group = group_of(2)
    rank = torch.distributed.get_rank(group)
    out = []
    try:
        PeerChannels(group, torch.device("cpu"), [Channel(0, 0, 8, 1)])
    except ValueError as err:
        out.append(str(err))
    chans = PeerChannels(group, torch.device("cpu"), [Channel(0, 1, 8, 1), Channel(1, 0, 8, 1)])
    try:
        chans.send(rank, torch.zeros(3, dtype=torch.float32))  # 12 bytes into 8
    except ValueError as err:
        out.append(str(err))
    try:
        chans.send(1 - rank, torch.zeros(1))  # the other rank's channel
    except ValueError as err:
        out.append(str(err))
    torch.distributed.barrier(group)
    return out


def stalls() -> str:
    """Rank 1 waits for a message rank 0 never sends, past a short limit; then rank 0 waits alone at a window
    barrier that rank 1 reaches late. Returns what each wait said."""
    import time
    from datetime import timedelta

    group = group_of(2)
    rank = torch.distributed.get_rank(group)
    chans = PeerChannels(group, torch.device("cpu"), [Channel(0, 1, 64, 2)])
    chans._timeout = timedelta(seconds=0.2)
    said = ""
    if rank == 1:
        try:
            chans.post(0, (4,), torch.float32).wait()
        except RuntimeError as err:
            said = str(err)
    torch.distributed.barrier(group)
    if rank == 0:
        try:
            chans.window.barrier(timeout=timedelta(seconds=0.2))
        except RuntimeError as err:
            said = str(err)
    else:
        time.sleep(1.0)
        chans.window.barrier()  # rank 0's counter is already there: passes
    torch.distributed.barrier(group)
    return said


def rounds(p: int, rounds: int, sizes: list[int], slots: int) -> list[bool]:
    """Each rank sends its successor ``rounds`` rounds of messages (round ``r`` has ``sizes[r % len(sizes)]``
    messages, at most ``slots``, the last marked) and then takes its predecessor's round, posted whole and taken
    from the last message back (a take brings the ones before it out too); a round's first message waits until
    the round before was taken. Returns per message whether it arrived equal to what was sent."""
    group = group_of(p)
    rank = torch.distributed.get_rank(group)
    prv = (rank - 1) % p
    chans = PeerChannels(group, torch.device("cpu"), [Channel(r, (r + 1) % p, 1024, slots) for r in range(p)])
    ok, k = [], 0
    for r in range(rounds):
        count = sizes[r % len(sizes)]
        batch = range(k, k + count)
        for i, j in enumerate(batch):
            chans.send(rank, _message(rank, j), last=i == count - 1)
        posted = [chans.post(prv, *SHAPES[j % len(SHAPES)], last=i == count - 1) for i, j in enumerate(batch)]
        got = [q.wait() for q in reversed(posted)][::-1]
        ok += [torch.equal(g, _message(prv, j)) for g, j in zip(got, batch, strict=True)]
        k += count
    torch.distributed.barrier(group)
    return ok


def lent_rounds(p: int, rounds: int, sizes: list[int], slots: int) -> dict:
    """As :func:`rounds`, every message taken lent (the slot itself, given back by ``release`` at the round's end):
    per message whether it arrived equal, whether it lay in this rank's window, and whether it still held its
    value after a pause in which its sender tried to send the next round; and what lending past a round's slots
    says."""
    import time

    group = group_of(p)
    rank = torch.distributed.get_rank(group)
    prv = (rank - 1) % p
    chans = PeerChannels(group, torch.device("cpu"), [Channel(r, (r + 1) % p, 1024, slots) for r in range(p)])
    window = chans.window.local(torch.uint8, chans.window.nbytes)
    start, end = window.data_ptr(), window.data_ptr() + window.numel()
    equal, inside, kept, k = [], [], [], 0
    for r in range(rounds):
        count = sizes[r % len(sizes)]
        batch = range(k, k + count)
        for i, j in enumerate(batch):
            chans.send(rank, _message(rank, j), last=i == count - 1)
        posted = [
            chans.post(prv, *SHAPES[j % len(SHAPES)], last=i == count - 1, lend=True) for i, j in enumerate(batch)
        ]
        got = [q.wait() for q in posted]
        equal += [torch.equal(g, _message(prv, j)) for g, j in zip(got, batch, strict=True)]
        inside += [start <= g.data_ptr() < end for g in got]
        time.sleep(0.2)  # the predecessor, done with its round, tries to send the next one meanwhile
        kept += [torch.equal(g, _message(prv, j)) for g, j in zip(got, batch, strict=True)]
        chans.release()
        k += count
    said = ""
    for _ in range(slots):
        chans.post(prv, (1,), torch.float32, lend=True)
    try:
        chans.post(prv, (1,), torch.float32, lend=True)
    except ValueError as err:
        said = str(err)
    torch.distributed.barrier(group)
    return {"equal": equal, "inside": inside, "kept": kept, "said": said}


def windows_laid_out_apart() -> list[str]:
    """Ranks 0 and 1 on the CPU: windows of different sizes, then channels over which the two ranks disagree (rank 0
    four slots of 64 bytes, rank 1 two of 512: windows of one size), then channels they agree on, three messages.
    Returns what each attempt raised, or what the last one received."""
    import torch.distributed as dist

    from dtrain.comm.peer.window import PeerWindow

    group = group_of(2)
    rank = dist.get_rank(group)
    got = []
    for make in (
        lambda: PeerWindow(group, torch.device("cpu"), 4096 if rank == 0 else 8192),
        lambda: PeerChannels(
            group, torch.device("cpu"), [Channel(0, 1, 64, 4) if rank == 0 else Channel(0, 1, 512, 2)]
        ),
    ):
        try:
            make()
            got.append("ok")
        except ValueError as err:
            got.append(f"ValueError: {err}")
    channels = PeerChannels(group, torch.device("cpu"), [Channel(0, 1, 64, 4)])
    taken = []
    for k in range(3):
        if rank == 0:
            channels.send(0, torch.full((16,), float(k)))
        else:
            taken.append(channels.post(0, (16,), torch.float32).wait()[0].item())
    got.append(str(taken))
    return got
