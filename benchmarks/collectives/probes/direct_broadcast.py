# ruff: noqa: B023  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py direct-broadcast [--sizes 16,32,64,256,1024]
[--rounds 5] [--fresh] [--lone]

The ring broadcast as a chain of copies between the callers' own tensors (dtrain.comm.peer.direct) through
``comm.broadcast``: named (``api ring``) and by ``auto`` (``api auto``), beside NCCL's broadcast on the same
tensors, ``direct``: the chain called without the API around it, and on 2 GPUs ``bare``: one copy-engine copy
from rank 0's tensor into rank 1's, mapped once (no counters, no mailbox: the ceiling). Interleaved in rounds;
each round times ``iters`` calls between two synchronizations, the slowest rank's time a call, and one call alone
between two synchronizations (``one call``: its start and end included); the median of the rounds. ``--fresh``:
a new output tensor every call. Before timing, each size is checked against the root's tensor from every root,
and a broadcast recorded in a CUDA graph is replayed on new data and checked; also the host microseconds of
naming an allocation (``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``).

``--lone`` (2 GPUs): where a lone call's time goes, each variant one call between two synchronizations (the
median of 15): NCCL's broadcast, the bare copy pushed and pulled, the pull behind the chain's device handshake
alone (the root raises a counter the receiver waits on, the receiver raises one the root waits on; the tensors
mapped beforehand, no mailbox), the chain itself and ``comm.broadcast``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.peer import channels as peer_channels
from dtrain.comm.peer import direct as peer_direct
from probes import interleaved, print_beside_nccl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,32,64,256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--lone", action="store_true", help="where one call alone spends its time (2 GPUs)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    d = peer_channels._driver()
    if rank == 0:
        print(
            f"# direct-broadcast on {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; fresh {args.fresh}; "
            f"exportable {peer_direct.exportable(device)}",
            flush=True,
        )
    probe_t = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    for _ in range(1000):
        peer_direct.name_of(probe_t.data_ptr())
    named = (time.perf_counter() - t0) / 1000
    if rank == 0:
        print(f"# naming an allocation {named * 1e6:.2f} us", flush=True)

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    if args.lone:
        _lone(args, device, rank, world)
        return
    for nbytes in [int(s) << 20 for s in args.sizes.split(",")]:
        src = torch.randn(nbytes // 4, device=device)
        dist.broadcast(src, 0)
        bufs = {"x": torch.empty_like(src)}
        iters = max(3, min(50, (2 << 30) // nbytes))
        checks = {}
        for root in range(world):  # every root, the API's ring and auto
            for algorithm in ("ring", "auto"):
                mine = src * (root + 1) if rank == root else torch.zeros_like(src)
                comm.broadcast(mine, root, algorithm=algorithm)
                checks[f"root {root} {algorithm}"] = agree(torch.equal(mine, src * (root + 1)))
        stream = torch.cuda.Stream()  # recorded once, replayed on new data
        held = src.clone() if rank == 0 else torch.zeros_like(src)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm.broadcast(held, 0, algorithm="ring")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.broadcast(held, 0, algorithm="ring")
        good = True
        for k in range(3):
            if rank == 0:
                held.copy_(src + k)
            else:
                held.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            good &= torch.equal(held, src + k)
        checks["graph replays"] = agree(good)
        del graph

        def out() -> torch.Tensor:
            if args.fresh:
                bufs["x"] = torch.empty_like(src)
            return bufs["x"]

        def nccl() -> None:
            dist.broadcast(out() if rank else src, 0)

        def api(algorithm: str):
            def run() -> None:
                comm.broadcast(src if rank == 0 else out(), 0, algorithm=algorithm)

            return run

        chained = peer_direct.direct_for(None, device)

        def direct() -> None:  # the chain itself, without the API around it
            chained.broadcast(src if rank == 0 else out(), 0)

        variants = {"nccl": nccl, "api ring": api("ring"), "api auto": api("auto"), "direct": direct}
        if world == 2:
            fixed = torch.empty_like(src)
            names = [None] * world
            dist.all_gather_object(names, peer_direct.name_of(fixed.data_ptr()))
            chain = peer_direct.direct_for(None, device)
            fixed_at = chain._map(names[1][0]) + names[1][1] if rank == 0 else 0

            def bare() -> None:
                if rank == 0:
                    s = torch.cuda.current_stream().cuda_stream
                    peer_channels._check(d.copy(fixed_at, src.data_ptr(), nbytes, s), "copy")

            variants["bare"] = bare
        times, host, single = interleaved(variants, iters, args.rounds, device, lone=True)
        print_beside_nccl(nbytes, checks, times, host, single, device, 9)
    dist.barrier()


def _lone(args, device: torch.device, rank: int, world: int) -> None:
    assert world == 2, "--lone runs on 2 GPUs"
    chain = peer_direct.direct_for(None, device)
    d, base = peer_channels._driver(), chain._base
    ready, done = 8, 9  # counters of the window the chain does not use
    seq = [0]

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def write(r: int, counter: int, value: int) -> None:
        peer_channels._check(d.write(stream(), base[r] + 4 * counter, value, 0), "cuStreamWriteValue32")

    def wait(r: int, counter: int, value: int) -> None:
        at = base[r] + 4 * counter
        peer_channels._check(d.wait(stream(), at, value, peer_channels._WAIT_GEQ), "cuStreamWaitValue32")

    for nbytes in [int(s) << 20 for s in args.sizes.split(",")]:
        src = torch.randn(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        names = [None] * world
        dist.all_gather_object(names, peer_direct.name_of((src if rank == 0 else dst).data_ptr()))
        peer = chain._map(names[1 - rank][0]) + names[1 - rank][1]

        def copy(to: int, frm: int) -> None:
            peer_channels._check(d.copy(to, frm, nbytes, stream()), "cuMemcpyDtoDAsync")

        def push() -> None:
            if rank == 0:
                copy(peer, src.data_ptr())

        def pull() -> None:
            if rank == 1:
                copy(dst.data_ptr(), peer)

        def handshake() -> None:
            seq[0] += 1
            if rank == 0:
                write(1, ready, seq[0])
                wait(0, done, seq[0])
            else:
                wait(1, ready, seq[0])
                copy(dst.data_ptr(), peer)
                write(0, done, seq[0])

        variants = {
            "nccl": lambda: dist.broadcast(src if rank == 0 else dst, 0),
            "bare push": push,
            "bare pull": pull,
            "pull + counters": handshake,
            "chain": lambda: chain.broadcast(src if rank == 0 else dst, 0),
            "api ring": lambda: comm.broadcast(src if rank == 0 else dst, 0, algorithm="ring"),
        }
        for fn in variants.values():
            fn()
            fn()
        torch.cuda.synchronize()
        _, _, times = interleaved(variants, 0, 15, device, lone=True)
        if rank == 0:
            base_t = statistics.median(times["nccl"])
            for name, ts in times.items():
                m = statistics.median(ts)
                print(f"{nbytes >> 20:6d} MiB  lone  {name:16s} {m * 1e6:8.1f} us  {base_t / m:5.2f}x nccl", flush=True)
