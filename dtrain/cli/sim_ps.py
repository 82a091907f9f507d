"""``dtrain simulate ps``: one parameter-server step (:func:`dtrain.sim.ps.simulate_ps`) on a preset or a file.

Added to ``dtrain simulate`` by :mod:`dtrain.cli.sim`. Workers and servers are topology nodes, named or
counted: ``--workers 56`` takes the first 56 accelerators; ``--servers 8`` puts 8 servers on CPUs, either
``beside`` the workers (CPU 0 of machines spread evenly over the workers' machines, as in ps-lite deployments
where every machine runs a server) or ``apart`` (the CPUs of machines that hold no worker, a server rack).
What a step moves is a dense model (``--dense-bytes`` or ``--params``) and embedding rows drawn from a Zipf
law (``--rows-per-worker``, or ``--batch`` examples of ``--ids-per-example`` ids a step). Prints the step time,
each server's load, the busiest links and the bottleneck, or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from rich.console import Console
from rich.table import Table

from dtrain.cli.cluster_common import link_rows, link_table, resolve_topology
from dtrain.cli.units import check_finite

__all__ = ["add_ps_parser", "place_ps"]

PLACEMENTS = ("beside", "apart")
ROW_BYTES = 256  # --row-bytes' default
ZIPF = 1.1  # --zipf's default

#: The flags that shape the embedding ids a step draws (dest, flag): refused where it draws none.
_ID_FLAGS = (("key_space", "--key-space"), ("row_bytes", "--row-bytes"), ("zipf", "--zipf"), ("permute", "--permute"),
             ("seed", "--seed"), ("hot_keys", "--hot-keys"), ("hot_replicas", "--hot-replicas"))  # fmt: skip


def add_ps_parser(sub, parse_bytes) -> argparse.ArgumentParser:
    """The ``ps`` sub-mode of ``dtrain simulate`` (its handler set); ``parse_bytes`` reads "20M"."""
    p = sub.add_parser("ps", help="one parameter-server step: push, apply, pull; per-server load, bottleneck")
    p.add_argument("--topology", required=True, help="a preset (dtrain topology --help lists them) or a file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset parameter, e.g. racks=2")
    p.add_argument("--workers", help="a count (the first N accelerators) or comma-separated nodes (default: all)")
    p.add_argument("--servers", default="1", help="a count (placed by --server-placement) or comma-separated nodes")
    p.add_argument("--server-placement", choices=PLACEMENTS, default=None,
                   help="with a count of --servers: beside (the default), CPU 0 of machines spread over the workers'; "
                        "apart: free machines")  # fmt: skip
    size = p.add_mutually_exclusive_group()
    size.add_argument("--dense-bytes", type=parse_bytes, default=0, help="dense parameters a step, e.g. 20M")
    size.add_argument("--params", type=float, help="dense parameters, e.g. 5e6 (times --bytes-per-param)")
    p.add_argument("--bytes-per-param", type=int, default=None,
                   help="with --params: 4 for float32 (the default), 2 for bf16")  # fmt: skip
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--rows-per-worker", type=int, help="embedding ids each worker draws a step")
    rows.add_argument("--batch", type=int, help="examples a step over all workers (with --ids-per-example)")
    p.add_argument("--ids-per-example", type=int, default=None,
                   help="with --batch: embedding ids an example looks up (default 1)")  # fmt: skip
    p.add_argument("--key-space", type=int, default=None, help="embedding rows in the table")
    p.add_argument("--row-bytes", type=int, default=None, help=f"bytes a row (default {ROW_BYTES}: 64 float32)")
    p.add_argument("--zipf", type=float, default=None, help=f"Zipf exponent of the ids (0: uniform; default {ZIPF})")
    p.add_argument("--permute", action="store_true", help="hash ids over the key space (else popular ids first)")
    p.add_argument("--seed", type=int, default=None, help="seed of the Zipf draws (default 0)")
    p.add_argument("--mode", choices=["sync", "async"], default="sync",
                   help="sync: one step of every worker's push; async: each push a step of its own")  # fmt: skip
    p.add_argument("--replicas", type=int, default=1, help="servers in each shard's chain")
    p.add_argument("--hot-keys", type=int, default=None, help="most-pulled rows of each server to copy")
    p.add_argument("--hot-replicas", type=int, default=None, help="other servers each hot row is copied to")
    p.add_argument("--apply-gbyte-per-s", type=float, help="a server's optimizer speed, GB/s (default: free)")
    p.add_argument("--host-gbyte-per-s", type=float,
                   help="a process's speed at sending or receiving a message (serialise, authenticate, copy), GB/s "
                        "(default: free)")  # fmt: skip
    p.add_argument("--links", type=int, default=8, help="busiest links to show")
    p.set_defaults(handler=simulate_ps_command)
    return p


def _parse_nodes(text: str | None, flag: str) -> int | list[str] | None:
    """``--workers`` or ``--servers`` (``flag``): a count (a whole number >= 1) or comma-separated node names."""
    if text is None:
        return None
    text = text.strip()
    if text.lstrip("+-").isdigit():
        if int(text) < 1:
            raise ValueError(f"{flag} {text}: a count must be at least 1")
        return int(text)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag}: expected a count or comma-separated node names, got {text!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{flag} names {', '.join(twice)} more than once: one {flag[2:-1]} a node")
    return names


def _check_nodes(topology, names: list[str], flag: str) -> None:
    """Every name of ``--workers`` or ``--servers`` (``flag``) a node of ``topology``; the error shows the range
    of its accelerators (workers) or CPUs (servers)."""
    unknown = [n for n in names if n not in topology.graph]
    if unknown:
        kind = "gpu" if flag == "--workers" else "cpu"
        nodes = [n for n, k in topology.graph.nodes(data="kind") if k == kind]
        hint = f" (its {kind.upper()}s: {nodes[0]} to {nodes[-1]})" if nodes else ""
        raise ValueError(f"{flag}: {', '.join(map(repr, unknown))}: not a node of topology {topology.name!r}{hint}")


def _cpus(topology, machine: str) -> list[str]:
    return [n for n, a in topology.graph.nodes(data=True) if a["kind"] == "cpu" and a.get("server") == machine]


def place_ps(topology, workers: int | list[str] | None, servers: int | list[str], placement: str
             ) -> tuple[list[str], list[str]]:  # fmt: skip
    """Worker and server nodes: names are kept, counts are placed (see the module docstring)."""
    devices = [d.name for d in topology.devices()]
    if workers is None:
        workers = devices
    elif isinstance(workers, int):
        if not 1 <= workers <= len(devices):
            raise ValueError(f"--workers {workers}: topology {topology.name!r} has {len(devices)} accelerators")
        workers = devices[:workers]
    else:
        _check_nodes(topology, workers, "--workers")
    if isinstance(servers, list):
        _check_nodes(topology, servers, "--servers")
        return workers, servers
    if servers < 1:
        raise ValueError(f"--servers {servers}: a count must be at least 1")
    if placement not in PLACEMENTS:
        raise ValueError(f"server placement must be one of {PLACEMENTS}, got {placement!r}")
    used = {topology.graph.nodes[w].get("server") for w in workers if w in topology.graph}
    machines = [m for m in topology.servers() if (m in used) == (placement == "beside")]
    if placement == "beside":  # evenly spaced machines, then their second CPUs, ...
        order = [machines[i * len(machines) // min(servers, len(machines))] for i in range(min(servers, len(machines)))]
        order += [m for m in machines if m not in order]
        slots = [cpus[k] for k in range(8) for m in order if k < len(cpus := _cpus(topology, m))]
    else:  # a server rack: every CPU of each free machine, machine by machine
        slots = [cpu for m in machines for cpu in _cpus(topology, m)]
    if len(slots) < servers:
        where = "the workers' machines" if placement == "beside" else "machines without workers"
        other = "apart" if placement == "beside" else "beside"
        raise ValueError(f"--servers {servers}: only {len(slots)} CPUs on {where} of {topology.name!r}; name the "
                         f"server nodes, or use fewer servers or --server-placement {other}")  # fmt: skip
    return workers, slots[:servers]


def _step(args: argparse.Namespace, topology):
    from dtrain.sim.ps import PSStep

    servers = _parse_nodes(args.servers, "--servers")
    if args.server_placement is not None and isinstance(servers, list):
        raise ValueError(f"--server-placement {args.server_placement}: places a count of --servers, not the nodes "
                         "named")  # fmt: skip
    workers, servers = place_ps(topology, _parse_nodes(args.workers, "--workers"), servers,
                                args.server_placement or "beside")  # fmt: skip
    if not 1 <= args.replicas <= len(servers):
        raise ValueError(f"--replicas {args.replicas}: servers in each shard's chain, at least 1 and at most the "
                         f"{len(servers)} server(s)")  # fmt: skip
    if args.hot_replicas is not None and not 0 <= args.hot_replicas < len(servers):
        raise ValueError(f"--hot-replicas {args.hot_replicas}: other servers a hot row is copied to, at least 0 and "
                         f"at most {len(servers) - 1} with {len(servers)} server(s)")  # fmt: skip
    if args.hot_keys and not args.hot_replicas:
        raise ValueError(f"--hot-keys {args.hot_keys}: needs --hot-replicas, the other servers the rows are copied to")
    if args.hot_replicas and not args.hot_keys:
        raise ValueError(f"--hot-replicas {args.hot_replicas}: needs --hot-keys, the rows of each server to copy")
    if args.params is not None and not 0 <= args.params < math.inf:
        raise ValueError(f"--params must be a finite count >= 0, got {args.params}")
    if args.bytes_per_param is not None and args.params is None:
        raise ValueError(f"--bytes-per-param {args.bytes_per_param}: sizes --params, not given")
    bytes_per_param = 4 if args.bytes_per_param is None else args.bytes_per_param
    dense = args.params * bytes_per_param if args.params is not None else float(args.dense_bytes)
    if not 0 <= dense < math.inf:
        raise ValueError(
            f"the dense model must be a finite size >= 0 (--dense-bytes, --params x --bytes-per-param), got {dense}"
        )
    rows = args.rows_per_worker or 0
    if args.ids_per_example is not None and args.batch is None:
        raise ValueError(f"--ids-per-example {args.ids_per_example}: ids an example of --batch looks up; needs "
                         "--batch")  # fmt: skip
    ids_per_example = args.ids_per_example or 1
    if args.batch is not None:
        if args.batch < len(workers) or ids_per_example < 1:
            raise ValueError(f"--batch {args.batch} x --ids-per-example {ids_per_example}: need at least one "
                             f"example for each of the {len(workers)} workers and one id an example")  # fmt: skip
        if args.batch % len(workers):
            raise ValueError(f"--batch {args.batch}: not a multiple of the {len(workers)} workers (each worker takes "
                             "an equal share of the examples)")  # fmt: skip
        rows = args.batch // len(workers) * ids_per_example
    if rows * len(workers) > MAX_ROWS:
        given = "--rows-per-worker" if args.batch is None else "--batch x --ids-per-example"
        raise ValueError(f"{given}: {rows:,} ids for each of {len(workers)} workers; at most {MAX_ROWS:,} ids a step "
                         "are simulated")  # fmt: skip
    if rows and not args.key_space:
        raise ValueError(f"{rows} embedding ids a worker need --key-space (rows in the embedding table)")
    if not rows:
        given = [flag for dest, flag in _ID_FLAGS if getattr(args, dest) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)}: for embedding ids, and the step draws none (give "
                             "--rows-per-worker, or --batch, with --key-space)")  # fmt: skip
    if not dense and not rows:
        raise ValueError("nothing to move: give --dense-bytes / --params, or embedding ids (--rows-per-worker or "
                         "--batch with --key-space)")  # fmt: skip
    return PSStep(
        workers=workers, servers=servers, dense_bytes=dense, rows_per_worker=rows, key_space=args.key_space or 0,
        row_bytes=ROW_BYTES if args.row_bytes is None else args.row_bytes,
        zipf=ZIPF if args.zipf is None else args.zipf, permute=args.permute, seed=args.seed or 0, mode=args.mode,
        replicas=args.replicas, hot_keys=args.hot_keys or 0, hot_replicas=args.hot_replicas or 0,
        apply_s_per_byte=1 / (args.apply_gbyte_per_s * 1e9) if args.apply_gbyte_per_s else 0.0,
        host_s_per_byte=1 / (args.host_gbyte_per_s * 1e9) if args.host_gbyte_per_s else 0.0,
    )  # fmt: skip


#: The whole-number flags of ``dtrain simulate ps`` and the least each takes (one left out is not checked).
_AT_LEAST = {"bytes_per_param": 1, "rows_per_worker": 0, "batch": 1, "ids_per_example": 1, "key_space": 0,
             "row_bytes": 1, "seed": 0, "hot_keys": 0, "links": 0}  # fmt: skip


#: The most rows an embedding table holds (``--key-space``) and the most ids drawn a step over all workers
#: (``--rows-per-worker`` x workers, or ``--batch`` x ``--ids-per-example``) that are simulated: the draws are arrays
#: of that many numbers, 512 MiB each at this size (a larger step is minutes of drawing, a much larger one more
#: memory than a machine has).
MAX_ROWS = 1 << 26
_AT_MOST = {"rows_per_worker": MAX_ROWS, "key_space": MAX_ROWS}


def _check_flags(args: argparse.Namespace) -> None:
    """Each numeric flag of ``dtrain simulate ps`` that needs no topology, named where it is out of range."""
    for name, least in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a whole number >= {least}")
    for name, most in _AT_MOST.items():
        value = getattr(args, name)
        if value is not None and value > most:
            raise ValueError(f"--{name.replace('_', '-')} {value}: at most {most:,} are simulated")
    if args.zipf is not None and not 0 <= args.zipf < math.inf:
        raise ValueError(f"--zipf {args.zipf}: the Zipf exponent must be a finite number >= 0 (0: uniform)")
    for name in ("apply_gbyte_per_s", "host_gbyte_per_s"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 (and finite), got {value}")


def simulate_ps_command(args: argparse.Namespace) -> int:
    """``dtrain simulate ps``: the step, its servers' loads and its busiest links."""
    from dtrain.sim.ps import simulate_ps

    _check_flags(args)
    topology = resolve_topology(args.topology, args.set)
    topology.validate()
    step = _step(args, topology)
    result = simulate_ps(topology, step)
    data = {
        "topology": topology.name, "mode": step.mode, "workers": list(step.workers), "servers": list(step.servers),
        "dense_bytes": step.dense_bytes, "rows_per_worker": step.rows_per_worker, "key_space": step.key_space,
        "row_bytes": step.row_bytes, "zipf": step.zipf, "replicas": step.replicas, "hot_keys": step.hot_keys,
        "hot_replicas": step.hot_replicas, "apply_s_per_byte": step.apply_s_per_byte,
        "host_s_per_byte": step.host_s_per_byte, "time_s": result.time_s,
        "worker_s": {"min": min(result.worker_s), "median": statistics.median(result.worker_s),
                     "max": max(result.worker_s)},
        "imbalance": {"bytes": result.byte_imbalance, "pulls": result.pull_imbalance,
                      "requests": result.request_imbalance},
        "server_loads": [{"node": s.node, "push_bytes": s.push_bytes, "pull_bytes": s.pull_bytes,
                          "requests": s.requests, "replication_bytes": s.replication_bytes} for s in result.servers],
        "bottleneck": result.bottleneck.link.name if result.bottleneck else None,
        "links": link_rows(result.links, args.links),
    }  # fmt: skip
    check_finite(data)  # neither JSON nor a table shows an infinity: the inputs are out of range
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    _print(data)
    return 0


def _print(data: dict) -> None:
    from dtrain.cluster.report import print_table

    console = Console()
    moved = []
    if data["dense_bytes"]:
        moved.append(f"{data['dense_bytes'] / 1e6:,.1f} MB dense")
    if data["rows_per_worker"]:
        moved.append(f"{data['rows_per_worker']:,} Zipf({data['zipf']:g}) ids a worker over {data['key_space']:,} "
                     f"rows of {data['row_bytes']} B")  # fmt: skip
    w = data["worker_s"]
    console.print(
        f"parameter-server step on {data['topology']}: {len(data['workers'])} workers, {len(data['servers'])} "
        f"servers, {data['mode']}, {' + '.join(moved)}\n"
        f"step [bold]{w['max'] * 1e3:.3f} ms[/bold] (last worker); median worker {w['median'] * 1e3:.3f} ms, "
        f"first {w['min'] * 1e3:.3f} ms; bottleneck {data['bottleneck'] or '-'}\n"
        f"load max/mean: bytes {data['imbalance']['bytes']:.2f}, pulls {data['imbalance']['pulls']:.2f}, "
        f"requests {data['imbalance']['requests']:.2f}",
        soft_wrap=True,
    )
    table = Table(title="servers")
    for column in ("server", "push MB", "pull MB", "requests", "replication MB", "share of bytes"):
        table.add_column(column, justify="left" if column == "server" else "right")
    total = sum(s["push_bytes"] + s["pull_bytes"] for s in data["server_loads"]) or 1.0
    for s in data["server_loads"]:
        share = (s["push_bytes"] + s["pull_bytes"]) / total
        table.add_row(s["node"], f"{s['push_bytes'] / 1e6:,.2f}", f"{s['pull_bytes'] / 1e6:,.2f}", str(s["requests"]),
                      f"{s['replication_bytes'] / 1e6:,.2f}", f"{share:.1%}")  # fmt: skip
    print_table(console, table)
    print_table(console, link_table(data["links"], "busiest links"))
