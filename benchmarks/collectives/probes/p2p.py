# ruff: noqa: B023, B905  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py p2p

Where does a Python-driven collective lose time on GPUs? Point-to-point latency, bandwidth and CPU cost.

Run under torchrun on one host: ``torchrun --nproc-per-node 4 benchmarks/collectives/probe.py p2p``. Times are
nccl-tests style (iterations back to back, one synchronize at the end, per-iteration mean); "cpu" is the
host time to enqueue one iteration without synchronizing.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from dtrain import comm


def _timed(fn, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    enqueue = (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / iters
    t = torch.tensor([total, enqueue], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item()


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    dev = torch.device("cuda", local)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for nbytes in (8 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20):
        n = nbytes // 4
        a, b = torch.ones(n, device=dev), torch.empty(n, device=dev)
        peers = [p for p in range(world) if p != rank]
        outs = [torch.empty(n, device=dev) for _ in peers]

        def batch_ring():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, b, prv)]):
                w.wait()

        def raw_ring():
            pg._start_coalescing(dev)
            pg.send([a], nxt, 0)
            pg.recv([b], prv, 0)
            pg._end_coalescing(dev).wait()

        def raw_all_peers():
            pg._start_coalescing(dev)
            for p, o in zip(peers, outs):
                pg.send([a], p, 0)
                pg.recv([o], p, 0)
            pg._end_coalescing(dev).wait()

        def add():
            b.add_(a)

        def native():
            dist.all_reduce(a)

        x = torch.ones(n, device=dev)
        rows = {
            "native all_reduce": native,
            "batch_isend_irecv ring step": batch_ring,
            "pg coalesced ring step": raw_ring,
            "pg coalesced all peers": raw_all_peers,
            "add_": add,
            "ours ring all_reduce": lambda: comm.all_reduce(x, algorithm="ring"),
            "ours direct all_reduce": lambda: comm.all_reduce(x, algorithm="direct"),
        }
        for name, fn in rows.items():
            total, enqueue = _timed(fn, 20)
            if rank == 0:
                moved = nbytes * (len(peers) if "all peers" in name else 1)
                print(
                    f"{nbytes >> 10:8d} KiB {name:30s} {total * 1e6:9.1f} us  cpu {enqueue * 1e6:8.1f} us"
                    f"  {moved / total / 1e9:7.1f} GB/s of the buffer",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
