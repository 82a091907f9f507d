"""Usage: (a package: ``benchmarks/collectives/probe.py MODE`` runs its modules, one a mode)"""


def start_rank():
    """This torchrun rank's GPU and NCCL process group: ``(device, rank, world, say)``, ``say`` printing on rank 0
    only."""
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    return device, rank, world, (print if rank == 0 else (lambda *a, **k: None))


def interleaved(variants: dict, iters: int, rounds: int, device, lone: bool = False):
    """Time ``variants`` (name -> a function making one call) in ``rounds`` rounds, interleaved: each round times
    ``iters`` calls of each between two synchronizations (``iters`` 0: none), and with ``lone`` one call alone
    between two synchronizations too. Returns ``(back_to_back, host, alone)``, name -> a list a round: the slowest
    rank's seconds a call back to back, this rank's host seconds a call, the slowest rank's seconds for the lone
    call (lists left empty where not timed)."""
    import time

    import torch
    import torch.distributed as dist

    def slowest(seconds: float) -> float:
        dt = torch.tensor([seconds], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    back, host, alone = ({k: [] for k in variants} for _ in range(3))
    for _ in range(rounds):
        for name, fn in variants.items():
            if iters:
                fn()
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                host[name].append((time.perf_counter() - t0) / iters)
                torch.cuda.synchronize()
                back[name].append(slowest((time.perf_counter() - t0) / iters))
            if lone:
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                alone[name].append(slowest(time.perf_counter() - t0))
    return back, host, alone


def print_beside_nccl(nbytes: int, checks: dict, times: dict, host: dict, alone: dict, device, width: int) -> None:
    """On rank 0, one line of ``checks`` (name -> agreed on every rank) and one line a variant of what
    :func:`interleaved` timed, against its ``"nccl"`` variant: the median round's time a call, GB/s, NCCL's time
    over it back to back and alone, and every rank's host microseconds a call (``width``: the names' column)."""
    import statistics

    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    base_t, base_one = statistics.median(times["nccl"]), statistics.median(alone["nccl"])
    if rank == 0:
        print(
            f"{nbytes >> 20:6d} MiB  checks: " + ", ".join(f"{k} {'ok' if v else 'WRONG'}" for k, v in checks.items())
        )
    for name, ts in times.items():
        m, one = statistics.median(ts), statistics.median(alone[name])
        h = torch.tensor([statistics.median(host[name])], device=device)
        every = [torch.zeros_like(h) for _ in range(world)]
        dist.all_gather(every, h)
        if rank == 0:
            print(
                f"{nbytes >> 20:6d} MiB  {name:{width}s} {m * 1e6:9.1f} us  {nbytes / m / 1e9:6.1f} GB/s  "
                f"{base_t / m:5.2f}x nccl  one call {one * 1e6:8.1f} us {base_one / one:5.2f}x  host us a call by "
                "rank: " + " ".join(f"{e.item() * 1e6:.1f}" for e in every),
                flush=True,
            )
