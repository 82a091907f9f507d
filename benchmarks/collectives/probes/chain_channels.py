# ruff: noqa: B023  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py chain-channels [--sizes 16,64,256,1024]
[--chunks 2,4,8,16] [--slots 4] [--lanes 1,2] [--rounds 5] [--fresh] [--channels]

A broadcast as a pipelined chain through copy engines, by the chain broadcast's own plan
(dtrain.comm.peer.chain; ``chain N MiB xL``: pieces of N MiB, a few driver calls a piece, the pushes dealt over L
streams) at each piece size, and at the size it picks itself through ``comm.broadcast(algorithm="ring")`` (``api
ring``); with ``--channels`` also over peer channels (dtrain.comm.peer.channels; ``channels N MiB``: each piece a
channel message with its host bookkeeping). Beside them, in rounds interleaved: the same schedule through the
peer transport's general executor, a barrier and a pull pass a round (``api ring rounds``), NCCL's broadcast on
the same tensors, and a copy engine's bare push of the whole tensor from rank 0 into rank 1's window (no flags,
no copy out: the link's rate through one copy engine). Each round times ``iters`` calls between two
synchronizations, the slowest rank's time a call; the median of the rounds. Each chain result is checked against
the root's tensor. ``--fresh``: a new output tensor every call. ``--diagnose``: also the chain with its pieces
copied out of the ring by a kernel (``kernel out``), and with no copy out at all (``no copy out``: a wrong
result, timed only to show what the copies out cost).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm import api as comm_api
from dtrain.comm.peer import chain as peer_chain
from dtrain.comm.peer.channels import Channel, PeerChannels
from probes import interleaved


def _chain(chans: PeerChannels, flat: torch.Tensor, root: int, chunk: int, world: int, rank: int) -> None:
    flat = flat.view(torch.uint8)
    pos = (rank - root) % world
    n = -(-flat.numel() // chunk)
    prev, mine = (rank - 1) % world, rank  # channel index = its sending rank
    for k in range(n):
        piece = flat[k * chunk : (k + 1) * chunk]
        last = k == n - 1
        if pos > 0:
            got = chans.post(prev, piece.shape, piece.dtype, last=last)
            got.tensor = piece
            got.wait()
        if pos < world - 1:
            chans.send(mine, piece, last=last)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--chunks", default="2,4,8,16")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--channels", action="store_true", help="also the chain over peer channels")
    ap.add_argument("--diagnose", action="store_true", help="also copy-out by kernel, and no copy-out at all")
    ap.add_argument(
        "--lanes", default="1,2", help="the chain's lanes (streams a pushing rank copies on), each a variant"
    )
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    chunks = [int(c) << 20 for c in args.chunks.split(",")]
    big = max(chunks)
    ring = [Channel(r, (r + 1) % world, big, args.slots) for r in range(world)]
    chans = PeerChannels(None, device, ring)
    runners = {
        int(n): peer_chain.ChainBroadcast(None, device, big, args.slots, lanes=int(n)) for n in args.lanes.split(",")
    }
    # diagnostics, the most lanes: the pieces copied out by a kernel; and not copied out at all (a wrong result,
    # what the chain costs without its copies out)
    lanes_most = max(runners)
    by_kernel = peer_chain.ChainBroadcast(None, device, big, args.slots, lanes=lanes_most, copy_out="kernel")
    no_copy = peer_chain.ChainBroadcast(None, device, big, args.slots, lanes=lanes_most)
    real_plan = peer_chain.plan

    def plan_without_copy_out(*a, **k):
        return [op for op in real_plan(*a, **k) if not (op.kind == "copy" and op.dst[0] == "tensor")]

    bare = PeerChannels(None, device, [Channel(r, (r + 1) % world, max(sizes), 1) for r in range(world)])
    if rank == 0:
        print(
            f"# chain-channels on {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; slots {args.slots}; fresh {args.fresh}",
            flush=True,
        )
    for nbytes in sizes:
        src = torch.randn(nbytes // 4, device=device)
        dist.broadcast(src, 0)
        bufs = {"x": torch.empty_like(src)}
        iters = max(3, min(50, (2 << 30) // nbytes))

        def out() -> torch.Tensor:
            if args.fresh:
                bufs["x"] = torch.empty_like(src)
            return bufs["x"]

        def nccl() -> None:
            dist.broadcast(out() if rank else src, 0)

        def channels(chunk: int):
            def run() -> None:
                t = src if rank == 0 else out()
                _chain(chans, t, 0, chunk, world, rank)

            return run

        def chain(chunk: int, lanes: int):
            def run() -> None:
                runners[lanes](src if rank == 0 else out(), 0, chunk)

            return run

        def kernel(chunk: int):
            def run() -> None:
                by_kernel(src if rank == 0 else out(), 0, chunk)

            return run

        def uncopied(chunk: int):
            def run() -> None:
                peer_chain.plan = plan_without_copy_out
                try:
                    no_copy(src if rank == 0 else out(), 0, chunk)
                finally:
                    peer_chain.plan = real_plan

            return run

        def api() -> None:
            comm.broadcast(src if rank == 0 else out(), 0, algorithm="ring")

        def rounds() -> None:  # the schedule a round at a time on the peer transport (a barrier, a pull pass)
            real, comm_api._run_chain = comm_api._run_chain, lambda *a, **k: False
            try:
                comm.broadcast(src if rank == 0 else out(), 0, algorithm="ring")
            finally:
                comm_api._run_chain = real

        def push() -> None:  # rank 0 pushes into rank 1's window: the link's rate, one copy engine, no flags
            if rank != 0:
                return
            stream = torch.cuda.current_stream().cuda_stream
            dst = bare._base[(rank + 1) % world] + bare._ring_at[rank]
            bare._driver.copy(dst, src.data_ptr(), nbytes, stream)

        variants = {"nccl": nccl, "ce-push": push, "api ring": api, "api ring rounds": rounds}
        variants.update(
            {f"chain {c >> 20} MiB x{lanes}": chain(c, lanes) for c in chunks if c <= nbytes for lanes in runners}
        )
        for c in chunks:
            if c <= nbytes and args.diagnose:
                variants[f"chain {c >> 20} MiB x{lanes_most} kernel out"] = kernel(c)
                variants[f"chain {c >> 20} MiB x{lanes_most} no copy out"] = uncopied(c)
        if args.channels:
            variants.update({f"channels {c >> 20} MiB": channels(c) for c in chunks if c <= nbytes})
        times, _, _ = interleaved(variants, iters, args.rounds, device)
        ok = {}
        for c in chunks:
            checked = {f"chain {c >> 20} MiB x{lanes}": runner for lanes, runner in runners.items()}
            if args.diagnose:
                checked[f"chain {c >> 20} MiB x{lanes_most} kernel out"] = by_kernel
            for name, runner in checked.items():
                if c > nbytes:
                    continue
                t = torch.zeros_like(src)
                runner(src if rank == 0 else t, 0, c)
                torch.cuda.synchronize()
                good = torch.tensor([1 if (rank == 0 or torch.equal(t, src)) else 0], device=device)
                dist.all_reduce(good, op=dist.ReduceOp.MIN)
                ok[name] = bool(good.item())
        base = statistics.median(times["nccl"])
        for name, ts in times.items():
            m = statistics.median(ts)
            if rank == 0:
                print(
                    f"{nbytes >> 20:6d} MiB  {name:16s} {m * 1e6:9.1f} us  {nbytes / m / 1e9:6.1f} GB/s  "
                    f"{base / m:5.2f}x nccl  {'ok=' + str(ok[name]) if name in ok else ''}",
                    flush=True,
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
