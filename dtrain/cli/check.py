"""``dtrain check``: prove every registered algorithm on symbolic chunks for world sizes 1..N.

Rooted collectives are checked for every root, hierarchical ones for every node size that divides the world;
the table shows rounds/transfers for root 0 and the smallest node size that makes more than one node.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from dtrain.bench.report import wide_console
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.check import check
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective, ScheduleError

__all__ = ["check_all", "Cell"]

Cell = tuple[str, bool]  # (text, passed)


def _variants(collective: Collective, algorithm: str, world: int) -> list[tuple[int | None, int | None]]:
    """(root, local_size) pairs to check; the first is the one the table shows."""
    roots: list[int | None] = list(range(world)) if collective in ROOTED_COLLECTIVES else [None]
    sizes: list[int | None] = [None]
    if registry.needs_local_size(algorithm):
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        sizes = sorted(divisors, key=lambda d: (not 1 < d < world, d))
    return [(root, size) for size in sizes for root in roots]


def _check_cell(collective: Collective, algorithm: str, world: int, pipeline: int) -> Cell:
    shown = None
    for root, local_size in _variants(collective, algorithm, world):
        try:
            schedule = registry.build(collective, algorithm, world, root=root, pipeline=pipeline, local_size=local_size)
        except ScheduleError as exc:
            return f"FAIL: {exc}", False
        except ValueError:
            continue  # this world size (or node size) is outside what the algorithm supports
        try:
            report = check(schedule)
        except ScheduleError as exc:
            return f"FAIL root={root} L={local_size}: {exc}", False
        if shown is None:
            shown = f"{report.num_rounds}/{report.num_transfers}"
    return (shown or "n/a"), True


def check_all(max_world: int, pipeline: int = 1, console: Console | None = None) -> bool:
    """Check everything registered on 1..``max_world`` ranks, print the table; True if all passed."""
    if max_world < 1:
        raise ValueError(f"max_world must be >= 1, got {max_world}")
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1 (pieces a pipelined algorithm cuts the buffer into), got {pipeline}")
    table = Table(title=f"dtrain check: rounds/transfers, worlds 1..{max_world}, pipeline={pipeline}")
    table.add_column("collective", no_wrap=True)
    table.add_column("algorithm", no_wrap=True)
    for world in range(1, max_world + 1):
        table.add_column(f"W={world}", justify="right", no_wrap=True)
    failures = []
    for collective in Collective:
        for algorithm in registry.names(collective):
            cells = [_check_cell(collective, algorithm, w, pipeline) for w in range(1, max_world + 1)]
            failures += [text for text, ok in cells if not ok]
            row = [text if ok else "[red]FAIL[/red]" for text, ok in cells]
            table.add_row(collective.value, algorithm, *row)
    console = console or wide_console()
    # the table's natural width, even where the terminal is narrower: names and headers are never cut
    needed = Measurement.get(console, console.options.update_width(1 << 14), table).maximum
    width = console.width
    console.width = max(width, needed)
    try:
        console.print(table)
    finally:
        console.width = width
    for text in failures:
        console.print(f"[red]{text}[/red]")
    checked = sum(len(registry.names(c)) for c in Collective) * max_world
    passed = checked - len(failures)
    colour = "red" if failures else "green"
    console.print(f"[{colour}]dtrain check: {passed} checks passed, {len(failures)} failed[/{colour}]")
    return not failures
