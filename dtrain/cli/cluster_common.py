"""What ``dtrain topology``, ``dtrain calc`` and ``dtrain simulate`` share: ``--set KEY=VALUE`` preset
parameters and the table of a simulation's busiest links."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.table import Table

__all__ = ["MAX_PARTS", "parse_setting", "resolve_topology", "link_rows", "link_table"]

#: The most parts a preset or a file's ``[build]`` is built with here: devices, NICs and CPUs, and the links between
#: switches (:func:`dtrain.cluster.builders.spec_parts`; about 7 s to build and summarise on 2 cores; 32768 GPUs of
#: 4-rack's servers fit).
MAX_PARTS = 1 << 17


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


def resolve_topology(name_or_path: str, settings: list[str], flag: str = "--set"):
    """The topology of a preset with ``settings`` (``KEY=VALUE`` each) or of a file, as
    :func:`dtrain.cluster.files.resolve` builds it; a preset or a file's ``[build]`` whose parameters make more
    than :data:`MAX_PARTS` parts is refused first, naming ``flag`` or the file."""
    from dtrain.cluster.builders import spec_parts
    from dtrain.cluster.files import load, resolve
    from dtrain.cluster.presets import PRESETS, preset_spec

    overrides = dict(parse_setting(s) for s in settings)
    if name_or_path in PRESETS:
        with _naming(flag, overrides):
            spec = preset_spec(name_or_path, **overrides)
        parts = spec_parts(spec)
        if parts > MAX_PARTS:
            given = " ".join(f"{k}={v}" for k, v in overrides.items())
            raise ValueError(
                f"{flag} {given}: {name_or_path} would have {parts:,} devices, NICs, CPUs and switch links; at most "
                f"{MAX_PARTS:,} are built ({spec.racks * spec.servers_per_rack * spec.server.gpus:,} devices here)"
            )
    elif not overrides and Path(name_or_path).exists():
        return load(name_or_path, max_parts=MAX_PARTS)
    with _naming(flag, overrides):
        return resolve(name_or_path, **overrides)


@contextmanager
def _naming(flag: str, overrides: dict[str, Any]) -> Iterator[None]:
    """A ValueError raised inside, about ``overrides`` given with ``flag``, raised again naming ``flag`` and the
    settings its message names (every one where it names none)."""
    try:
        yield
    except ValueError as exc:
        if not overrides:
            raise
        text = str(exc)
        named = [k for k in overrides if re.search(rf"(?<![\w]){re.escape(k)}(?![\w])", text)] or list(overrides)
        given = " ".join(f"{flag} {k}={overrides[k]}" for k in named)
        raise ValueError(f"{given}: {text}") from None
