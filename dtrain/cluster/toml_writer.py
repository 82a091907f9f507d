"""Writing topology files (the format :mod:`dtrain.cluster.files` reads), TOML formatted by hand.

The standard library reads TOML but does not write it; the subset written here is small: strings, numbers,
booleans, and arrays of tables. A duplex pair of links (both directions with the same rate, latency and kind)
is written once; anything else one direction at a time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dtrain.cluster.topology import Topology

__all__ = ["dumps", "dumps_build", "save", "toml_value"]


def toml_value(value: Any) -> str:
    """One TOML value: a basic string (JSON's escapes are TOML's), an integer, a float or a boolean."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} to a topology file")
        return repr(value)
    if isinstance(value, str):
        # JSON escapes every control character TOML forbids except DEL, which TOML forbids too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise ValueError(f"cannot write {type(value).__name__} {value!r} as a TOML value")


def _table(header: str, fields: dict[str, Any]) -> list[str]:
    return [header, *(f"{key} = {toml_value(value)}" for key, value in fields.items() if value is not None), ""]


def dumps(topology: Topology) -> str:
    """``topology`` as explicit ``[[node]]`` and ``[[link]]`` tables (GPUs with their three figures)."""
    lines = [f"name = {toml_value(topology.name)}", ""]
    devices = {d.name: d for d in topology.devices()}
    for name, attrs in topology.graph.nodes(data=True):
        fields = {"name": name, "kind": attrs["kind"], "server": attrs.get("server"), "rack": attrs.get("rack"),
                  "layer": attrs.get("layer")}  # fmt: skip
        if name in devices:
            d = devices[name]
            fields |= {"peak_flops": d.peak_flops, "memory_bytes": d.memory_bytes,
                       "memory_bytes_per_s": d.memory_bytes_per_s}  # fmt: skip
        lines += _table("[[node]]", fields)
    written: set[tuple[str, str]] = set()
    for link in topology.links():
        if (link.src, link.dst) in written:
            continue
        back = topology.graph.get_edge_data(link.dst, link.src)
        duplex = back is not None and (back["link"].bytes_per_s, back["link"].latency_s, back["link"].kind) == (
            link.bytes_per_s, link.latency_s, link.kind)  # fmt: skip
        written |= {(link.src, link.dst), (link.dst, link.src)} if duplex else {(link.src, link.dst)}
        fields = {"a": link.src, "b": link.dst, "kind": link.kind, "bytes_per_s": link.bytes_per_s,
                  "latency_s": link.latency_s, "duplex": duplex}  # fmt: skip
        lines += _table("[[link]]", fields)
    return "\n".join(lines)


def dumps_build(name: str, preset: str | None = None, **params: Any) -> str:
    """A builder-spec file: ``[build]`` with ``preset`` (optional) and its parameters."""
    fields = {"preset": preset, **params}
    return "\n".join([f"name = {toml_value(name)}", "", *_table("[build]", fields)])


def save(topology: Topology, path: str | Path) -> Path:
    """Write ``topology`` to ``path`` (explicit form), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dumps(topology))
    tmp.replace(path)
    return path
