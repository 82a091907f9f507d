# ruff: noqa: B023  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py channels

Peer channels (dtrain.comm.peer.channels) on GPUs of one host, step by step, then beside NCCL's send and recv.

1. The driver's stream memory operations on this rank's own window: a write then a host read, a wait on a value
   the host set.
2. A write into the next rank's window, read there by the host.
3. A ring of messages from each rank to the next, more messages than slots, shapes and dtypes mixed, each checked
   against what was sent.
4. Time per message, 64 KiB-16 MiB: each rank sends the next one ``--iters`` messages and takes as many from the
   previous, ours (the copy on the sender's channel stream, the take on the caller's stream), each step a driver
   call and, ``torch`` in the table, through torch's copies, stream switches and events, beside NCCL
   (``isend``/``irecv`` batched per message), and the host's time to issue one.

Each check prints before and after it, and a stack dump comes after ``--stall-s`` seconds without progress, so a
stall names its step.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

from dtrain.comm.peer.channels import Channel, PeerChannels, channels_available


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--stall-s", type=float, default=30.0)
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    faulthandler.dump_traceback_later(args.stall_s, repeat=True, file=sys.stderr)
    _say(rank, f"channels available: {channels_available(None, device)}")

    ring = [Channel(r, (r + 1) % world, 1 << 20, 3) for r in range(world)]
    chans = PeerChannels(None, device, ring)
    mine, theirs = rank, prv  # channel index = sending rank
    stream = torch.cuda.current_stream(device)
    base = chans._base[rank]

    _say(rank, "1. write and wait on this rank's own window")
    flag = chans.window.buffers[rank][chans._ready_at[mine] : chans._ready_at[mine] + 4].view(torch.int32)
    chans._write_value(stream.cuda_stream, base + chans._ready_at[mine], 7)
    torch.cuda.synchronize()
    got = int(flag.item())
    chans._wait_value(stream.cuda_stream, base + chans._ready_at[mine], 7)
    torch.cuda.synchronize()
    flag.zero_()
    torch.cuda.synchronize()
    _say(rank, f"   wrote 7, host read {got}; a wait on it returned")
    dist.barrier()

    _say(rank, "2. write into the next rank's window")
    # the `free` counter of this rank's own channel, in the next rank's window: there nobody uses it (a channel's
    # `free` counter lives in its sender's window), and the next rank reads it as the counter of its previous rank
    chans._write_value(stream.cuda_stream, chans._base[nxt] + chans._free_at[mine], 11 + rank)
    torch.cuda.synchronize()
    dist.barrier()
    probe_at = chans._free_at[theirs]
    seen = int(chans.window.buffers[rank][probe_at : probe_at + 4].view(torch.int32).item())
    every = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(every, torch.tensor([seen], device=device))
    _say(rank, f"   each rank read what the previous wrote: {[int(t) for t in every]} (expected 11 + previous rank)")
    chans.window.buffers[rank][probe_at : probe_at + 4].zero_()
    torch.cuda.synchronize()
    dist.barrier()

    _say(rank, f"3. a ring of messages, more than slots (driver calls: {chans.direct})")
    shapes = [((1000,), torch.float32), ((7, 33), torch.bfloat16), ((1 << 18,), torch.float32), ((5,), torch.int64)]
    bad = 0
    for k in range(24):
        chans.direct = k < 12 and chans._driver.direct  # then through torch's calls
        shape, dtype = shapes[k % len(shapes)]
        gen = torch.Generator(device=device).manual_seed(1000 * rank + k)
        out = (torch.rand(shape, generator=gen, device=device) * 100).to(dtype)
        chans.send(mine, out)
        got = chans.post(theirs, shape, dtype).wait()
        gen = torch.Generator(device=device).manual_seed(1000 * prv + k)
        want = (torch.rand(shape, generator=gen, device=device) * 100).to(dtype)
        bad += int(not torch.equal(got, want))
    torch.cuda.synchronize()
    flags = torch.tensor([bad], device=device)
    dist.all_reduce(flags)
    _say(rank, f"   24 messages a rank (12 each way): {int(flags)} differ from what was sent")
    chans.direct = chans._driver.direct

    _say(rank, "4. time per message (ms; host us to issue one and take one)")
    head = (
        f"{'bytes':>10} {'ours ms':>9} {'torch ms':>9} {'nccl ms':>9} {'nccl/ours':>9} {'ours host us':>13} "
        f"{'torch host us':>13} {'nccl host us':>13}"
    )
    _say(rank, head)
    for size in (1 << 16, 1 << 20, 4 << 20, 16 << 20):
        big = PeerChannels(None, device, [Channel(r, (r + 1) % world, size, 4) for r in range(world)])
        src = torch.randn(size // 4, device=device)
        dst = torch.empty_like(src)

        def ours() -> None:
            big.direct = big._driver.direct
            big.send(mine, src)
            big.post(theirs, src.shape, src.dtype).wait()

        def through_torch() -> None:
            big.direct = False
            big.send(mine, src)
            big.post(theirs, src.shape, src.dtype).wait()

        def nccl() -> None:
            ops = [dist.P2POp(dist.isend, src, nxt), dist.P2POp(dist.irecv, dst, prv)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        row = []
        for fn in (ours, through_torch, nccl):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            issue = time.perf_counter() - start
            torch.cuda.synchronize()
            total = torch.tensor([(time.perf_counter() - start) / args.iters, issue / args.iters], device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            row.append(total.tolist())
        (o, oh), (t, th), (n, nh) = row
        _say(
            rank,
            f"{size:>10} {o * 1e3:>9.4f} {t * 1e3:>9.4f} {n * 1e3:>9.4f} {n / o:>9.2f} {oh * 1e6:>13.1f} "
            f"{th * 1e6:>13.1f} {nh * 1e6:>13.1f}",
        )
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
