# ruff: noqa: B023  (every closure here is timed at once, inside its loop iteration)
"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py chain

Probe: does a pipelined chain broadcast on the peer transport get faster with more pieces?

Run under torchrun on 4 GPUs of one host. Times dtrain's ring broadcast schedule (rank 0 -> 1 -> 2 -> 3, cut
into ``P`` pieces) run directly through the peer transport in the pull and the push form, for several ``P``,
beside NCCL's broadcast; the result is checked against rank 0's buffer.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.peer import window as peer
from probes.symm import timed

MIB = 1 << 20


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    group = dist.group.WORLD
    for mib in (64, 1024):
        n = mib * MIB
        x = torch.full((n // 4,), float(rank + 1), device=dev)
        ref = torch.ones_like(x)
        nccl = timed(lambda: dist.broadcast(x, 0), iters=10, warmup=2)
        if rank == 0:
            print(f"{mib:5d} MiB  nccl              {nccl:9.1f} us", flush=True)
        for push in (False, True):
            window = peer.window_for(group, dev, n * (2 if push else 1))
            run = peer.run_push if push else peer.run_pull
            for pieces in (1, 2, 3, 5, 9, 21, 41):
                schedule = registry.build(Collective.BROADCAST, "ring", 4, root=0, pipeline=pieces)
                x.fill_(float(rank + 1))
                us = timed(lambda s=schedule: run(s, x, window, "sum"), iters=10, warmup=2)
                ok = bool(torch.equal(x, ref))
                if rank == 0:
                    form = "push" if push else "pull"
                    print(f"{mib:5d} MiB  {form} P={pieces:3d}       {us:9.1f} us  {nccl / us:5.2f}x nccl  ok={ok}",
                          flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
