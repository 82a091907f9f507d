# ruff: noqa: B023  (every closure here is timed at once, inside its loop iteration)
"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py pull-kernel

Probe: how fast one round's pass runs through peer memory, by kernel and launch shape (torchrun, GPUs of one host).

Every rank at once reads the window of rank r+1 (a ring round) and writes locally, or writes into rank r+1's
window (a push), for chunks of 16 MiB and 256 MiB:

  torch-add      torch.add(local, peer, out=local2): what dtrain.comm.peer uses for a single-output reduce
  torch-copy     local2.copy_(peer)
  triton B/W     dtrain's pull kernel (``peer_triton.pull_kernel``), one source plus a base, at block size B
                 and W warps
  push B/W       a Triton kernel reading two local buffers and storing the sum into the peer's window

Prints GB/s over NVLink per rank (the slowest rank's time) and checks each result. Used to tune
``peer_kernels`` (block size, warps) and to decide whether a push round would be faster than a pull.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from dtrain.comm.peer.triton import pull_kernel


@triton.jit
def push_kernel(dst, a, b, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(a + i, mask=m) + tl.load(b + i, mask=m), mask=m)


def timed(fn, handle, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    handle.barrier(channel=0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters * 1e3], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    handle.barrier(channel=0)
    return float(t)


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(name)
    top = 256 << 20
    buf = symm_mem.empty(top // 4, dtype=torch.float32, device="cuda")
    handle = symm_mem.rendezvous(buf, name)
    nxt = (rank + 1) % world
    peer_all = handle.get_buffer(nxt, (top // 4,), torch.float32)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for nbytes in (16 << 20, 256 << 20):
        n = nbytes // 4
        buf[:n].fill_(float(rank + 1))
        a = torch.full((n,), 2.0, device="cuda")
        out = torch.empty(n, device="cuda")
        peer = peer_all[:n]
        handle.barrier(channel=0)
        want_pull = 2.0 + (nxt + 1)
        rows = []

        def check(label, value):
            got = out[:: max(1, n // 1024)]
            ok = bool(torch.all(got == value))
            rows.append((label, ok))
            return ok

        t = timed(lambda: torch.add(a, peer, out=out), handle)
        check("torch-add", want_pull)
        say(f"{nbytes >> 20:4d} MiB  torch-add        {t:8.1f} us  {nbytes / t / 1e3:6.1f} GB/s")
        t = timed(lambda: out.copy_(peer), handle)
        check("torch-copy", nxt + 1)
        say(f"{nbytes >> 20:4d} MiB  torch-copy       {t:8.1f} us  {nbytes / t / 1e3:6.1f} GB/s")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                grid = (triton.cdiv(n, block),)

                def pull():
                    pull_kernel[grid](
                        out, out, a, peer, peer, peer, n, HAS_OUT1=False, HAS_BASE=True, NSRC=1, OP=0,
                        UPCAST=False, BLOCK=block, num_warps=warps,
                    )  # fmt: skip

                t = timed(pull, handle)
                ok = check(f"triton {block}/{warps}", want_pull)
                say(f"{nbytes >> 20:4d} MiB triton {block:5d}/{warps:2d} {t:8.1f} us  {nbytes / t / 1e3:6.1f} GB/s", ok)
        for block in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                grid = (triton.cdiv(n, block),)
                mine = buf[:n]  # the previous rank pushes into this rank's window

                def push():
                    push_kernel[grid](peer, a, out, n, BLOCK=block, num_warps=warps)

                out.fill_(1.0)
                t = timed(push, handle)
                ok = bool(torch.all(mine[:: max(1, n // 1024)] == 3.0))
                say(f"{nbytes >> 20:4d} MiB push   {block:5d}/{warps:2d} {t:8.1f} us  {nbytes / t / 1e3:6.1f} GB/s", ok)
                buf[:n].fill_(float(rank + 1))
                handle.barrier(channel=0)
        bad = [label for label, ok in rows if not ok]
        if bad:
            print(f"rank {rank}: wrong results from {bad}", flush=True)
    handle.barrier(channel=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
