"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py nccl-wide [--mib 64]

What ``auto``'s ``native_wide`` (NCCL's own collective on the group's wide communicator,
:func:`dtrain.comm.native.wide_group`) gives and costs: the all-reduce, all-gather, reduce-scatter and all-to-all of
``--mib`` MiB of normal values through ``dtrain.comm`` with its defaults, beside torch.distributed's own call on the
default communicator (made first); whether each result has the same bits (rank 0) and the largest difference over
the ranks; and the device memory outside torch's allocator that ``dtrain.comm``'s first calls took (the wide
communicator's NCCL buffers, with ``DTRAIN_COMM_WIDE=0`` none).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm import api


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args(argv)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = (args.mib << 20) // 4
    x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
    sizes = {"all_reduce": n, "all_gather": world * n, "reduce_scatter": n // world, "all_to_all": n}
    ours = {k: torch.empty(s, device=dev) for k, s in sizes.items()}
    theirs = {k: torch.empty(s, device=dev) for k, s in sizes.items()}

    def torch_calls() -> None:
        theirs["all_reduce"].copy_(x)
        dist.all_reduce(theirs["all_reduce"])
        dist.all_gather_into_tensor(theirs["all_gather"], x)
        dist.reduce_scatter_tensor(theirs["reduce_scatter"], x)
        dist.all_to_all_single(theirs["all_to_all"], x)

    def our_calls() -> None:
        ours["all_reduce"].copy_(x)
        comm.all_reduce(ours["all_reduce"])
        comm.all_gather(ours["all_gather"], x)
        comm.reduce_scatter(ours["reduce_scatter"], x)
        comm.all_to_all(ours["all_to_all"], x)

    torch_calls()
    torch.cuda.synchronize()
    dist.barrier()
    reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    our_calls()
    torch.cuda.synchronize()
    dist.barrier()
    outside = (free - torch.cuda.mem_get_info()[0]) - (torch.cuda.memory_reserved() - reserved)
    same = {k: torch.equal(ours[k], theirs[k]) for k in sizes}
    worst = torch.tensor([max((ours[k] - theirs[k]).abs().max().item() for k in sizes)], device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        kind = api._kind(None, dev)
        chosen = [api._auto(api.Collective(k), 4 * n * (world if k == "all_gather" else 1), world, kind, None)
                  for k in sizes]  # fmt: skip
        wide = os.environ.get("DTRAIN_COMM_WIDE", "1")
        print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}")
        print(f"{args.mib} MiB, DTRAIN_COMM_WIDE={wide}: auto chose {dict(zip(sizes, chosen, strict=True))}")
        print(f"  the same bits as torch.distributed's call (rank 0): {same}; largest difference {worst.item():.3g}")
        print(
            f"  device memory outside torch's allocator taken by dtrain.comm's first calls: {outside / 2**20:.0f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
