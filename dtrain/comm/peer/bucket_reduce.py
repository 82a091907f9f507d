"""An averaging all-reduce of a step's gradient buckets over the ranks of one host, moved by copy engines.

NCCL's all-reduce runs as kernels: while a bucket is on the wire, its CTAs hold multiprocessors and stream the data
through them, beside the backward pass that the reduction is meant to hide under, which slows that backward's
products. :class:`BucketReduce` moves every byte through peer channels (:mod:`dtrain.comm.peer.channels`), whose
copies run on the GPUs' copy engines and whose waits are stream memory operations, and keeps the SMs for one
short pass a bucket:

1. **Scatter.** Rank ``r`` cuts bucket ``i`` into ``world`` pieces and pushes piece ``q`` into peer ``q``'s slot,
   for every peer (a reduce-scatter's traffic, each piece once).
2. **Sum.** Once every peer's piece ``r`` has landed, one pass (:func:`dtrain.comm.peer.kernels.combine`, a fused
   kernel where Triton is there) adds them to its own piece ``r`` and scales by ``1 / world``: piece ``r`` is
   averaged, by this rank alone, so every rank ends with the same bits.
3. **Gather.** Rank ``r`` pushes its averaged piece into every peer's slot, and copies each peer's averaged
   piece from its slot into its own bucket (an all-gather's traffic).

On a GPU the three run on a stream of their own after the bucket's gradients are ready on the caller's stream, so
backward goes on meanwhile; :meth:`wait` makes the caller's stream wait for one bucket. Every bucket of a step
is one round of the channels (each message in a slot of its own, the slots given back at the round's end), so a
step issues the same operations as the step before, and a step recorded as one CUDA graph replays. No step
waits for the one before it in particular: a rank pushes into a peer's slots for the next step only after its
own backward of that step, which comes after it waited for every bucket of this step, which the peer's pushes
completed; the round's end waits cover the rest.

On the CPU (peer windows in /dev/shm) the host does each bucket's three parts in :meth:`start` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtrain.comm.peer.channels import Channel, PeerChannels
from dtrain.comm.peer.kernels import combine

__all__ = ["BucketReduce", "pieces"]


def pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """(offset, length) of the ``world`` pieces of a ``numel``-element bucket: lengths differ by at most one."""
    base, extra = divmod(numel, world)
    out, offset = [], 0
    for q in range(world):
        length = base + (1 if q < extra else 0)
        out.append((offset, length))
        offset += length
    return out


class BucketReduce:
    """Average buckets of ``numels`` elements of ``dtype`` (the same list, in the same order, on every rank of
    ``group``; a collective to make) over ``group``, one bucket at a time in index order (see the module)."""

    def __init__(self, group, device: torch.device, numels: Sequence[int], dtype: torch.dtype) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        self.dtype = dtype
        self.numels = [int(n) for n in numels]
        if not self.numels or min(self.numels) < 1:
            raise ValueError(f"bucket reduce: buckets of at least one element each, got {list(numels)}")
        self._pieces = [pieces(n, self.world) for n in self.numels]
        slot = max(length for p in self._pieces for _, length in p) * dtype.itemsize
        pairs = [(r, q) for r in range(self.world) for q in range(self.world) if r != q]
        self._channel = {pair: i for i, pair in enumerate(pairs)}
        # two messages a bucket on each channel: the scattered piece, then the averaged one
        self.channels = PeerChannels(
            self.group, device, [Channel(r, q, slot, 2 * len(self.numels)) for r, q in pairs], engine="inline"
        )
        self._peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        self._cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self._cuda else None
        self._done: list[torch.cuda.Event | None] = [None] * len(self.numels)
        self._next = 0

    def start(self, index: int, buffer: torch.Tensor) -> None:
        """Average ``buffer`` (bucket ``index``, its gradients ready on the caller's stream) in place; buckets start
        in index order, each step from bucket 0."""
        if index != self._next:
            raise ValueError(f"bucket reduce: bucket {index} started where bucket {self._next} is due")
        if buffer.numel() != self.numels[index] or buffer.dtype != self.dtype or not buffer.is_contiguous():
            raise ValueError(
                f"bucket reduce: bucket {index} is {self.numels[index]} contiguous {self.dtype} elements, got "
                f"{buffer.numel()} {buffer.dtype}"
            )
        self._next = (index + 1) % len(self.numels)
        last = index == len(self.numels) - 1
        if self._cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._reduce(index, buffer, last)
                event = torch.cuda.Event()
                event.record(self.stream)
            buffer.record_stream(self.stream)
            self._done[index] = event
        else:
            self._reduce(index, buffer, last)

    def wait(self, index: int) -> None:
        """The caller's stream waits for bucket ``index`` to be averaged (on the CPU it already is)."""
        event = self._done[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _reduce(self, index: int, buffer: torch.Tensor, last: bool) -> None:
        ch, r = self.channels, self.rank
        part = [buffer[offset : offset + length] for offset, length in self._pieces[index]]
        sent = [ch.send(self._channel[r, q], part[q]) for q in self._peers]
        landed = [ch.post(self._channel[q, r], part[r].shape, self.dtype, lend=True) for q in self._peers]
        mine = part[r]
        if mine.numel():
            combine([mine], mine, [got.wait() for got in landed], "sum")
            mine.mul_(1.0 / self.world)
        else:
            for got in landed:
                got.wait()
        sent += [ch.send(self._channel[r, q], mine, last=last) for q in self._peers]
        back = [ch.post(self._channel[q, r], part[q].shape, self.dtype, last=last, lend=True) for q in self._peers]
        for q, got in zip(self._peers, back, strict=True):
            averaged = got.wait()
            if averaged.numel():
                part[q].copy_(averaged)
        if last:
            ch.release()  # after the copies out of this round's slots, on this stream
        for done in sent:
            done.wait()
