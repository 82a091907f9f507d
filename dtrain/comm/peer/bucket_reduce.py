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
3. **Gather.** Rank ``r`` pushes its averaged piece straight into piece ``r`` of every peer's bucket, then raises
   a flag in that peer's window; a rank's bucket is whole once every peer's flag for it is up (an all-gather's
   traffic, with no copy out of a slot: the buckets themselves live in this rank's peer window,
   :attr:`BucketReduce.buckets`, and the caller keeps its gradients there).

On a GPU the three run, one after another, on a stream of their own after the bucket's gradients are ready on the
caller's stream, so backward goes on meanwhile (one stream a peer, the pieces pushed at once, measured slower on 4
H100s: the concurrent copies took more from backward than they saved); :meth:`wait` makes the caller's stream wait
for one bucket. Every bucket of a step is one round of the channels (each message in a slot of its own, the slots
given back at the round's end), so a step issues the same operations as the step before, and a step recorded as one
CUDA graph replays; a gather flag is waited for at 1 and set back to 0 by its owner. Nothing else orders one step
after the one before: a rank scatters its next step's bucket only after its own backward of that step, which comes
after it waited for every bucket of this step (whose flags it has set back by then), which the peers' pushes
completed; a peer gathers into a bucket only after summing the piece this rank scattered from it, so what it
overwrites was sent.

On the CPU (peer windows in /dev/shm) the host does each bucket's three parts in :meth:`start` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtrain.comm.peer.channels import _ALIGN, _WAIT_EQ, Channel, PeerChannels, _check
from dtrain.comm.peer.kernels import combine
from dtrain.comm.peer.window import PeerWindow, _group_timeout, spin_until

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
    ``group``; a collective to make) over ``group``, one bucket at a time in index order (see the module). The
    buckets to average are :attr:`buckets`, this rank's, in its peer window."""

    def __init__(self, group, device: torch.device, numels: Sequence[int], dtype: torch.dtype) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        self.dtype = dtype
        self.numels = [int(n) for n in numels]
        if not self.numels or min(self.numels) < 1:
            raise ValueError(f"bucket reduce: buckets of at least one element each, got {list(numels)}")
        count = len(self.numels)
        self._pieces = [pieces(n, self.world) for n in self.numels]
        slot = max(length for p in self._pieces for _, length in p) * dtype.itemsize
        pairs = [(r, q) for r in range(self.world) for q in range(self.world) if r != q]
        self._channel = {pair: i for i, pair in enumerate(pairs)}
        # one message a bucket on each channel: the piece scattered to its summing rank
        wires = [Channel(r, q, slot, count) for r, q in pairs]
        self.channels = PeerChannels(self.group, device, wires, engine="inline")  # copies on this one's stream
        # the window: a gather flag per (bucket, peer), then the buckets
        self._offsets, at = [], _round(4 * count * self.world)
        for n in self.numels:
            self._offsets.append(at)
            at += _round(n * dtype.itemsize)
        self.window = PeerWindow(self.group, device, at, layout=f"bucket reduce of {self.numels} {dtype} elements")
        whole = self.window.local(torch.uint8, at)
        whole.zero_()
        #: this rank's buckets, in its window (peers gather into them)
        self.buckets = [
            whole[o : o + n * dtype.itemsize].view(dtype) for o, n in zip(self._offsets, self.numels, strict=True)
        ]
        self._peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._driver = self.channels._driver
            self._base = [int(ptr) for ptr in self.window._handle.buffer_ptrs]
            self.stream = torch.cuda.Stream(device)
            torch.cuda.synchronize(device)
        else:
            self.stream = None
            flags = 4 * count * self.world
            self._flags = [buf[:flags].view(torch.int32).numpy() for buf in self.window.buffers]
            self._timeout = _group_timeout(self.group, device)
        self._done: list[torch.cuda.Event | None] = [None] * count
        self._next = 0
        dist.barrier(group=self.group)  # every flag is down before any bucket goes out

    def start(self, index: int, buffer: torch.Tensor) -> None:
        """Average ``buffer`` (``buckets[index]``, its gradients ready on the caller's stream) in place; buckets
        start in index order, each step from bucket 0."""
        if index != self._next:
            raise ValueError(f"bucket reduce: bucket {index} started where bucket {self._next} is due")
        if buffer.data_ptr() != self.buckets[index].data_ptr() or buffer.numel() != self.numels[index]:
            raise ValueError(f"bucket reduce: bucket {index} must be buckets[{index}], in this rank's window")
        self._next = (index + 1) % len(self.numels)
        last = index == len(self.numels) - 1
        if self._cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._reduce(index, buffer, last)
                event = torch.cuda.Event()
                event.record(self.stream)
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
        for q in self._peers:
            ch.send(self._channel[r, q], part[q], last=last)
        landed = [ch.post(self._channel[q, r], part[r].shape, self.dtype, last=last, lend=True) for q in self._peers]
        mine = part[r]
        sources = [got.wait() for got in landed]
        if mine.numel():
            combine([mine], mine, sources, "sum", scale=1.0 / self.world)
        if last:
            ch.release()  # after the sums that read this step's slots, on this stream
        offset = self._offsets[index] + self._pieces[index][r][0] * self.dtype.itemsize
        nbytes = mine.numel() * self.dtype.itemsize
        stream = self.stream.cuda_stream if self._cuda else None
        for q in self._peers:  # the averaged piece into each peer's bucket, then its flag
            self._push(q, offset, mine, nbytes, stream)
            self._raise(q, self._flag(index, r), stream)
        for q in self._peers:  # every peer's averaged piece is in this bucket
            self._await(self._flag(index, q))

    def _flag(self, index: int, sender: int) -> int:
        """Byte offset, in a receiver's window, of the flag ``sender`` raises once its piece of bucket ``index``
        is there."""
        return 4 * (index * self.world + sender)

    def _push(self, peer: int, offset: int, piece: torch.Tensor, nbytes: int, stream) -> None:
        if not nbytes:
            return
        if self._cuda:
            _check(self._driver.copy(self._base[peer] + offset, piece.data_ptr(), nbytes, stream), "cuMemcpyDtoDAsync")
        else:
            self.window.buffers[peer][offset : offset + nbytes].copy_(piece.reshape(-1).view(torch.uint8))

    def _raise(self, peer: int, flag: int, stream) -> None:
        if self._cuda:
            _check(self._driver.write(stream, self._base[peer] + flag, 1, 0), "cuStreamWriteValue32")
        else:
            self._flags[peer][flag // 4] = 1

    def _await(self, flag: int) -> None:
        """Wait for this rank's ``flag`` to be up, then set it down (on CUDA as operations on the stream)."""
        if self._cuda:
            stream, address = self.stream.cuda_stream, self._base[self.rank] + flag
            _check(self._driver.wait(stream, address, 1, _WAIT_EQ), "cuStreamWaitValue32")
            _check(self._driver.write(stream, address, 0, 0), "cuStreamWriteValue32")
            return
        flags = self._flags[self.rank]
        spin_until(
            lambda: int(flags[flag // 4]) == 1,
            lambda: self._timeout,
            lambda: f"bucket reduce: rank {self.rank} waited past the group's timeout for a peer's averaged piece",
        )
        flags[flag // 4] = 0


def _round(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
