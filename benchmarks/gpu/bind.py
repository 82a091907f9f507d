"""Usage: torchrun --no-python --nproc-per-node N python3 benchmarks/gpu/bind.py CMD [ARGS...]

Runs CMD bound to this local rank's share of the host's physical cores: the cores (one per ``core_id`` and
package, from /sys/devices/system/cpu) are dealt out in order, ``cores / LOCAL_WORLD_SIZE`` to each local rank,
every hardware thread of a core going with it, so no two ranks share a core or its sibling threads. Prints the
binding on stderr. A launch with it beside one without shows whether ranks that drive their GPUs from the host
slow each other through the cores they land on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def physical_cores() -> list[list[int]]:
    """The hardware threads of each physical core, cores in order of their first thread."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            key = (0, cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values(), key=lambda threads: threads[0])


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__.splitlines()[0])
    rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = physical_cores()
    share = max(1, len(cores) // world)
    mine = cores[rank * share : (rank + 1) * share] or cores
    cpus = sorted(cpu for threads in mine for cpu in threads)
    os.sched_setaffinity(0, cpus)
    print(f"bind: local rank {rank} of {world}: {len(mine)} of {len(cores)} cores, cpus {cpus}", file=sys.stderr)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
