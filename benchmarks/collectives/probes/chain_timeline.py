"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py chain-timeline [--mib N] [--pieces P] [--push]

Probe: the device timeline of one pipelined chain broadcast on the peer transport (where a round's time goes).

Run under torchrun on 4 GPUs of one host. Runs dtrain's ring broadcast (``--pieces`` pieces, pull form) of
``--mib`` MiB directly through the transport under torch.profiler, and writes each rank's GPU kernels of the
last call, in order (name, start from the call's first kernel, duration, us), to ``--out-dir/rank{r}.txt``, with
a summary per kernel name.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.peer import window as peer

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--pieces", type=int, default=21)
    ap.add_argument("--push", action="store_true")
    ap.add_argument("--out-dir", default="chain-timeline")
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    n = args.mib * MIB
    x = torch.full((n // 4,), float(rank + 1), device=dev)
    window = peer.window_for(dist.group.WORLD, dev, n * (2 if args.push else 1))
    schedule = registry.build(Collective.BROADCAST, "ring", 4, root=0, pipeline=args.pieces)
    run = peer.run_push if args.push else peer.run_pull
    for _ in range(3):
        run(schedule, x, window, "sum")
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(schedule, x, window, "sum")
        torch.cuda.synchronize()
    ok = bool(torch.equal(x, torch.ones_like(x)))
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = events[0].time_range.start if events else 0
    by: dict[str, list[float]] = defaultdict(list)
    lines = [f"rank {rank}: {args.mib} MiB, {args.pieces} pieces, {'push' if args.push else 'pull'}, ok={ok}"]
    for e in events:
        dur = e.time_range.end - e.time_range.start
        by[e.name[:60]].append(dur)
        lines.append(f"{e.time_range.start - t0:10.1f} {dur:9.1f}  {e.name[:80]}")
    span = (events[-1].time_range.end - t0) if events else 0.0
    lines.append(f"span {span:.1f} us")
    for name, durs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        mid = sorted(durs)[len(durs) // 2]
        lines.append(f"  {len(durs):4d} x {name}: total {sum(durs):9.1f} us, median {mid:8.1f}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
