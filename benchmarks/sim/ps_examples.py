"""Usage: python benchmarks/sim/ps_examples.py

Parameter-server steps on the 4-rack preset, predicted by dtrain.sim.ps (docs/simulator.md, "Parameter-server steps").

8 servers and 56 workers; a small dense model and Zipf-distributed embedding rows each step (a click-through
model's shape). Two placements: servers beside their workers (CPU 0 of every other machine, workers on
GPUs 1-7 of the same machines), and a rack of servers (rack 3's CPUs) apart from the workers. Printed as a
markdown table; no cluster is measured.

    python benchmarks/sim/ps_examples.py
"""

from __future__ import annotations

import time

from dtrain.cluster.presets import preset
from dtrain.sim.ps import PSStep, simulate_ps

DENSE_BYTES = 20e6  # 5 M fp32 parameters
EMBEDDING = dict(rows_per_worker=50_000, key_space=2_000_000, row_bytes=256, zipf=1.1, seed=0)  # 64 fp32 a row
APPLY_S_PER_BYTE = 1 / 5e9  # a server's optimizer streams its shard at ~5 GB/s (Adam on a CPU core or so)
HOT = dict(hot_keys=16_384, hot_replicas=3)


def beside(topology) -> tuple[list[str], list[str]]:
    """Servers beside their workers: CPU 0 of every other machine, workers on GPUs 1-7 of the same machines."""
    machines = topology.servers()[::2]  # s0, s2, ..., s14: two a rack
    return [f"{m}/gpu{g}" for m in machines for g in range(1, 8)], [f"{m}/cpu0" for m in machines]


def own_rack(topology) -> tuple[list[str], list[str]]:
    """A rack of servers: both CPUs of rack 3's four machines; workers on every GPU of the first seven machines."""
    machines = topology.servers()
    servers = [f"{m}/cpu{c}" for m in machines[12:] for c in (0, 1)]
    return [f"{m}/gpu{g}" for m in machines[:7] for g in range(8)], servers


CASES = [  # (placement, mode, replicas, hot copies)
    (beside, "sync", 1, {}),
    (beside, "sync", 1, HOT),
    (beside, "sync", 3, HOT),
    (beside, "async", 1, HOT),
    (own_rack, "sync", 1, {}),
    (own_rack, "sync", 1, HOT),
]


def main() -> None:
    print("| servers | links | mode | replicas | hot copies | step (last worker) | median worker | bytes max/mean "
          "| pulls max/mean | bottleneck (utilisation) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    start = time.perf_counter()
    for oversubscription in (1, 4):
        topology = preset("4-rack", oversubscription=oversubscription)
        for place, mode, replicas, hot in CASES:
            workers, servers = place(topology)
            step = PSStep(workers=workers, servers=servers, dense_bytes=DENSE_BYTES, mode=mode, replicas=replicas,
                          apply_s_per_byte=APPLY_S_PER_BYTE, **EMBEDDING, **hot)  # fmt: skip
            result = simulate_ps(topology, step)
            median = sorted(result.worker_s)[len(result.worker_s) // 2]
            print(
                f"| {place.__name__.replace('_', ' ')} | 1:{oversubscription} | {mode} | {replicas} "
                f"| {'yes' if hot else 'no'} | {result.time_s * 1e3:.1f} ms | {median * 1e3:.1f} ms "
                f"| {result.byte_imbalance:.2f} | {result.pull_imbalance:.2f} "
                f"| {result.bottleneck.link.name} ({result.bottleneck.utilisation:.0%}) |",
                flush=True,
            )
    print(f"\n(simulated in {time.perf_counter() - start:.0f} s of CPU on this machine)")


if __name__ == "__main__":
    main()
