# ruff: noqa: B023  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py direct-reduce [--sizes 16,64,256,1024]
[--rounds 5] [--fresh] [--dtype bfloat16]

The ring reduce as a chain between the callers' own tensors (dtrain.comm.peer.direct: each rank combines its
predecessor's partial, read over the link by one elementwise kernel, with its own input) through ``comm.reduce``:
named (``api ring``) and by ``auto`` (``api auto``), beside NCCL's reduce on the same tensors, and ``direct``: the
chain called without the API around it. On 2 GPUs also the root's ways to combine the peer's tensor, mapped
once, with no counters and no mailbox (the ceilings): ``bare add`` (one kernel reading the peer's memory),
``bare copy+add`` (a copy engine's copy into a local buffer, then the add, on one stream) and ``bare piped``
(the copies of 8 pieces on a second stream, each piece's add after its copy, so copies and adds overlap).
Interleaved in rounds; each round times ``iters`` calls between two synchronizations, the slowest rank's time a
call, and one call alone between two synchronizations (``one call``); the median of the rounds. ``--fresh``: a
new tensor every call on every rank (its allocation and filling left out of nothing: ``torch.empty_like``).
Before timing, each size is checked against torch.distributed's reduce from every root, every other rank's
tensor left as it was, and a reduce recorded in a CUDA graph is replayed on new data and checked.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.peer import channels as peer_channels
from dtrain.comm.peer import direct as peer_direct
from probes import interleaved, print_beside_nccl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    d = peer_channels._driver()
    if rank == 0:
        print(
            f"# direct-reduce on {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; {args.dtype}; fresh {args.fresh}; "
            f"exportable {peer_direct.exportable(device)}",
            flush=True,
        )

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    chain = peer_direct.direct_for(None, device)
    for nbytes in [int(s) << 20 for s in args.sizes.split(",")]:
        numel = nbytes // torch.empty((), dtype=dtype).element_size()
        g = torch.Generator(device=device).manual_seed(rank)
        base = torch.randint(-8, 8, (numel,), device=device, generator=g).to(dtype)  # sums exact in bf16
        checks = {}
        for root in range(world):
            for algorithm in ("ring", "auto"):
                mine, want = base.clone(), base.clone()
                dist.reduce(want, root)
                comm.reduce(mine, root, algorithm=algorithm)
                checks[f"root {root} {algorithm}"] = agree(torch.equal(mine, want if rank == root else base))
        stream = torch.cuda.Stream()  # recorded once, replayed on new data
        held = base.clone()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm.reduce(held, 0, algorithm="ring")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.reduce(held, 0, algorithm="ring")
        good = True
        for k in range(3):
            held.copy_(base + k)
            want = base + k
            dist.reduce(want, 0)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            good &= torch.equal(held, want if rank == 0 else base + k)
        checks["graph replays"] = agree(good)
        del graph

        bufs = {"x": base.clone()}

        def x() -> torch.Tensor:
            if args.fresh:
                bufs["x"] = torch.empty_like(base)
            return bufs["x"]

        def api(algorithm: str):
            return lambda: comm.reduce(x(), 0, algorithm=algorithm)

        variants = {
            "nccl": lambda: dist.reduce(x(), 0),
            "api ring": api("ring"),
            "api auto": api("auto"),
            "direct": lambda: chain.reduce(x(), 0),
        }
        if world == 2:
            fixed = base.clone()
            names = [None] * world
            dist.all_gather_object(names, peer_direct.name_of(fixed.data_ptr()))
            at = chain._map(names[1][0]) + names[1][1] if rank == 0 else 0
            peer = chain.memory.view(at, nbytes, dtype) if rank == 0 else None
            staging = torch.empty_like(base)
            side = torch.cuda.Stream()
            parts = 8

            def bare_add() -> None:
                if rank == 0:
                    torch.add(fixed, peer, out=fixed)

            def copy(to: torch.Tensor, frm: int, n: int, s) -> None:
                peer_channels._check(d.copy(to.data_ptr(), frm, n, s.cuda_stream), "cuMemcpyDtoDAsync")

            def bare_copy_add() -> None:
                if rank == 0:
                    copy(staging, at, nbytes, torch.cuda.current_stream())
                    fixed.add_(staging)

            def bare_piped() -> None:
                if rank != 0:
                    return
                main_s = torch.cuda.current_stream()
                side.wait_stream(main_s)
                step = numel // parts
                done = []
                for k in range(parts):
                    lo = k * step
                    hi = numel if k == parts - 1 else lo + step
                    size = staging.element_size()
                    copy(staging[lo:hi], at + lo * size, (hi - lo) * size, side)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    done.append((lo, hi, ev))
                for lo, hi, ev in done:
                    main_s.wait_event(ev)
                    fixed[lo:hi].add_(staging[lo:hi])
                side.wait_stream(main_s)  # the staging buffer is free once the adds ran

            variants.update({"bare add": bare_add, "bare copy+add": bare_copy_add, "bare piped": bare_piped})
        iters = max(3, min(50, (2 << 30) // nbytes))
        times, host, single = interleaved(variants, iters, args.rounds, device, lone=True)
        print_beside_nccl(nbytes, checks, times, host, single, device, 13)
    dist.barrier()
