# ruff: noqa: B023  (a probe: closures are called inside the loop iteration that made them)
"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py nccl-ctas [--ctas 16,32,64] [--rounds 5]
[--sizes 4,8,16,32,64,256,1024]

Does NCCL run large collectives faster with more CTAs than it picks itself? Each collective at 4 MiB-1 GiB
(``--sizes``) on the default communicator and on communicators made with ``ncclConfig_t``'s ``minCTAs = maxCTAs = C``
(``ProcessGroupNCCL.Options().config``, one communicator a ``C`` of ``--ctas``), the same tensors, in rounds that
interleave the communicators; each round times ``iters`` calls between two synchronizations, the slowest rank's
time a call; the median over the rounds and its ratio to the default's (above 1: faster). A larger ``minCTAs``
also takes more SMs from whatever runs beside the collective; this probe runs it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = "4,8,16,32,64,256,1024"


def _call(name: str, group, t: dict):
    if name == "all_reduce":
        return lambda: dist.all_reduce(t["x"], group=group)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(t["big"], t["piece"], group=group)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(t["piece"], t["big"], group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(t["x"], 0, group=group)
    return lambda: dist.all_to_all_single(t["out"], t["x"], group=group)


def _time(fn, iters: int) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    seconds = torch.tensor([(time.perf_counter() - start) / iters], device="cuda")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctas", default="16,32,64", help="minCTAs = maxCTAs of each extra communicator")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default=SIZES, help="MiB, comma-separated")
    p.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all")
    args = p.parse_args(argv)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    groups = {"default": dist.group.WORLD}
    for c in (int(x) for x in args.ctas.split(",")):
        options = dist.ProcessGroupNCCL.Options()
        options.config.min_ctas = c
        options.config.max_ctas = c
        groups[f"ctas{c}"] = dist.new_group(list(range(world)), pg_options=options)
    if dist.get_rank() == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}")
    for name in args.collectives.split(","):
        for nbytes in (int(x) << 20 for x in args.sizes.split(",")):
            n = nbytes // 4
            t = {
                "x": torch.ones(n, device=dev),
                "out": torch.empty(n, device=dev),
                "big": torch.ones(n, device=dev),
                "piece": torch.empty(n // world, device=dev),
            }
            iters = max(3, min(50, (256 << 20) // nbytes * 5))
            calls = {g: _call(name, group, t) for g, group in groups.items()}
            for fn in calls.values():  # warm-up: each communicator's first call sets up its connections
                fn()
                fn()
            seconds: dict[str, list[float]] = {g: [] for g in groups}
            for _ in range(args.rounds):
                for g, fn in calls.items():
                    seconds[g].append(_time(fn, iters))
            if dist.get_rank() == 0:
                base = statistics.median(seconds["default"])
                cells = "  ".join(
                    f"{g} {statistics.median(s) * 1e6:9.1f} us ({base / statistics.median(s):.3f}x)"
                    for g, s in seconds.items()
                )
                print(f"{name:15s} {nbytes >> 20:5d} MiB  {cells}", flush=True)
            del t
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
