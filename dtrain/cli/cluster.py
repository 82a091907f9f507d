"""``dtrain calc`` (bandwidth arithmetic of data-parallel training, any variant) and ``dtrain topology`` (show,
draw, save).

Also registers ``dtrain simulate`` and ``dtrain plan`` when the simulator's CLI module is installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from dtrain.cli.units import check_finite, parse_count, parse_quantity

__all__ = ["register", "parse_quantity", "parse_count", "check_finite"]

#: dtrain.cluster.presets.PRESETS by name, without importing the cluster model here (a test keeps them equal)
PRESET_NAMES = ("dgx-a100", "h100-node", "h200-4gpu", "4-rack", "h100-rail", "dgx-a100-superpod", "fat-tree-k8")


def _add_link_args(p: argparse.ArgumentParser, prefix: str = "", what: str = "the link") -> None:
    """``--link KIND [--link-count N]`` or ``--gbit-per-s``/``--gbyte-per-s``, and ``--latency-s``; with
    ``prefix="uplink"`` the flags are ``--uplink-link`` and so on."""
    flag, dest = (f"--{prefix}-", f"{prefix}_") if prefix else ("--", "")
    p.add_argument(f"{flag}link", dest=f"{dest}link", help=f"{what}: a catalogue kind (dtrain calc links)")
    p.add_argument(f"{flag}link-count", dest=f"{dest}link_count", type=int, default=1,
                   help="links of that kind used together (e.g. 12 NVLink 3 links of an A100)")  # fmt: skip
    p.add_argument(f"{flag}gbit-per-s", dest=f"{dest}gbit_per_s", type=float, help=f"{what}'s rate in Gb/s (bits)")
    p.add_argument(f"{flag}gbyte-per-s", dest=f"{dest}gbyte_per_s", type=float, help=f"{what}'s rate in GB/s")
    p.add_argument(f"{flag}latency-s", dest=f"{dest}latency_s", type=float, help="per-message latency (alpha)")


def _link(args: argparse.Namespace, prefix: str = ""):
    from dtrain.cluster.calc import rate

    flag, dest = (f"--{prefix}-", f"{prefix}_") if prefix else ("--", "")

    def get(name: str) -> Any:
        return getattr(args, f"{dest}{name}")

    if get("link") is None and get("gbit_per_s") is None and get("gbyte_per_s") is None:
        raise ValueError(f"give {flag}link KIND, {flag}gbit-per-s or {flag}gbyte-per-s")
    return rate(get("link"), count=get("link_count"), gbit_per_s=get("gbit_per_s"), gbyte_per_s=get("gbyte_per_s"),
                latency_s=get("latency_s"))  # fmt: skip


def register(commands) -> None:
    """Add ``calc`` and ``topology`` (and the simulator's commands, if present) to ``dtrain``."""
    _register_calc(commands)
    _register_topology(commands)
    try:
        sim = importlib.import_module("dtrain.cli.sim")
    except ModuleNotFoundError as exc:
        if exc.name != "dtrain.cli.sim":
            raise
    else:
        sim.register(commands)


def _register_calc(commands) -> None:
    calc = commands.add_parser("calc", help="bandwidth arithmetic: gradients, transfers, oversubscription, all-reduce")
    sub = calc.add_subparsers(dest="calc_command", required=True)
    _add_calc_arithmetic(sub)
    _add_calc_models(sub)
    p = sub.add_parser("links", help="the link catalogue, with sources")
    p.set_defaults(handler=_links)
    for parser in sub.choices.values():
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_calc_arithmetic(sub) -> None:
    """Arithmetic by first principles: gradients, a transfer, a ToR's oversubscription."""
    p = sub.add_parser("gradients", help="gradient bytes per replica and what averaging N replicas moves")
    p.add_argument("--params", type=parse_count, required=True, help="model parameters, e.g. 175e9 or 175G")
    p.add_argument("--bytes-per-param", type=float, default=4, help="4 for fp32 gradients, 2 for bf16 (at most 64)")
    p.add_argument("--replicas", type=int, default=3, help="data-parallel replicas to average")
    _add_link_args(p, what="the link each replica has")
    p.set_defaults(handler=_gradients)

    p = sub.add_parser("transfer", help="time to move a number of bytes over a link")
    p.add_argument("--bytes", type=parse_quantity, required=True, help="e.g. 1TB, 700GB, 1e12")
    _add_link_args(p)
    p.set_defaults(handler=_transfer)

    p = sub.add_parser("oversubscription", help="a ToR's downlink over uplink capacity")
    p.add_argument("--servers", type=int, help="servers under the ToR")
    p.add_argument("--nics", type=int, default=1, help="NICs a server")
    _add_link_args(p, what="each NIC")
    p.add_argument("--uplinks", type=int, default=1, help="the ToR's uplinks")
    _add_link_args(p, prefix="uplink", what="each uplink")
    p.add_argument("--topology", help="instead: a preset name or a topology file; every ToR's ratio")
    p.set_defaults(handler=_oversubscription)


def _add_calc_models(sub) -> None:
    """Costs from the models: each all-reduce's closed form, each GPU-to-GPU data path."""
    p = sub.add_parser("allreduce", help="each all-reduce algorithm's time from its alpha-beta closed form")
    p.add_argument("--bytes", type=parse_quantity, help="bytes to all-reduce (or --params x --bytes-per-param)")
    p.add_argument("--params", type=parse_count, help="model parameters, e.g. 175e9 or 175G")
    p.add_argument("--bytes-per-param", type=float, default=4)
    p.add_argument("--ranks", "--replicas", dest="ranks", type=int, required=True)
    _add_link_args(p, what="the link between ranks (between nodes with --local-size)")
    p.add_argument("--local-size", type=int, help="ranks a node, for the hierarchical algorithm")
    _add_link_args(p, prefix="intra", what="the link inside a node")
    p.add_argument("--reduce-gbyte-per-s", type=float, help="reduction rate (gamma); default: free")
    p.set_defaults(handler=_allreduce)

    p = sub.add_parser("paths", help="GPU-to-GPU paths with and without host memory (GPUDirect P2P and RDMA)")
    p.add_argument("--bytes", type=parse_quantity, default=1e9, help="message size (default 1GB)")
    p.add_argument("--pcie", default="pcie4x16", help="the GPUs' and NICs' PCIe kind")
    p.add_argument("--nvlink", default="nvlink3", help="the GPUs' NVLink kind")
    p.add_argument("--nvlinks", type=int, default=12, help="NVLink links a GPU")
    p.add_argument("--network", default="ib-hdr", help="the NIC's link kind")
    p.set_defaults(handler=_paths)


def _emit(args: argparse.Namespace, data: dict, render) -> int:
    if args.json:
        check_finite(data)  # JSON has no infinity: never print one
        print(json.dumps(data, indent=2))
    else:
        from rich.console import Console

        render(Console(), data)
    return 0


def _check_bytes_per_param(args: argparse.Namespace) -> None:
    if not 0 < args.bytes_per_param <= 64:
        raise ValueError(f"--bytes-per-param: a number above 0 and at most 64, got {args.bytes_per_param}")


def _gradients(args: argparse.Namespace) -> int:
    from dtrain.cluster.calc import averaging, gradient_bytes
    from dtrain.cluster.report import render_gradients

    _check_bytes_per_param(args)
    link = _link(args)
    nbytes = gradient_bytes(args.params, args.bytes_per_param)
    methods = [vars(a) for a in averaging(nbytes, args.replicas, link)]
    data = {"params": args.params, "bytes_per_param": args.bytes_per_param, "gradient_bytes": nbytes,
            "replicas": args.replicas, "link": link.to_dict(), "averaging": methods}  # fmt: skip
    return _emit(args, data, render_gradients)


def _transfer(args: argparse.Namespace) -> int:
    from dtrain.cluster.calc import transfer_seconds
    from dtrain.cluster.report import render_transfer

    link = _link(args)
    data = {"bytes": args.bytes, "link": link.to_dict(), "seconds": transfer_seconds(args.bytes, link)}
    return _emit(args, data, render_transfer)


def _capacity_row(capacity) -> dict:
    row = vars(capacity) | {"ratio": capacity.oversubscription}
    return row | {"server_share_bytes_per_s": capacity.server_share_bytes_per_s if capacity.servers else None}


def _oversubscription(args: argparse.Namespace) -> int:
    from dtrain.cluster.calc import oversubscription_ratio
    from dtrain.cluster.capacity import SwitchCapacity
    from dtrain.cluster.report import render_oversubscription

    if args.topology:
        from dtrain.cli.cluster_common import resolve_topology
        from dtrain.cluster.capacity import switch_capacity

        topology = resolve_topology(args.topology, [])
        tors = [n for n, layer in topology.graph.nodes(data="layer") if layer == "tor"]
        if not tors:
            raise ValueError(f"topology {topology.name!r} has no top-of-rack switch")
        rows = [switch_capacity(topology, tor) for tor in tors]
        data = {"topology": topology.name, "switches": [_capacity_row(c) for c in rows]}
        return _emit(args, data, render_oversubscription)
    if args.servers is None:
        raise ValueError("give --servers with --link and --uplink-link (or rates), or --topology")
    for flag, value in (("--servers", args.servers), ("--nics", args.nics), ("--uplinks", args.uplinks)):
        if value < 1:
            raise ValueError(f"{flag}: must be at least 1, got {value}")
    nic, uplink = _link(args), _link(args, "uplink")
    down, up = args.servers * args.nics * nic.bytes_per_s, args.uplinks * uplink.bytes_per_s
    ratio = oversubscription_ratio(args.servers, args.nics * nic.bytes_per_s, up)
    tor = SwitchCapacity(switch="tor", down_bytes_per_s=down, up_bytes_per_s=up, servers=args.servers)
    data = {"switches": [_capacity_row(tor) | {"ratio": ratio}], "nic": nic.to_dict(), "uplink": uplink.to_dict(),
            "servers": args.servers, "nics": args.nics, "uplinks": args.uplinks}  # fmt: skip
    return _emit(args, data, render_oversubscription)


def _allreduce(args: argparse.Namespace) -> int:
    from dtrain.cluster.calc import all_reduce_times, gradient_bytes
    from dtrain.cluster.report import render_allreduce

    if (args.bytes is None) == (args.params is None):
        raise ValueError("give exactly one of --bytes or --params")
    _check_bytes_per_param(args)
    nbytes = args.bytes if args.bytes is not None else gradient_bytes(args.params, args.bytes_per_param)
    link = _link(args)
    intra = _link(args, "intra") if args.local_size is not None else None
    reduce_rate = None if args.reduce_gbyte_per_s is None else args.reduce_gbyte_per_s * 1e9
    times = all_reduce_times(nbytes, args.ranks, link, reduce_bytes_per_s=reduce_rate, local_size=args.local_size,
                             intra=intra)  # fmt: skip
    data = {"bytes": nbytes, "ranks": args.ranks, "local_size": args.local_size, "link": link.to_dict(),
            "intra": None if intra is None else intra.to_dict(), "algorithms": [vars(t) for t in times]}  # fmt: skip
    return _emit(args, data, render_allreduce)


def _links(args: argparse.Namespace) -> int:
    from dtrain.cluster.catalogue import LINKS
    from dtrain.cluster.report import render_links

    data = {"links": [vars(spec) | {"gbit_per_s": spec.bytes_per_s * 8 / 1e9} for spec in LINKS.values()]}
    return _emit(args, data, render_links)


def _register_topology(commands) -> None:
    p = commands.add_parser("topology", help="summarise a preset or topology file; draw it, save it as TOML")
    p.add_argument("topology", help=f"a preset ({', '.join(PRESET_NAMES)}) or a .toml file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="preset parameter, e.g. --set racks=2 --set oversubscription=8 (at most 131072 devices, NICs, "
                        "CPUs and switch links)")  # fmt: skip
    p.add_argument("--draw", metavar="PNG", help="write a drawing of the topology (.png, .svg, .pdf, ...)")
    p.add_argument("--save", metavar="TOML", help="write the topology as explicit nodes and links")
    p.add_argument("--route", nargs=2, metavar=("SRC", "DST"), help="the equal-cost paths between two nodes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_topology)


def _check_topology_outputs(args: argparse.Namespace) -> None:
    """``--draw`` and ``--save``, refused before anything is built or written: a path that is a directory or
    cannot be written, a drawing format matplotlib does not write, the same file for both."""
    from dtrain.cli.paths import check_file_out

    if args.draw:
        check_file_out("--draw", args.draw)
        from matplotlib.backend_bases import FigureCanvasBase

        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        suffix = Path(args.draw).suffix.lstrip(".").lower()
        if suffix not in formats:
            got = f"format {suffix!r} is not one matplotlib writes" if suffix else "the name has no format suffix"
            raise ValueError(f"--draw {args.draw}: {got}; end it in one of .{', .'.join(formats)}")
    if args.save:
        check_file_out("--save", args.save)
    if args.draw and args.save and Path(args.draw).absolute() == Path(args.save).absolute():
        raise ValueError(f"--draw and --save: both name {args.save}")


def _topology(args: argparse.Namespace) -> int:
    from dtrain.cli.cluster_common import resolve_topology
    from dtrain.cli.paths import atomic_path, write_atomic
    from dtrain.cluster.report import render_topology, route_summary, topology_summary
    from dtrain.cluster.toml_writer import dumps

    if args.route and args.route[0] == args.route[1]:
        raise ValueError(f"--route {args.route[0]} {args.route[1]}: a route joins two different nodes")
    _check_topology_outputs(args)
    topology = resolve_topology(args.topology, args.set)
    data = topology_summary(topology)
    if args.route:
        missing = [node for node in args.route if node not in topology.graph]
        if missing:
            raise ValueError(f"--route: {topology.name} has no node {missing[0]!r}")
        data["route"] = route_summary(topology, *args.route)
    text = dumps(topology) if args.save else None  # everything computed before the first file is written
    if args.draw:
        from dtrain.cluster.draw import draw

        with atomic_path(args.draw) as tmp:
            draw(topology, tmp)
    if args.save:
        write_atomic(args.save, text)
    return _emit(args, data, render_topology)


def _paths(args: argparse.Namespace) -> int:
    from dtrain.cluster.paths import gpu_paths
    from dtrain.cluster.report import render_paths

    paths = gpu_paths(pcie=args.pcie, nvlink=args.nvlink, nvlinks=args.nvlinks, network=args.network)
    rows = [{"path": p.name, "through_host_memory": p.through_host_memory, "host_copies": p.host_copies,
             "hops": [hop.kind if hop.count == 1 else f"{hop.count} x {hop.kind}" for hop in p.hops],
             "protocol": p.protocol, "bottleneck_bytes_per_s": p.bottleneck_bytes_per_s,
             "seconds": p.transfer_s(args.bytes), "source": p.source} for p in paths.values()]  # fmt: skip
    return _emit(args, {"bytes": args.bytes, "paths": rows}, render_paths)
