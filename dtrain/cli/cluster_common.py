"""What ``dtrain topology``, ``dtrain calc`` and ``dtrain simulate`` share: ``--set KEY=VALUE`` preset
parameters and the table of a simulation's busiest links."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["parse_setting", "link_rows", "link_table"]


def parse_setting(text: str) -> tuple[str, Any]:
    """``"racks=2"`` -> ``("racks", 2)``: ``true``/``false`` become booleans, numbers int or float, the rest a
    string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set wants KEY=VALUE, got {text!r}")
    if value.strip().lower() in ("true", "false"):
        return key.strip(), value.strip().lower() == "true"
    for convert in (int, float):
        try:
            return key.strip(), convert(value)
        except ValueError:
            pass
    return key.strip(), value.strip()


def link_rows(links, count: int) -> list[dict]:
    """The first ``count`` of a simulation's link usages (busiest first) as JSON-ready rows."""
    return [
        {"link": u.link.name, "kind": u.link.kind, "gbyte_per_s": u.link.bytes_per_s / 1e9, "bytes": u.nbytes,
         "utilisation": u.utilisation}
        for u in links[:count]
    ]  # fmt: skip


def link_table(rows: list[dict], title: str) -> Table:
    """:func:`link_rows` as a table."""
    table = Table(title=title)
    for column in ("link", "kind", "GB/s", "bytes", "utilisation"):
        table.add_column(column, justify="left" if column in ("link", "kind") else "right")
    for r in rows:
        table.add_row(r["link"], r["kind"], f"{r['gbyte_per_s']:.1f}", f"{r['bytes']:.3g}", f"{r['utilisation']:.1%}")
    return table
