"""Find what crashes ``DTRAIN_COMM_PERSISTENT=1`` in ``dtrain bench comm`` (run under torchrun, GPUs of one host).

Runs the real ``dtrain bench comm`` all-reduce sweep with some parts of :mod:`dtrain.comm.persistent` changed,
one change per variant, and logs every capture, replay and eviction to ``OUT/persistent-rank<r>.log`` (line
buffered, so the last lines before a segmentation fault survive). A variant that finishes the sweep names
the cause. Variants (argv[1], comma separated):

  plain     nothing changed (the crash as seen)
  sync      synchronize the device after every replay (back-to-back replays without a host sync)
  global    capture in "global" error mode instead of "thread_local"
  noevict   never evict a graph (no graph is reset while the sweep runs)
  keep      keep every benchmark buffer alive (no address is ever reused by a buffer of another case)
  noreplay  capture, but run the eager call instead of the replay (is it the capture or the replay?)

Usage: torchrun --nproc-per-node 4 benchmarks/persistent_diag.py VARIANTS OUTDIR [bench comm arguments...]
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch


def main() -> None:
    variants = set(sys.argv[1].split(","))
    out = sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, f"persistent-rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.enable(all_threads=False)

    from dtrain.bench import comm as bench_comm
    from dtrain.comm import graph as graph_mod
    from dtrain.comm import persistent

    def describe(key) -> str:
        schedule, push, ptr, numel, dtype, op, generation = key
        return f"{schedule.algorithm}{' push' if push else ''} ptr={ptr:#x} numel={numel} gen={generation}"

    original_run = persistent.run
    state = {"calls": 0}

    def traced_run(key, call, device):
        state["calls"] += 1
        held = persistent._GRAPHS.get(key)
        action = "replay" if held is not None else "eager/capture"
        log.write(f"{state['calls']} {action} {describe(key)} held={persistent.held()}\n")
        if "noreplay" in variants and held is not None:
            call()
            return
        original_run(key, call, device, capture=persistent._capture)

    persistent.run = traced_run
    if "global" in variants:

        def capture_global(call, device):
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode="global"):
                call()
            return graph_mod.CapturedCollective(g, stream)

        persistent._capture = capture_global
    if "noevict" in variants:
        persistent.MAX_GRAPHS = 10**6
    original_release = graph_mod.CapturedCollective.release

    def traced_release(self):
        log.write(f"release graph {id(self):#x}\n")
        original_release(self)

    graph_mod.CapturedCollective.release = traced_release
    if "sync" in variants:
        original_call = graph_mod.CapturedCollective.__call__

        def synced(self):
            original_call(self)
            torch.cuda.synchronize()

        graph_mod.CapturedCollective.__call__ = synced
    if "keep" in variants:
        kept = []
        original_operation = bench_comm._operation

        def keeping(coll, nbytes, world, rank_, device):
            call, moved = original_operation(coll, nbytes, world, rank_, device)
            kept.append(call)  # the closure holds its buffers
            return call, moved

        bench_comm._operation = keeping

    from dtrain.cli.main import main as cli

    status = cli(["bench", "comm", *sys.argv[3:]])
    log.write(f"finished, status {status}\n")
    print(f"rank {rank} variant {','.join(sorted(variants))}: finished the sweep", flush=True)


if __name__ == "__main__":
    main()
