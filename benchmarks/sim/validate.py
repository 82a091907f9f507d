"""Usage: python benchmarks/sim/validate.py SUITE [OPTIONS]   (SUITE --help for its options)

The simulator (dtrain.sim) against measurements in benchmarks/results/; no GPU needed. Suites:

  captured    every collective and algorithm, dtrain's and NCCL's, captured whole as CUDA graphs (the devices'
              time), 1 MiB-1 GiB, on 4 x H200 and 4 x H100: the peer-transport model with one GPU's port shared
              and the NCCL model (writes sim_validation-captured.jsonl with --out)
  peer-h100   the peer-transport model against 4 x H100 runs of dtrain's defaults (graph replays, push form
              from 64 MiB), every GPU figure from the H100's micro-benchmarks
  peer-h200   the peer-transport model against 4 x H200 eager and replayed sweeps, pull and push forms
  p2p-h200    the point-to-point transport's calibrated and fitted software costs against 4 x H200 eager runs
  published   training steps of large GPT runs on A100 and H100 clusters against their published iteration
              times, a validation and a held-out set (benchmarks/sim/published.toml; --out, --rows,
              --flow-limit, --plan with --plan-out and --plan-limit)
  training-h100  dtrain's own training runs on 4 x H100 (Llama 1B layouts, ZeRO-3, recomputation, the largest
              ZeRO-3 model): the step simulator with compute priced per operation (--out)
  transports  NCCL's own collectives (the NCCL model) and NVLink / host shared memory / sockets on 4 x H200

Each prints its tables (median and worst |predicted / measured - 1|); the figures quoted in docs/results.md
come from ``captured`` and ``transports``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SUITES = {
    "captured": "captured",
    "peer-h100": "peer_h100",
    "peer-h200": "peer_h200",
    "p2p-h200": "p2p_h200",
    "transports": "transports",
    "published": "published",
    "training-h100": "training_h100",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"validate.py: unknown SUITE {suite!r}; one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent / "validation"))
    module = importlib.import_module(SUITES[suite])
    sys.argv = [f"{sys.argv[0]} {suite}", *rest]
    module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
