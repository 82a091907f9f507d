"""Show and keep benchmark results: a progress line, a rich table, JSON lines and a busbw plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

__all__ = [
    "wide_console",
    "Progress",
    "print_table",
    "write_outputs",
    "write_json_lines",
    "plot_busbw",
    "human_bytes",
]


def wide_console() -> Console:
    """A console that does not squeeze wide tables into 80 columns when output is not a terminal."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


class Progress:
    """A rich progress bar over ``total`` steps, or nothing at all when ``enabled`` is false (other ranks)."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self._bar = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self._enabled, self._total, self._task = enabled, total, None

    def __enter__(self) -> Progress:
        if self._enabled:
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self._total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._bar.stop()

    def step(self, description: str) -> None:
        if self._enabled:
            self._bar.update(self._task, advance=1, description=description)

    def note(self, message: str) -> None:
        if self._enabled:
            self._bar.console.print(message)


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(records: Sequence[dict], console: Console | None = None) -> None:
    """One row a measurement: size, algorithm, time, algbw, busbw, the model's time and its ratio."""
    table = Table(title="dtrain bench comm")
    for name in (
        "collective",
        "size",
        "algorithm",
        "time_us",
        "algbw GB/s",
        "busbw GB/s",
        "model_us",
        "model/meas",
    ):
        table.add_column(name, justify="left" if name in ("collective", "algorithm") else "right")
    for r in records:
        algorithm = r["algorithm"]
        if r["resolved_algorithm"] != algorithm:
            algorithm += f" ({r['resolved_algorithm']})"
        table.add_row(
            r["collective"],
            human_bytes(r["nbytes"]),
            algorithm,
            f"{r['time_us']:.1f}",
            f"{r['algbw_gbps']:.3f}",
            f"{r['busbw_gbps']:.3f}",
            _fmt(r["predicted_us"], ".1f"),
            _fmt(r["predicted_over_measured"], ".2f"),
        )
    (console or wide_console()).print(table)


def write_json_lines(records: Sequence[dict], path: Path) -> None:
    """Replace ``path`` with one JSON object a line (whole, or left as it was on a failure)."""
    from dtrain.cli.paths import write_atomic

    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def plot_busbw(records: Sequence[dict], path: Path) -> None:
    """busbw against size, log-log, one panel a collective and one line an algorithm; ``path`` is replaced whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collectives = sorted({r["collective"] for r in records if r["nbytes"] > 0})
    fig, axes = plt.subplots(1, max(1, len(collectives)), figsize=(8.5 * max(1, len(collectives)), 5), squeeze=False)
    for ax, coll in zip(axes[0], collectives, strict=False):
        rows = [r for r in records if r["collective"] == coll]
        # One colour an algorithm; its CUDA-graph replay ("ring+graph") in the same colour, dashed.
        bases = list(dict.fromkeys(r["algorithm"].removesuffix("+graph") for r in rows))
        colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(bases)}
        for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
            line = sorted((r["nbytes"], r["busbw_gbps"]) for r in rows if r["algorithm"] == algorithm)
            graph = algorithm.endswith("+graph")
            ax.plot(
                [x for x, _ in line],
                [y for _, y in line],
                marker="x" if graph else "o",
                linestyle="--" if graph else "-",
                color=colours[algorithm.removesuffix("+graph")],
                linewidth=2.5 if algorithm.removesuffix("+graph") == "native" else 1.5,
                label=algorithm,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        world = rows[0]["world_size"] if rows else "?"
        ax.set_title(f"{coll}, {world} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    from dtrain.cli.paths import atomic_path

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)


def write_outputs(records: Sequence[dict], out: Path, console: Console | None = None) -> None:
    """JSON lines to ``out`` and the plot beside it (``out`` with ``.png``)."""
    write_json_lines(records, out)
    png = out.with_suffix(".png")
    plot_busbw(records, png)
    (console or Console()).print(f"wrote {len(records)} records to {out} and the plot to {png}")
