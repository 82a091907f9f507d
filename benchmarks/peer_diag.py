"""Diagnose two failures of the peer transport on GPUs (torchrun, 4 GPUs of one host).

A: a subgroup of ranks 0 and 1 all-reduces through peer memory while ranks 2 and 3 wait at a world barrier
   (what benchmarks/peers_dp_zero.py does for its 2-GPU row). A hang dumps every thread's stack.
B: persistent (graph-replayed) all-reduces, every algorithm and size in turn, each checked against NCCL, the
   case printed before it runs, so a crash names it; faulthandler prints the Python stack of a segfault.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch
import torch.distributed as dist

import dtrain.comm as comm
from dtrain.comm import peer


def main() -> None:
    faulthandler.enable()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    part = sys.argv[1]
    if part == "A":
        faulthandler.dump_traceback_later(40, exit=True)
        pair = dist.new_group([0, 1])
        if rank < 2:
            x = torch.full((1 << 18,), float(rank + 1), device=dev)
            comm.all_reduce(x, group=pair, algorithm="ring")
            torch.cuda.synchronize()
            print(f"A rank {rank}: subgroup all-reduce gave {x[0].item()} (want 3.0)", flush=True)
        dist.barrier()
        faulthandler.cancel_dump_traceback_later()
        say("A: done", flush=True)
    else:
        for size in (4096, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
            x = torch.randn(size, device=dev)
            for algo in ("ring", "halving_doubling", "recursive_doubling", "direct", "tree"):
                say(f"B {algo} {size * 4} B", flush=True)
                for _ in range(4):
                    x.normal_()
                    want = x.clone()
                    dist.all_reduce(want)
                    comm.all_reduce(x, algorithm=algo)
                    err = (x - want).abs().max().item() / want.abs().max().item()
                    if err > 1e-5:
                        print(f"B rank {rank}: {algo} {size}: rel err {err:.2e}", flush=True)
                torch.cuda.synchronize()
        say("B: done", flush=True)
    peer.close_windows()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
