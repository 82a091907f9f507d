"""Demo: a peer that never comes, on the default CUDA transport (torchrun, 2 or more GPUs of one host).

Ranks 0 and 1 make a group with a 6 s timeout and run one all-reduce on it together; then rank 1 stays away
from the second all-reduce. Rank 0's watchdog should report the call after ~6 s, the device barrier should
give up ~5 s later naming rank 1 and the barrier's channel, and rank 0 should then fail at its next CUDA call.
Prints what rank 0 saw and when; exits 0 if the failure came, 1 if the call returned normally.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import dtrain.comm as comm
from dtrain.comm import api


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=6))
    if rank > 1:
        time.sleep(30)
        return 0
    x = torch.ones(1 << 20, device=dev)
    comm.all_reduce(x, group=group, algorithm="ring")
    torch.cuda.synchronize()
    print(f"rank {rank}: transport {api.transport_name(group, dev)}, first call right: {x[0].item() == 2}", flush=True)
    if rank == 1:
        time.sleep(30)  # never calls again
        return 0
    start = time.monotonic()
    comm.all_reduce(x, group=group, algorithm="ring")
    print(f"rank 0: the call returned to the host after {time.monotonic() - start:.2f} s (it runs on the GPU)")
    try:
        torch.cuda.synchronize()
    except Exception as err:  # the device barrier gave up: the CUDA context is lost
        print(f"rank 0: synchronize failed after {time.monotonic() - start:.1f} s: {type(err).__name__}: {err}")
        sys.stdout.flush()
        os._exit(0)
    print(f"rank 0: no failure after {time.monotonic() - start:.1f} s")
    return 1


if __name__ == "__main__":
    sys.exit(main())
