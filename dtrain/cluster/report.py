"""Readable output for ``dtrain calc`` and ``dtrain topology``: rich tables over the commands' JSON data.

Each ``render_*`` takes the same dict the command prints with ``--json``, so the table and the JSON never
disagree.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from dtrain.cluster.capacity import switch_capacity
from dtrain.cluster.topology import Topology
from dtrain.cluster.units import format_bytes, format_rate, format_seconds

__all__ = [
    "render_gradients",
    "render_transfer",
    "render_oversubscription",
    "render_allreduce",
    "render_links",
    "render_paths",
    "render_topology",
    "topology_summary",
    "route_summary",
    "ratio_text",
    "print_table",
]


def _longest_word(texts) -> int:
    return max((len(word) for text in texts for word in str(text).split()), default=1)


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every header whole. Rich fits a wide table to a narrow terminal by cutting every
    column alike, headers too ("oversubscript…"). Here the widest columns give way first: down to their longest
    word (cells wrap between words), then, if still too wide, a cell's long word is cut, but never below the
    header's longest word nor, in the first column (the rows' names), below its longest word; the console is
    widened only if those minimums alone do not fit."""
    columns = table.columns
    options = console.options
    widths = [max(Measurement.get(console, options, x).maximum for x in (c.header, *c.cells)) for c in columns]
    # a no_wrap column keeps its width unless it must give way
    whole = [w if c.no_wrap else _longest_word([c.header, *c.cells]) for w, c in zip(widths, columns, strict=True)]
    floors = [whole[0], *(_longest_word([c.header]) for c in columns[1:])]
    room = console.width - 3 * len(columns) - 1  # one space each side of a cell, a rule between and around
    for limits in (whole, floors):
        while sum(widths) > room:
            shrinkable = [i for i, (w, f) in enumerate(zip(widths, limits, strict=True)) if w > f]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    for column, width in zip(columns, widths, strict=True):
        column.width = width
    console.print(table, width=max(console.width, sum(widths) + 3 * len(columns) + 1))


def ratio_text(ratio: float) -> str:
    """``4.0`` -> ``"1:4"`` (available:peak bandwidth, as the ratio is usually written)."""
    return f"1:{ratio:.3g}"


def _link_text(link: dict) -> str:
    rate = format_rate(link["bytes_per_s"])
    return rate if link["label"] in rate else f"{link['label']} at {rate}"


def render_gradients(console: Console, data: dict) -> None:
    console.print(
        f"gradients per replica: {data['params']:.4g} parameters x {data['bytes_per_param']:g} bytes = "
        f"[bold]{format_bytes(data['gradient_bytes'])}[/bold]"
    )
    console.print(f"averaging {data['replicas']} replicas, each on {_link_text(data['link'])}")
    table = Table("method", "on the wire, total", "busiest replica, one way", "time")
    for row in data["averaging"]:
        busiest = format_bytes(row["busiest_replica_bytes"])
        if row["method"] == "gather-broadcast":
            busiest = f"{busiest} in, then {busiest} out"
        table.add_row(row["method"], format_bytes(row["total_bytes"]), busiest, format_seconds(row["seconds"]))
    print_table(console, table)


def render_transfer(console: Console, data: dict) -> None:
    console.print(
        f"{format_bytes(data['bytes'])} over {_link_text(data['link'])}: [bold]{format_seconds(data['seconds'])}[/bold]"
    )


def render_oversubscription(console: Console, data: dict) -> None:
    table = Table("switch", "down (servers)", "up (spines)", "oversubscription", "a server's share, all sending up")
    for row in data["switches"]:
        share = row.get("server_share_bytes_per_s")
        table.add_row(row["switch"], format_rate(row["down_bytes_per_s"]), format_rate(row["up_bytes_per_s"]),
                      ratio_text(row["ratio"]), format_rate(share) if share else "")  # fmt: skip
    print_table(console, table)


def render_allreduce(console: Console, data: dict) -> None:
    where = f"{data['ranks']} ranks on {_link_text(data['link'])}"
    if data.get("intra"):
        where += f"; {data['local_size']} a node on {_link_text(data['intra'])}"
    console.print(f"all-reduce of {format_bytes(data['bytes'])}, {where}")
    table = Table("algorithm", "time", "closed form")
    for row in data["algorithms"]:
        table.add_row(row["algorithm"], format_seconds(row["seconds"]), row["formula"])
    print_table(console, table)


def render_links(console: Console, data: dict) -> None:
    table = Table("kind", "name", "per direction", "quoted", "source")
    for row in data["links"]:
        table.add_row(row["key"], row["name"], format_rate(row["bytes_per_s"]), row["quoted"], row["source"])
    print_table(console, table)


def render_paths(console: Console, data: dict) -> None:
    console.print(f"moving {format_bytes(data['bytes'])} from one GPU's memory to another's")
    table = Table("path", "host memory", "host copies", "hops", "protocol", "bottleneck", "time")
    for row in data["paths"]:
        table.add_row(row["path"], "through" if row["through_host_memory"] else "skipped", str(row["host_copies"]),
                      " > ".join(row["hops"]), row["protocol"] or "", format_rate(row["bottleneck_bytes_per_s"]),
                      format_seconds(row["seconds"]))  # fmt: skip
    print_table(console, table)


def topology_summary(topology: Topology) -> dict[str, Any]:
    """Counts of nodes by kind and links by kind, and every ToR's oversubscription."""
    tors = [n for n, layer in topology.graph.nodes(data="layer") if layer == "tor"]
    capacities = [switch_capacity(topology, tor) for tor in tors]
    return {
        "name": topology.name,
        "devices": len(topology.devices()),
        "servers": len(topology.servers()),
        "racks": len(topology.racks()),
        "nodes": dict(Counter(kind for _, kind in topology.graph.nodes(data="kind"))),
        "links": dict(Counter(link.kind for link in topology.links())),
        "tors": [
            vars(c) | {"ratio": c.oversubscription, "server_share_bytes_per_s": c.server_share_bytes_per_s}
            for c in capacities
            if c.servers
        ],  # fmt: skip
    }


def route_summary(topology: Topology, src: str, dst: str) -> dict[str, Any]:
    """Every equal-cost path from ``src`` to ``dst`` (ECMP picks one a flow), each with its slowest link."""
    paths = []
    for nodes in topology.equal_cost_paths(src, dst):
        links = [topology.link(a, b) for a, b in zip(nodes, nodes[1:], strict=False)]
        slowest = min(links, key=lambda link: link.bytes_per_s)
        paths.append({"nodes": nodes, "kinds": [link.kind for link in links], "bottleneck": slowest.name,
                      "bottleneck_bytes_per_s": slowest.bytes_per_s,
                      "latency_s": sum(link.latency_s for link in links)})  # fmt: skip
    return {"src": src, "dst": dst, "paths": paths}


def render_route(console: Console, data: dict) -> None:
    console.print(f"{len(data['paths'])} equal-cost path(s) from {data['src']} to {data['dst']}")
    table = Table("path", "bottleneck link", "its rate", "latency")
    for row in data["paths"]:
        table.add_row(" > ".join(row["nodes"]), row["bottleneck"], format_rate(row["bottleneck_bytes_per_s"]),
                      format_seconds(row["latency_s"]))  # fmt: skip
    print_table(console, table)


def render_topology(console: Console, data: dict) -> None:
    console.print(
        f"[bold]{data['name']}[/bold]: {data['devices']} devices, {data['servers']} servers, {data['racks']} racks"
    )
    table = Table("nodes", "count", "links (one direction each)", "count")
    nodes, links = list(data["nodes"].items()), list(data["links"].items())
    for i in range(max(len(nodes), len(links))):
        node = nodes[i] if i < len(nodes) else ("", "")
        link = links[i] if i < len(links) else ("", "")
        table.add_row(node[0], str(node[1]), link[0], str(link[1]))
    print_table(console, table)
    if data["tors"]:
        render_oversubscription(console, {"switches": data["tors"]})
    if data.get("route"):
        render_route(console, data["route"])
