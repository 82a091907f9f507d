"""A drawing of any topology as a PNG, layered as leaf-spine clusters are usually drawn: spines on top, ToRs,
then the servers with their NICs, PCIe switches, CPUs, GPUs and NVSwitch.

Edge width grows with the logarithm of the link's rate (NVLink and HBM-class links are hundreds of times
Ethernet's); colour says the link family, and each link kind is labelled once on the drawing and in the
legend with its rate. A cluster of many servers is drawn one box a server (``collapse``), its NIC links
summed into one edge to the ToR.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import networkx as nx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from dtrain.cluster.catalogue import LINKS
from dtrain.cluster.topology import Topology
from dtrain.cluster.units import format_rate

__all__ = ["draw", "collapsed_graph", "layered_positions"]

# Height of each row; switches by their layer, server parts by their kind.
_ROW = {"core": 9.0, "spine": 8.0, "aggregation": 8.0, "tor": 7.0, "leaf": 7.0, "switch": 7.0, "nic": 5.6,
        "host": 4.6, "cpu": 4.6, "pcie-switch": 3.6, "gpu": 2.4, "nvswitch": 1.2}  # fmt: skip
_COLOURS = {"nvlink": "tab:green", "pcie": "tab:blue", "cpu-interconnect": "tab:gray", "memory": "tab:brown",
            "ethernet": "tab:orange", "infiniband": "tab:purple"}  # fmt: skip
_NODE_COLOURS = {"gpu": "#76b900", "cpu": "#9e9e9e", "nic": "#ffcc80", "switch": "#b39ddb", "nvswitch": "#a5d6a7",
                 "pcie-switch": "#90caf9", "host": "#e0e0e0"}  # fmt: skip


def _family(kind: str) -> str:
    return LINKS[kind].family if kind in LINKS else "other"


def collapsed_graph(topology: Topology) -> nx.Graph:
    """One node a server (kind ``host``) and the switches outside servers; links between two groups summed
    per direction (the larger direction kept), with the link kinds they are made of."""
    graph = nx.Graph()
    group = {}
    for name, attrs in topology.graph.nodes(data=True):
        server = attrs.get("server")
        group[name] = server or name
        if server is None:
            graph.add_node(name, kind=attrs["kind"], layer=attrs.get("layer"), rack=attrs.get("rack"))
        elif server not in graph:
            graph.add_node(server, kind="host", layer=None, rack=attrs.get("rack"))
    rates: dict[tuple[str, str], float] = defaultdict(float)
    kinds: dict[frozenset, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for link in topology.links():
        a, b = group[link.src], group[link.dst]
        if a != b:
            rates[(a, b)] += link.bytes_per_s
            kinds[frozenset((a, b))][link.kind] += 1
    for (a, b), bytes_per_s in rates.items():
        both = max(bytes_per_s, rates.get((b, a), 0.0))
        counts = kinds[frozenset((a, b))]
        kind = max(counts, key=counts.get)
        graph.add_edge(a, b, bytes_per_s=both, kind=kind, label=_edge_label(kind, both))
    for name in topology.servers():
        graph.nodes[name]["devices"] = sum(1 for d in topology.devices() if d.server == name)
    return graph


def _edge_label(kind: str, bytes_per_s: float) -> str:
    """The kind, and the rate when links are aggregated (``"nvlink3, 300 GB/s"``)."""
    if kind in LINKS and math.isclose(bytes_per_s, LINKS[kind].bytes_per_s):
        return kind
    return f"{kind}, {bytes_per_s / 1e9:.4g} GB/s"


def _detailed_graph(topology: Topology) -> nx.Graph:
    graph = nx.Graph()
    for name, attrs in topology.graph.nodes(data=True):
        graph.add_node(name, **attrs)
    for link in topology.links():
        label = _edge_label(link.kind, link.bytes_per_s)
        graph.add_edge(link.src, link.dst, bytes_per_s=link.bytes_per_s, kind=link.kind, label=label)
    return graph


def _row(attrs: dict) -> float:
    return _ROW.get(attrs.get("layer") or "", _ROW.get(attrs["kind"], 0.0))


def layered_positions(graph: nx.Graph) -> dict[str, tuple[float, float]]:
    """x: servers side by side in rack order, each server's parts spread within its slot, switches centred
    over what they connect; y: the node's row (spines on top, GPUs near the bottom)."""
    members: dict[str, list[str]] = defaultdict(list)
    for name, attrs in graph.nodes(data=True):
        owner = attrs.get("server") or (name if attrs["kind"] == "host" else None)
        if owner is not None:
            members[owner].append(name)
    positions: dict[str, tuple[float, float]] = {}
    x0 = 0.0
    for names in members.values():
        rows: dict[float, list[str]] = defaultdict(list)
        for name in names:
            rows[_row(graph.nodes[name])].append(name)
        width = max(len(r) for r in rows.values())
        for y, row in rows.items():
            for i, name in enumerate(row):
                positions[name] = (x0 + (i + 0.5) * width / len(row), y)
        # CPUs at the slot's edges, clear of the NIC-to-PCIe-switch links that run down its middle
        cpus = rows.get(_ROW["cpu"], [])
        for i, name in enumerate(cpus):
            if graph.nodes[name]["kind"] == "cpu":
                span = width + 1.6
                positions[name] = (x0 - 0.8 + (span * i / (len(cpus) - 1) if len(cpus) > 1 else 0.0), _ROW["cpu"])
        x0 += width + (3.0 if len(names) > 1 else 0.6)  # room for the CPUs beside a detailed server
    _place_switches(graph, positions, x0)
    return positions


def _place_switches(graph: nx.Graph, positions: dict, total_width: float) -> None:
    """ToRs over their rack's servers; each higher tier spread evenly over the whole width."""
    for layer in ("tor", "leaf", "switch", "spine", "aggregation", "core"):
        tier = [n for n, a in graph.nodes(data=True) if n not in positions and (a.get("layer") or a["kind"]) == layer]
        for i, name in enumerate(tier):
            below = [positions[n][0] for n in graph.neighbors(name) if n in positions]
            if layer in ("tor", "leaf") and below:
                x = sum(below) / len(below)
            else:
                x = (i + 0.5) * total_width / max(1, len(tier))
            positions[name] = (x, _row(graph.nodes[name]))
    for name in graph.nodes:  # anything else (e.g. a switch with no layer) on the top row
        positions.setdefault(name, (total_width / 2, 10.0))


def _widths(graph: nx.Graph) -> list[float]:
    rates = [rate for _, _, rate in graph.edges(data="bytes_per_s")]
    low, high = math.log10(min(rates)), math.log10(max(rates))
    return [0.6 + 3.4 * (math.log10(r) - low) / (high - low or 1.0) for r in rates]


def draw(topology: Topology, path: str | Path, *, collapse: bool | None = None, title: str | None = None) -> Path:
    """Write a PNG of ``topology`` to ``path``; ``collapse`` (default: over 48 devices) draws a box a server."""
    if topology.graph.number_of_edges() == 0:
        raise ValueError(f"topology {topology.name!r} has no links to draw")
    if collapse is None:
        collapse = len(topology.devices()) > 48
    graph = collapsed_graph(topology) if collapse else _detailed_graph(topology)
    positions = layered_positions(graph)
    width = max(x for x, _ in positions.values()) + 1
    figure = Figure(figsize=(min(40.0, max(8.0, width * 0.45)), 7.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    edges = list(graph.edges(data=True))
    colours = [_COLOURS.get(_family(data["kind"]), "black") for _, _, data in edges]
    nx.draw_networkx_edges(graph, positions, ax=ax, width=_widths(graph), edge_color=colours, alpha=0.7)
    node_colours = [_NODE_COLOURS.get(kind, "white") for _, kind in graph.nodes(data="kind")]
    sizes = [900 if kind in ("host", "switch") else 300 for _, kind in graph.nodes(data="kind")]
    nx.draw_networkx_nodes(graph, positions, ax=ax, node_color=node_colours, node_size=sizes, edgecolors="black",
                           linewidths=0.5)  # fmt: skip
    nx.draw_networkx_labels(graph, positions, labels=_node_labels(graph), ax=ax, font_size=6)
    nx.draw_networkx_edge_labels(graph, positions, edge_labels=_one_label_each(edges), ax=ax, font_size=6)
    if not collapse:
        _label_servers(ax, graph, positions)
    handles = _legend(edges)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=min(4, len(handles)), fontsize=7,
              frameon=False)  # fmt: skip
    ax.set_title(title or _title(topology), fontsize=10)
    ax.axis("off")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=130, bbox_inches="tight")
    return path


def _title(topology: Topology) -> str:
    """Name, size and the ToRs' oversubscription."""
    from dtrain.cluster.capacity import switch_capacity

    text = f"{topology.name}: {len(topology.devices())} GPUs in {len(topology.servers())} servers"
    tors = [n for n, layer in topology.graph.nodes(data="layer") if layer == "tor"]
    ratios = sorted({round(switch_capacity(topology, tor).oversubscription, 3) for tor in tors})
    if ratios and all(math.isfinite(r) for r in ratios):
        text += ", ToR oversubscription " + ", ".join(f"1:{r:g}" for r in ratios)
    return text


def _label_servers(ax, graph: nx.Graph, positions: dict) -> None:
    """Each server's (and rack's) name under its parts."""
    xs: dict[str, list[float]] = defaultdict(list)
    for name, attrs in graph.nodes(data=True):
        if attrs.get("server"):
            xs[f"{attrs['server']}" + (f" ({attrs['rack']})" if attrs.get("rack") else "")].append(positions[name][0])
    for label, values in xs.items():
        ax.text(sum(values) / len(values), 0.5, label, ha="center", fontsize=7, fontweight="bold")


def _node_labels(graph: nx.Graph) -> dict[str, str]:
    labels = {}
    for name, attrs in graph.nodes(data=True):
        short = name.rsplit("/", 1)[-1] if attrs.get("server") else name
        labels[name] = f"{name}\n{attrs['devices']} GPUs" if attrs["kind"] == "host" else short
    return labels


def _one_label_each(edges: list) -> dict[tuple[str, str], str]:
    seen: set[str] = set()
    labels = {}
    for a, b, data in edges:
        if data["label"] not in seen:
            seen.add(data["label"])
            labels[(a, b)] = data["label"]
    return labels


def _legend(edges: list) -> list[Line2D]:
    kinds = sorted({data["kind"] for _, _, data in edges})
    return [
        Line2D([], [], color=_COLOURS.get(_family(k), "black"),
               label=f"{k}: {format_rate(LINKS[k].bytes_per_s)} a link" if k in LINKS else k)
        for k in kinds
    ]  # fmt: skip
