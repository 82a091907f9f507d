"""Usage: DTRAIN_COMM_ONE_PASS=1 torchrun --nproc-per-node 4 benchmarks/collectives/probe.py one-pass

Probe: where the time of a small one-pass all-gather and all-to-all goes (torchrun on the GPUs of one host).

Prints host microseconds to enqueue one call (no synchronisation inside the loop) and GPU microseconds per call
for dtrain's one-pass all-gather, all-to-all, reduce-scatter and broadcast at 8 KiB a rank and NCCL's own, then
for each piece of the one-pass all-gather alone (the exchange kernel that is the whole call where Triton compiles
it; the three-step pass it replaces: the copy into the window, the barrier, the gather kernel; the watchdog's
bookkeeping); then a cProfile of the one-pass all-gather on rank 0 and torch.profiler's device
kernels of the same calls.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import torch.distributed as dist

import dtrain.comm as comm
from dtrain.comm.peer import kernels as peer_kernels
from dtrain.comm.peer import watchdog
from dtrain.comm.peer import window as peer
from probes import start_rank
from probes.peer_host import host_and_gpu


def main() -> None:
    dev, rank, world, say = start_rank()
    n = 2048  # 8 KiB of float32 a rank
    inp, out = torch.randn(n, device=dev), torch.empty(n * world, device=dev)
    full, block = torch.randn(n * world, device=dev), torch.empty(n, device=dev)
    rows = {
        "one-pass all_gather": lambda: comm.all_gather(out, inp, algorithm="direct"),
        "nccl all_gather": lambda: dist.all_gather_into_tensor(out, inp),
        "one-pass all_to_all": lambda: comm.all_to_all(out, full, algorithm="direct"),
        "nccl all_to_all": lambda: dist.all_to_all_single(out, full),
        "one-pass reduce_scatter": lambda: comm.reduce_scatter(block, full, algorithm="direct"),
        "nccl reduce_scatter": lambda: dist.reduce_scatter_tensor(block, full),
        "one-pass broadcast": lambda: comm.broadcast(full, 0, algorithm="star"),
        "nccl broadcast": lambda: dist.broadcast(full, 0),
    }
    rows["one-pass all_gather"]()
    torch.cuda.synchronize()
    error = peer_kernels._state.get("exchange_error")
    say(f"exchange kernel: {'not compiled: ' + error if error else 'compiled'}")
    for name, fn in rows.items():
        host, gpu = host_and_gpu(fn, 200)
        say(f"{name:28s} host {host:8.1f} us/call   gpu {gpu:8.1f} us/call", flush=True)
    window = peer.window_for(None, dev, 2 * (n * 4 + 256))
    mine = window._mine[: n * 4].view(torch.float32)
    handle = window._handle
    launch = peer_kernels.exchange(window.pointers, window.pads, rank, n * 4, world, "gather", 10**7)
    pieces = {
        "exchange kernel (all_gather)": lambda: launch(out, inp, 0),
        "copy into the window": lambda: mine.copy_(inp),
        "barrier": lambda: handle.barrier(channel=0, timeout_ms=60_000),
        "gather kernel": lambda: peer_kernels.gather(out, window.pointers, 0, n * 4, world),
        "foreach copy out of peers": lambda: torch._foreach_copy_(
            list(out.view(world, -1).unbind(0)), [b[: n * 4].view(torch.float32) for b in window.buffers]
        ),
        "watchdog.watch": lambda: watchdog.watch(dev, window.stall_limit(None), "probe"),
        "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    }
    for name, fn in pieces.items():
        host, gpu = host_and_gpu(fn, 300)
        say(f"{name:28s} host {host:8.1f} us/call   gpu {gpu:8.1f} us/call", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        comm.all_gather(out, inp, algorithm="direct")
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            comm.all_gather(out, inp, algorithm="direct")
        torch.cuda.synchronize()
    if rank == 0:
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
