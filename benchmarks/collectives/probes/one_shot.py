"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py one-shot [--sizes 8K,64K,256K,1M,4M]

Probe: what the one-pass all-reduce kernels of torch's symmetric memory (``one_shot_all_reduce_copy_out``,
``two_shot_all_reduce_out``: the barrier is a signal written into each peer's pad and awaited on the device,
inside the kernel) cost beside NCCL's all-reduce and dtrain's ``auto`` and ``direct``, for small and medium
buffers: ``iters`` calls between two synchronisations, the candidates alternating in rounds, the slowest rank's
time. Also: which dtypes and reductions each kernel accepts, and the largest error of ``auto``'s result against
the exact sum beside NCCL's (printed where it is over twice NCCL's). Used to pick the latency path of the peer
transport.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import dtrain.comm as comm


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _candidates(x, out, view, group_name: str) -> dict:
    def one_shot():
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", group_name, out)

    def two_shot():
        view.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(view, "sum", group_name, out)

    return {
        "nccl": lambda: dist.all_reduce(x),
        "one_shot": one_shot,
        "two_shot": two_shot,
        "auto": lambda: comm.all_reduce(x),
        "direct": lambda: comm.all_reduce(x, algorithm="direct"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8K,32K,128K,256K,1M,4M,16M")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    say = print if rank == 0 else (lambda *a, **k: None)
    biggest = max(_bytes(s) for s in args.sizes.split(","))
    buf = symm_mem.empty(biggest // 2, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(buf, group_name)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in ("sum", "avg"):
            for name in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
                x = torch.full((4096,), float(rank + 1), dtype=dtype, device=dev)
                out = torch.empty_like(x)
                try:
                    view = buf.view(torch.uint8)[: x.numel() * x.element_size()].view(dtype)
                    if name.startswith("one"):
                        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, op, group_name, out)
                    else:
                        view.copy_(x)
                        torch.ops.symm_mem.two_shot_all_reduce_out(view, op, group_name, out)
                    torch.cuda.synchronize()
                    want = sum(range(1, world + 1)) / (world if op == "avg" else 1)
                    say(f"{name} {dtype} {op}: {'ok' if float(out[0]) == want else f'wrong {float(out[0])}'}")
                except Exception as err:  # noqa: BLE001 - a probe reports what the kernel refuses
                    say(f"{name} {dtype} {op}: refused: {str(err).splitlines()[0][:120]}")
    for size in [_bytes(s) for s in args.sizes.split(",")]:
        x = torch.randn(size // 2, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(x)

        for dtype in (torch.bfloat16, torch.float32, torch.float16):  # auto, repeated: error against NCCL's
            for op in ("sum", "avg"):
                errors = []
                for _ in range(3):
                    src = torch.randn(size // 4, dtype=dtype, device=dev)
                    ours, ref, exact = src.clone(), src.clone(), src.double()
                    comm.all_reduce(ours, op=op)
                    dist.all_reduce(ref, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM)
                    dist.all_reduce(exact)
                    exact = exact / world if op == "avg" else exact
                    errors.append([(t.double() - exact).abs().max().item() for t in (ours, ref)])
                ours_err, nccl_err = max(e[0] for e in errors), max(e[1] for e in errors)
                if ours_err > 2 * nccl_err + 1e-6:
                    say(f"auto all_reduce {size} bytes {dtype} {op}: max error {ours_err:.3g}, NCCL's {nccl_err:.3g}")
        cands = _candidates(x, out, buf[: x.numel()], group_name)
        times = {k: [] for k in cands}
        for fn in cands.values():
            for _ in range(5):
                fn()
        for _ in range(args.rounds):
            for name, fn in cands.items():
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
                mine = torch.tensor([(time.perf_counter() - t0) / args.iters * 1e6], device=dev)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                times[name].append(float(mine))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        cells = "  ".join(f"{k} {v:7.1f} us ({med['nccl'] / v:4.2f}x)" for k, v in med.items())
        say(f"{size >> 10:>7} KiB bf16  {cells}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
