"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py exchange-programs

Probe: the exchange kernel (``dtrain.comm.peer.kernels.exchange``) by its program count, beside NCCL's own call.

For each form (the all-gather, the all-to-all and the reduce-scatter, ``direct``; the broadcast, ``star``, and
``relay``, the scatter-allgather; the two-shot all-reduce; ``EXCHANGE_FORMS`` names some, comma-separated) and each
full buffer size from 1 MiB to 32 MiB, the kernel alone on a window of its own (alternating halves, so a call never
overwrites what a slow peer may still read) with 16 to 256 programs (as the signal pad allows: ``world`` slots a
program), and torch.distributed's NCCL call on the same sizes, rounds interleaved: microseconds per call (a loop of
calls between two synchronisations, the slowest rank's), and NCCL's time over each.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from dtrain.comm.peer import kernels as peer_kernels
from dtrain.comm.peer import window as peer
from probes import start_rank

SIZES_MIB = (1, 2, 4, 8, 16, 32)
PROGRAMS = (16, 32, 64, 128, 256)
FORMS = ("gather", "exchange", "scatter", "broadcast", "relay", "two_shot")
ROUNDS, ITERS = 3, 40


def _time(fn, iters: int) -> float:
    """Microseconds a call, the slowest rank's, over ``iters`` calls between two synchronisations."""
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    took = torch.tensor([(time.perf_counter() - start) / iters * 1e6], device="cuda")
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _nccl_and_buffers(form: str, out: torch.Tensor, small: torch.Tensor, big: torch.Tensor):  # noqa: ANN202
    """NCCL's call for ``form`` and the kernel's ``(out, inp)``: ``small`` a rank's block, ``big`` the full buffer."""
    if form == "gather":
        return (lambda: dist.all_gather_into_tensor(out, small)), (out, small)
    if form == "exchange":
        return (lambda: dist.all_to_all_single(out, big)), (out, big)
    if form == "scatter":
        return (lambda: dist.reduce_scatter_tensor(small, big)), (small, big)
    if form == "two_shot":
        return (lambda: dist.all_reduce(out)), (out, big)
    return (lambda: dist.broadcast(big, 0)), (out, big)


def main() -> None:
    dev, rank, world, say = start_rank()
    window = peer.window_for(None, dev, 2 * max(SIZES_MIB) * 2**20 + 4096)
    channels = window.channels
    say(f"world {world}, signal-pad channels {channels}; microseconds a call (NCCL over ours in brackets)")
    forms = os.environ.get("EXCHANGE_FORMS", ",".join(FORMS)).split(",")
    for form in forms:
        if form == "relay" and world < 3:
            continue
        for mib in SIZES_MIB:
            full = mib * 2**20
            n = full // 4  # float32 elements of the full buffer
            nbytes = full // world if form in ("gather", "exchange", "scatter", "two_shot") else full
            big, small = torch.randn(n, device=dev), torch.empty(n // world, device=dev)
            out = torch.empty(n, device=dev)
            nccl, io = _nccl_and_buffers(form, out, small, big)
            half = window.nbytes // 2 // 4096 * 4096
            variants = {"nccl": nccl}
            for programs in PROGRAMS:
                if programs > channels:
                    continue
                launch = peer_kernels.exchange(
                    window.pointers, window.pads, rank, nbytes, world, form, 10**7, programs=programs,
                    dtype=torch.float32,
                )  # fmt: skip
                state = {"at": 0}

                def call(launch=launch, state=state, io=io, half=half) -> None:
                    launch(*io, state["at"])
                    state["at"] = half - state["at"]

                variants[f"p{programs}"] = call
            for fn in variants.values():
                fn()
            times: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(ROUNDS):
                names = list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
                for name in names:
                    times[name].append(_time(variants[name], ITERS))
            best = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            cells = "  ".join(
                f"{name} {us:8.1f}" + ("" if name == "nccl" else f" ({best['nccl'] / us:4.2f}x)")
                for name, us in best.items()
            )
            say(f"{form:9s} {mib:3d} MiB  {cells}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
