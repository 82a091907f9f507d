"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py port [--sizes-mib 1,4] [--patterns P,..] [--out F]

Probe: how transfers through peer memory share a GPU's NVLink port, as the peer transport's passes do.

Run under torchrun on 4 GPUs of one host. Every pattern is one round: a device barrier, then each taking part
rank's pass (ranks that take no part only wait at the barrier). Per pattern and per size of one flow, the
round's time (max over ranks, the barrier alone subtracted) and the bytes per second through the busiest
port. The passes are the runtime's own: a plain ``copy_`` out of or into a peer's memory, and
:func:`dtrain.comm.peer.kernels.combine` for a pass that sums three peers.

- ``read 1 lone``: rank 1 copies rank 0's block; the others idle.
- ``read 1 ring``: every rank copies its next rank's block at once (the pair rate's probe: both directions).
- ``fan-out read``: ranks 1-3 copy three blocks of rank 0 at once (a star broadcast or scatter, pulled).
- ``fan-in push``: ranks 1-3 copy their block into rank 0 at once (a star gather, pushed).
- ``push 1 lone``: rank 1 copies its block into rank 0; the others idle.
- ``sum 3 lone``: rank 0 sums the block of three peers (one pass); the others idle (a star reduce).
- ``sum 3 all``: every rank sums three peers' blocks at once (a direct all-reduce's first round).
- ``copy 3 lone``: rank 0 copies three peers' blocks one after another (a star gather, pulled).
- ``chain read``: ranks 1-3 each copy the block of the rank before them at once (a pipelined chain's round).
- ``chain read 2 outs``: the same pass storing to two outputs, as the runtime's chain does (window and buffer).
- ``read 1 ring 2 outs``: ``read 1 ring`` storing to two outputs.

Prints one line a pattern and size, and with ``--out`` a JSON line each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from dtrain.comm.peer.kernels import combine

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="bytes of one flow, MiB")
    ap.add_argument("--patterns", default=None, help="comma-separated patterns (default: all)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("probe port: run on 4 GPUs (torchrun --nproc-per-node 4)")
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    numel = max(sizes) * MIB // 4
    group = dist.group.WORLD
    with contextlib.suppress(Exception):  # newer torch needs no enabling
        symm_mem.enable_symm_mem_for_group(group.group_name)
    ws = symm_mem.empty(4 * numel, dtype=torch.float32, device=dev)  # four blocks: one a peer
    h = symm_mem.rendezvous(ws, group.group_name)
    peers = [h.get_buffer(p, (4 * numel,), torch.float32) for p in range(world)]
    mine = torch.randn(numel, device=dev)
    out = torch.empty(numel, device=dev)
    ws.normal_()
    name = torch.cuda.get_device_name(dev)

    def block(buf: torch.Tensor, i: int, n: int) -> torch.Tensor:
        return buf[i * numel : i * numel + n]

    def patterns(n: int) -> dict:
        nxt, others = (rank + 1) % world, [p for p in range(world) if p != rank]
        return {
            "read 1 lone": (lambda: out[:n].copy_(block(peers[0], 1, n))) if rank == 1 else None,
            "read 1 ring": lambda: out[:n].copy_(block(peers[nxt], rank, n)),
            "fan-out read": (lambda: out[:n].copy_(block(peers[0], rank, n))) if rank else None,
            "fan-in push": (lambda: block(peers[0], rank, n).copy_(mine[:n])) if rank else None,
            "push 1 lone": (lambda: block(peers[0], 1, n).copy_(mine[:n])) if rank == 1 else None,
            "sum 3 lone": (lambda: combine([out[:n]], None, [block(peers[p], 0, n) for p in (1, 2, 3)], "sum"))
            if rank == 0
            else None,
            "sum 3 all": lambda: combine([out[:n]], None, [block(peers[p], rank, n) for p in others], "sum"),
            "copy 3 lone": (lambda: [out[:n].copy_(block(peers[p], 0, n)) for p in (1, 2, 3)]) if rank == 0 else None,
            "chain read": (lambda: out[:n].copy_(block(peers[rank - 1], rank, n))) if rank else None,
            "chain read 2 outs": (lambda: combine([out[:n], mine[:n]], None, [block(peers[rank - 1], rank, n)], "sum"))
            if rank
            else None,
            "read 1 ring 2 outs": lambda: combine([out[:n], mine[:n]], None, [block(peers[nxt], rank, n)], "sum"),
        }

    # bytes through the busiest port per flow: fan-out/fan-in/sum/copy 3 move three flows through one port
    flows = {"read 1 lone": 1, "read 1 ring": 1, "fan-out read": 3, "fan-in push": 3, "push 1 lone": 1,
             "sum 3 lone": 3, "sum 3 all": 3, "copy 3 lone": 3, "chain read": 1, "chain read 2 outs": 1,
             "read 1 ring 2 outs": 1}  # fmt: skip

    def timed(fn) -> float:
        def body() -> None:
            h.barrier(channel=0)
            if fn is not None:
                fn()

        for _ in range(3):
            body()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            body()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end) / args.iters * 1e3], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    bare = min(timed(None) for _ in range(3))
    lines = []
    if rank == 0:
        print(f"{name} x{world}: barrier round {bare:.2f} us", flush=True)
    for mib in sizes:
        n = mib * MIB // 4
        wanted = args.patterns.split(",") if args.patterns else None
        for label, fn in patterns(n).items():
            if wanted is not None and label not in wanted:
                continue
            us = max(timed(fn) - bare, 1e-3)
            port = flows[label] * mib * MIB / (us * 1e-6) / 1e9
            rec = {"pattern": label, "flow_bytes": mib * MIB, "flows_through_port": flows[label], "time_us": us,
                   "barrier_us": bare, "port_gbps": port, "device_name": name}  # fmt: skip
            lines.append(rec)
            if rank == 0:
                print(f"{mib:5d} MiB  {label:14s} {us:9.1f} us  {port:7.1f} GB/s through the busiest port", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            for rec in lines:
                f.write(json.dumps(rec) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
