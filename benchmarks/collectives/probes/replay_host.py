"""Usage: torchrun --nproc-per-node 4 benchmarks/collectives/probe.py replay-host

Probe: where a replayed peer-transport call spends host time (torchrun on the GPUs of one host).

For dtrain's ring all-reduce on the default transport (peer memory, replays on) at 16 KiB, 1 MiB and 64 MiB it
prints host microseconds to enqueue one call (no synchronisation inside the loop) and GPU microseconds per call
for: the whole API call (replayed), the same with the watchdog's event turned off, the bare ``graph.replay()``,
the replay on a side stream with two stream waits, and the eager call
(``DTRAIN_COMM_PERSISTENT=0``). Checks the replayed result against NCCL's once per size.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import dtrain.comm as comm
from dtrain.comm import api
from dtrain.comm.peer import watchdog
from probes import peer_host


def host_and_gpu(fn, iters):
    return peer_host.host_and_gpu(fn, iters, warmup=3)


def _probe(numel: int, dev: torch.device, say) -> None:
    iters = 30 if numel >= 1 << 24 else 200
    x = torch.randn(numel, device=dev)
    want = x.clone()
    dist.all_reduce(want)
    got = x.clone()
    comm.all_reduce(got, algorithm="ring")
    comm.all_reduce(got.copy_(x), algorithm="ring")  # captured here
    comm.all_reduce(got.copy_(x), algorithm="ring")  # replayed
    err = (got - want).abs().max().item()

    def api_call():
        comm.all_reduce(x, algorithm="ring")

    cap = comm.capture(api_call)
    side = torch.cuda.Stream()

    def old_style():
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            cap._graph.replay()
        current.wait_stream(side)

    rows = {
        "API, replayed (default)": api_call,
        "API, replayed, no watchdog": "nowatch",
        "bare graph.replay()": lambda: cap._graph.replay(),
        "replay on a side stream (before)": old_style,
        "API, eager (PERSISTENT=0)": "eager",
    }
    real = watchdog.watch
    for name, fn in rows.items():
        if fn == "nowatch":
            watchdog.watch = lambda *a, **k: None
            fn = api_call
        elif fn == "eager":
            os.environ["DTRAIN_COMM_PERSISTENT"] = "0"
            fn = api_call
        host, gpu = host_and_gpu(fn, iters)
        watchdog.watch = real
        os.environ.pop("DTRAIN_COMM_PERSISTENT", None)
        say(f"{numel * 4 >> 10:>7} KiB  {name:34s} host {host:8.1f} us/call   gpu {gpu:8.1f} us/call", flush=True)
    say(f"{numel * 4 >> 10:>7} KiB  replayed result against NCCL: max abs error {err:.2e}", flush=True)
    cap.release()


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"transport: {api.transport_name(None, dev)}", flush=True)
    for numel in (4096, 1 << 18, 16 << 20):
        _probe(numel, dev, say)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
