"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py peer-host

Probe: host time per step of the peer transport (torchrun on the GPUs of one host).

Prints the host microseconds one call enqueues (no synchronisation inside the loop) and the GPU time per call
for: a Triton pull-kernel launch, torch.add(out=), copy_, a symmetric-memory barrier, and dtrain's ring
all-reduce through the peer transport with and without Triton and replayed as a CUDA graph; then a cProfile
of the eager all-reduce on rank 0. Used to find where the peer transport's small-message time goes.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import dtrain.comm as comm
from dtrain.comm.peer import kernels as peer_kernels
from dtrain.comm.peer import window as peer

#: Cycles of the sleep kernel queued ahead of a timed loop: longer than the host takes to enqueue the loop (about
#: 50 ms at the GPUs' clock), so the events time the device's work alone, not the host's pace.
SLEEP_CYCLES = int(0.05 * 2.0e9)


def host_and_gpu(fn, iters=200, warmup=5):
    """Host microseconds to enqueue one call (no synchronisation in the loop) and the device's microseconds per
    call: the loop is queued behind a sleep kernel, so the device runs it after the host has issued all of it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / iters * 1e3


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    a, b, c = (torch.randn(4096, device=dev) for _ in range(3))
    assert peer_kernels.triton_ready()
    rows = {
        "triton pull_kernel launch": lambda: peer_kernels._launch([c], a, [b], "sum"),
        "triton dual store": lambda: peer_kernels._launch([c, a], None, [b], "sum"),
        "torch.add(out=)": lambda: torch.add(a, b, out=c),
        "copy_": lambda: c.copy_(b),
    }
    x = torch.randn(4096, device=dev)
    comm.all_reduce(x, algorithm="ring")
    window = peer.window_for(None, dev, 1 << 20)
    rows["symm barrier"] = lambda: window.barrier()
    for size in (4096, 16 << 20):
        x = torch.randn(size, device=dev)
        rows[f"ring all_reduce {size * 4 >> 10} KiB"] = lambda x=x: comm.all_reduce(x, algorithm="ring")
        rows[f"native all_reduce {size * 4 >> 10} KiB"] = lambda x=x: dist.all_reduce(x)
    for name, fn in rows.items():
        host, gpu = host_and_gpu(fn, 100 if "all_reduce" in name else 300)
        say(f"{name:36s} host {host:8.1f} us/call   gpu {gpu:8.1f} us/call", flush=True)
    x = torch.randn(4096, device=dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        comm.all_reduce(x, algorithm="ring")
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    saved = peer_kernels._state["kernel"]
    peer_kernels._state["kernel"] = None
    for size in (4096, 16 << 20):
        x = torch.randn(size, device=dev)
        host, gpu = host_and_gpu(lambda x=x: comm.all_reduce(x, algorithm="ring"), 100)
        say(
            f"ring, torch ops, {size * 4 >> 10} KiB           host {host:8.1f} us/call   gpu {gpu:8.1f} us/call",
            flush=True,
        )
    peer_kernels._state["kernel"] = saved
    for size in (4096, 16 << 20):
        x = torch.randn(size, device=dev)
        for algo in ("ring", "halving_doubling", "direct", "recursive_doubling"):
            replay = comm.capture(lambda x=x, a=algo: comm.all_reduce(x, algorithm=a))
            host, gpu = host_and_gpu(replay, 100)
            say(
                f"{algo}+graph {size * 4 >> 10} KiB            host {host:8.1f} us/call   gpu {gpu:8.1f} us/call",
                flush=True,
            )
            replay.release()
    dist.barrier()
    peer.close_windows()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
