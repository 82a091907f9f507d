# ruff: noqa: B023  (every closure here is timed at once, inside its loop iteration)
"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py symm

Probe: what moving a round through peer memory (torch symmetric memory) costs on this GPU host.

Run under torchrun on every GPU of one host. Prints, per size: NCCL's all-reduce, a device-side barrier, a
pull copy and a pull add from one peer and from all peers at once, and prototype ring and direct
all-reduces that read peers' buffers directly (one barrier a round), checked against NCCL's result; beside
them dtrain's ring and direct over NCCL point-to-point. Used to decide the design of dtrain.comm.peer.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import dtrain.comm as comm
from probes import start_rank


def timed(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters * 1e3], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    dev, rank, world, say = start_rank()
    group = dist.group.WORLD
    maxn = (1 << 30) // 4
    try:
        symm_mem.enable_symm_mem_for_group(group.group_name)
    except Exception as err:  # newer torch needs no enabling
        say("enable_symm_mem_for_group:", err)
    ws = symm_mem.empty(maxn, dtype=torch.float32, device=dev)
    h = symm_mem.rendezvous(ws, group.group_name)
    peers = [h.get_buffer(p, (maxn,), torch.float32) for p in range(world)]
    say(f"backend={symm_mem.get_backend(dev)} world={world} {torch.cuda.get_device_name(dev)}", flush=True)
    say(f"barrier: {timed(lambda: h.barrier(channel=0), iters=200):.1f} us", flush=True)

    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _sum4(out, a, b, c, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            x = tl.load(out + i, mask=m) + tl.load(a + i, mask=m) + tl.load(b + i, mask=m) + tl.load(c + i, mask=m)
            tl.store(out + i, x, mask=m)

        def sum4(out, a, b, c):
            n = out.numel()
            _sum4[(triton.cdiv(n, 4096),)](out, a, b, c, n, BLOCK=4096)
    except Exception as err:
        say("triton unavailable:", err)
        sum4 = None

    prev, nxt = (rank - 1) % world, (rank + 1) % world
    others = [p for p in range(world) if p != rank]
    side = [torch.cuda.Stream() for _ in others]
    for mib in (16, 64, 256, 1024):
        n = mib * (1 << 20) // 4
        c = n // world
        x = torch.randn(n, device=dev)
        ref = x.clone()
        dist.all_reduce(ref)
        ch = [slice(i * c, (i + 1) * c) for i in range(world)]
        row = {}
        row["nccl"] = timed(lambda: dist.all_reduce(x))
        row["local copy"] = timed(lambda: ws[:n].copy_(x))
        row["pull copy 1 peer (chunk)"] = timed(lambda: ws[ch[rank]].copy_(peers[prev][ch[nxt]]))
        row["pull add 1 peer (chunk)"] = timed(lambda: ws[ch[rank]].add_(peers[prev][ch[nxt]]))

        def seq_add():
            for p in others:
                ws[ch[rank]].add_(peers[p][ch[rank]])

        row["pull add 3 peers seq"] = timed(seq_add)
        if sum4 is not None and world == 4:
            row["pull sum4 triton"] = timed(lambda: sum4(ws[ch[rank]], *(peers[p][ch[rank]] for p in others)))

        def par_copy():
            cur = torch.cuda.current_stream()
            for s, p in zip(side, others, strict=True):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    ws[ch[p]].copy_(peers[p][ch[p]])
            for s in side:
                cur.wait_stream(s)

        row["pull copy 3 peers par streams"] = timed(par_copy)

        def ring(inplace: bool):
            if not inplace:
                h.barrier(channel=0)
                ws[:n].copy_(x)
            for k in range(world - 1):
                h.barrier(channel=0)
                j = (rank - k - 1) % world
                ws[ch[j]].add_(peers[prev][ch[j]])
            for k in range(world - 1):
                h.barrier(channel=0)
                j = (rank - k) % world
                ws[ch[j]].copy_(peers[prev][ch[j]])
            h.barrier(channel=0)
            if not inplace:
                x.copy_(ws[:n])

        def direct(inplace: bool, fused: bool):
            if not inplace:
                h.barrier(channel=0)
                ws[:n].copy_(x)
            h.barrier(channel=0)
            if fused and sum4 is not None:
                sum4(ws[ch[rank]], *(peers[p][ch[rank]] for p in others))
            else:
                seq_add()
            h.barrier(channel=0)
            par_copy()
            h.barrier(channel=0)
            if not inplace:
                x.copy_(ws[:n])

        variants = {
            "symm ring (registered)": lambda: ring(True),
            "symm ring (copy in/out)": lambda: ring(False),
            "symm direct seq (registered)": lambda: direct(True, False),
            "symm direct triton (registered)": lambda: direct(True, True),
            "symm direct triton (copy in/out)": lambda: direct(False, True),
        }
        for name, fn in variants.items():
            # correctness first: fresh input, one call, compare with NCCL's sum
            x.copy_(ref / world)  # any data; recompute its reference
            want = x.clone()
            dist.all_reduce(want)
            if "registered" in name:
                ws[:n].copy_(x)
                fn()
                got = ws[:n]
            else:
                fn()
                got = x
            torch.cuda.synchronize()
            err = float((got - want).abs().max())
            ok = torch.tensor([1.0 if err <= 1e-3 * float(want.abs().max()) else 0.0], device=dev)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            row[name] = timed(fn) if ok.item() == 1.0 else float("nan")
            say(f"  {name}: max err {err:.2e}", flush=True)
        for algo in ("ring", "direct"):
            row[f"dtrain {algo} (nccl p2p)"] = timed(lambda a=algo: comm.all_reduce(x, algorithm=a), iters=10)
        nccl = row["nccl"]
        for name, us in row.items():
            bus = 2 * (world - 1) / world * n * 4 / (us * 1e-6) / 1e9 if us == us else float("nan")
            say(
                f"{mib:5d} MiB  {name:36s} {us:9.1f} us  busbw-equiv {bus:7.1f} GB/s  {nccl / us:5.2f}x nccl",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
