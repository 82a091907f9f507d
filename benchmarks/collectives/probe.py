"""Usage: torchrun --nproc-per-node N benchmarks/collectives/probe.py MODE [OPTIONS]   (python ... for ``watchdog``)

Micro-benchmarks of the GPU communication paths behind dtrain.comm, one mode a question (``MODE --help`` for a
mode's own options where it has any):

  p2p             point-to-point latency, bandwidth and host cost of NCCL send/recv (the p2p transport's round)
  symm            what a round through peer memory costs: barrier, pull copy and add, prototype ring/direct
  port            how concurrent transfers share one GPU's NVLink port (4 GPUs; ``--patterns`` for chain rounds)
  chain           the pipelined chain broadcast on the peer transport for several piece counts, beside NCCL
  chain-timeline  the device timeline (torch.profiler) of one chain broadcast, one file a rank
  pull-kernel     one round's pass by kernel and launch shape: torch add/copy, Triton pull and push kernels
  peer-host       host time per step of the peer transport: kernel launch, barrier, eager and replayed calls
  replay-host     where a replayed peer-transport call spends host time (API call, bare replay, eager)
  one-shot        torch's one-pass symmetric-memory all-reduce kernels beside NCCL, auto and direct, 8 KiB-16 MiB
  one-pass        where the time of a small one-pass all-gather and all-to-all goes
  exchange-programs the exchange kernel by its program count, beside NCCL's own call
  channels        peer channels step by step (stream memory operations, a ring of messages), then beside NCCL
  channel-latency a message's device latency on a peer channel, each send engine, beside NCCL (recorded)
  chain-channels  the broadcast as a pipelined chain over peer channels (copy engines), beside NCCL
  direct-broadcast the ring broadcast as copies between the callers' own tensors (CUDA IPC), beside NCCL
  direct-reduce   the ring reduce as a chain combining the callers' own tensors (CUDA IPC), beside NCCL
  nccl-ctas       large collectives on NCCL communicators made with more CTAs (minCTAs) than NCCL picks
  nccl-wide       auto's native_wide beside torch's call: the same bits or not, the wide communicator's memory
  watchdog        host microseconds of the watchdog's per-call work on one GPU (no process group)

Every mode but ``watchdog`` runs under torchrun on the GPUs of one host; the outputs quoted in docs/results.md
are in benchmarks/results/probe-*.txt and port-*.jsonl.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

MODES = {
    "p2p": "p2p",
    "symm": "symm",
    "port": "port",
    "chain": "chain",
    "chain-timeline": "chain_timeline",
    "pull-kernel": "pull_kernel",
    "peer-host": "peer_host",
    "replay-host": "replay_host",
    "watchdog": "watchdog",
    "one-shot": "one_shot",
    "one-pass": "one_pass",
    "nccl-ctas": "nccl_ctas",
    "nccl-wide": "nccl_wide",
    "exchange-programs": "exchange_programs",
    "channels": "channels",
    "channel-latency": "channel_latency",
    "chain-channels": "chain_channels",
    "direct-broadcast": "direct_broadcast",
    "direct-reduce": "direct_reduce",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    mode, rest = argv[0], argv[1:]
    if mode not in MODES:
        print(f"probe.py: unknown MODE {mode!r}; one of: {', '.join(MODES)}", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parent
    if rest in (["-h"], ["--help"]):  # the probe's docstring, read without importing it (triton, CUDA)
        print(ast.get_docstring(ast.parse((here / "probes" / f"{MODES[mode]}.py").read_text())))
        return 0
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    module = importlib.import_module(f"probes.{MODES[mode]}")
    sys.argv = [f"{sys.argv[0]} {mode}", *rest]
    module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
