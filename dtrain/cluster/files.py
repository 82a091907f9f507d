"""Topology files in TOML: a builder spec (a preset and its parameters) or explicit nodes and links.

A builder spec::

    name = "two-racks"
    [build]
    preset = "4-rack"          # optional; without it, the builder's defaults
    racks = 2
    oversubscription = 8

Explicit nodes and links (a GPU names a catalogue device, any of whose figures a figure beside it replaces, or
gives all three figures; a file needs at least one GPU)::

    name = "pair"
    [[node]]
    name = "s0/gpu0"
    kind = "gpu"
    server = "s0"
    device = "h100-sxm"
    [[node]]
    name = "s0/nvswitch"
    kind = "nvswitch"
    server = "s0"
    [[link]]
    a = "s0/gpu0"
    b = "s0/nvswitch"
    kind = "nvlink4"           # catalogue kind: rate and latency default to its figures
    count = 18                 # links used together; or a rate: gbit_per_s, gbyte_per_s or bytes_per_s
    duplex = true              # default: both directions at the full rate

Every mistake is reported as ``<file>: <key>: <what is wrong>`` before a topology is returned (a file that is
not UTF-8 text as ``<file>: not UTF-8 text ...``). Reading uses the standard library's tomllib; writing formats
TOML by hand (no extra dependency).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any, NoReturn

from dtrain.cluster import units
from dtrain.cluster.builders import ClusterSpec, build, spec_parts
from dtrain.cluster.catalogue import LINKS
from dtrain.cluster.devices import DEVICES, make_device
from dtrain.cluster.presets import _ALIASES, PARAMETERS, PRESETS, preset_spec, with_overrides
from dtrain.cluster.toml_writer import dumps, dumps_build, save  # writing has its own module; re-exported here
from dtrain.cluster.topology import NODE_KINDS, Device, Topology

__all__ = ["TopologyFileError", "load", "loads", "resolve", "save", "dumps", "dumps_build"]

_NODE_KEYS = {"name", "kind", "server", "rack", "layer", "device", "precision", "peak_flops", "memory_bytes",
              "memory_bytes_per_s"}  # fmt: skip
_GPU_KEYS = {"device", "precision", "peak_flops", "memory_bytes", "memory_bytes_per_s"}
_LINK_KEYS = {"a", "b", "kind", "count", "gbit_per_s", "gbyte_per_s", "bytes_per_s", "latency_s", "duplex"}
_RATE_KEYS = ("gbit_per_s", "gbyte_per_s", "bytes_per_s")
_INT_PARAMS = {"gpus", "gpus_per_server", "gpus_per_pcie_switch", "cpus", "nics", "racks", "servers_per_rack",
               "spines", "pods", "cores", "nvlinks_per_gpu"}  # fmt: skip
#: The least an integer parameter of [build] takes where it is not 1 (a server may have no NIC)
_INT_LEAST = {"nics": 0}
_FLOAT_PARAMS = {"oversubscription", "pod_oversubscription"}


class TopologyFileError(ValueError):
    """A topology file that cannot be read; the message names the file, the key and the value."""


def load(path: str | Path, *, max_parts: int | None = None) -> Topology:
    """Read the topology file at ``path``; ``max_parts`` as :func:`loads` takes it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TopologyFileError(f"{path}: cannot read topology file ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TopologyFileError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); a topology file is TOML, "
            "which is UTF-8"
        ) from None
    return loads(text, source=str(path), default_name=path.stem, max_parts=max_parts)


def resolve(name_or_path: str, **overrides: Any) -> Topology:
    """A preset by name (with ``overrides``), else the topology file at that path (no overrides)."""
    if name_or_path in PRESETS:
        from dtrain.cluster.presets import preset

        return preset(name_or_path, **overrides)
    if overrides:
        raise ValueError(f"parameters {sorted(overrides)} apply to presets only, not to file {name_or_path!r}")
    if not Path(name_or_path).exists():
        raise TopologyFileError(f"{name_or_path}: neither a preset ({', '.join(PRESETS)}) nor an existing file")
    return load(name_or_path)


def loads(
    text: str, *, source: str = "<string>", default_name: str = "topology", max_parts: int | None = None
) -> Topology:
    """Parse topology TOML ``text``; ``source`` names it in errors. ``max_parts``: a ``[build]`` that would make
    more parts (:func:`dtrain.cluster.builders.spec_parts`) is refused before it is built (None: any size)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyFileError(f"{source}: not valid TOML: {exc}") from None
    reader = _Reader(source, max_parts)
    unknown = sorted(set(data) - {"name", "build", "node", "link"})
    if unknown:
        reader.fail(unknown[0], data[unknown[0]], "unknown key; expected name, [build], [[node]] or [[link]]")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        reader.fail("name", name, "must be a non-empty string")
    has_graph = "node" in data or "link" in data
    if "build" in data and has_graph:
        reader.fail("build", "...", "a file has either [build] or [[node]]/[[link]], not both")
    if "build" in data:
        return reader.build(data["build"], name)
    if not has_graph:
        reader.fail("build", None, "missing: give [build] (a preset and parameters) or [[node]] and [[link]]")
    topology = Topology(name)
    for i, node in enumerate(reader.tables(data, "node")):
        reader.node(topology, node, f"node[{i}]")
    for i, link in enumerate(reader.tables(data, "link")):
        reader.link(topology, link, f"link[{i}]")
    if not topology.devices():
        raise TopologyFileError(f'{source}: node: no GPU; a topology needs at least one [[node]] with kind = "gpu"')
    try:
        topology.validate()
    except ValueError as exc:
        raise TopologyFileError(f"{source}: inconsistent topology: {exc}") from None
    return topology


class _Reader:
    """Turns parsed TOML into a topology, naming ``source`` and the key in every error."""

    def __init__(self, source: str, max_parts: int | None = None) -> None:
        self.source = source
        self.max_parts = max_parts

    def fail(self, key: str, value: Any, problem: str) -> NoReturn:
        raise TopologyFileError(f"{self.source}: {key} = {value!r}: {problem}")

    def tables(self, data: dict, key: str) -> list[dict]:
        tables = data.get(key, [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            self.fail(key, tables, f"must be an array of tables, written [[{key}]]")
        return tables

    def build(self, table: Any, name: str) -> Topology:
        if not isinstance(table, dict):
            self.fail("build", table, "must be a table, written [build]")
        params = dict(table)
        preset = params.pop("preset", None)
        if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
            self.fail("build.preset", preset, f"unknown preset; known: {', '.join(PRESETS)}")
        for key, value in params.items():
            self._check_param(key, value)
        try:
            spec = preset_spec(preset, **params) if preset else with_overrides(ClusterSpec(), **params)
        except ValueError as exc:
            raise TopologyFileError(f"{self.source}: [build]: {exc}") from None
        parts = spec_parts(spec)
        if self.max_parts is not None and parts > self.max_parts:
            raise TopologyFileError(
                f"{self.source}: [build]: would have {parts:,} devices, NICs, CPUs and switch links; at most "
                f"{self.max_parts:,} are built ({spec.racks * spec.servers_per_rack * spec.server.gpus:,} devices here)"
            )
        try:
            return build(spec, name=name)
        except ValueError as exc:
            raise TopologyFileError(f"{self.source}: [build]: {exc}") from None

    def _check_param(self, key: str, value: Any) -> None:
        where = f"build.{key}"
        if key not in PARAMETERS:
            self.fail(where, value, f"unknown parameter; known: preset, {', '.join(PARAMETERS)}")
        field = _ALIASES.get(key, key)
        least = _INT_LEAST.get(field, 1)
        if field in _INT_PARAMS and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            self.fail(where, value, f"must be a whole number >= {least}")
        if field in _FLOAT_PARAMS and (not _is_number(value) or value < 1):
            self.fail(where, value, "must be a ratio >= 1 (1 is 1:1, 4 is 1:4)")
        if field in ("nic", "uplink", "pcie", "nvlink", "cpu_link") and value not in LINKS:
            self.fail(where, value, f"unknown link kind; known: {', '.join(LINKS)}")
        if field in ("device", "intra", "precision") and not isinstance(value, str):
            self.fail(where, value, "must be a string")
        if field == "gpudirect_rdma" and not isinstance(value, bool):
            self.fail(where, value, "must be true or false")

    def node(self, topology: Topology, node: dict, where: str) -> None:
        self._keys(node, _NODE_KEYS, where)
        name, kind = node.get("name"), node.get("kind")
        if not isinstance(name, str) or not name:
            self.fail(f"{where}.name", name, "every node needs a non-empty name")
        if name in topology.graph:
            self.fail(f"{where}.name", name, "duplicate node name")
        if kind not in NODE_KINDS:
            self.fail(f"{where}.kind", kind, f"unknown node kind; expected one of {', '.join(sorted(NODE_KINDS))}")
        server, rack, layer = node.get("server"), node.get("rack"), node.get("layer")
        for key in ("server", "rack", "layer"):
            if node.get(key) is not None and not isinstance(node[key], str):
                self.fail(f"{where}.{key}", node[key], "must be a string")
        if kind != "gpu":
            for key in sorted(set(node) & _GPU_KEYS):
                self.fail(f"{where}.{key}", node[key], f"only a gpu node has a {key}; this node is a {kind}")
            topology.add_node(name, kind=kind, server=server, rack=rack, layer=layer)
            return
        if not isinstance(server, str):
            self.fail(f"{where}.server", server, "a gpu needs the name of its server")
        topology.add_device(self._device(node, name, server, rack, where))

    def _device(self, node: dict, name: str, server: str, rack: str | None, where: str) -> Device:
        """A gpu's device: the catalogue's ``device`` (at ``precision``), any of its figures replaced by one the
        node gives, or without ``device`` all three figures. Every figure given must be a number > 0 (a byte
        count >= 1): a 0 is refused, never read as "the catalogue's"."""
        figures = ("peak_flops", "memory_bytes", "memory_bytes_per_s")
        given = {key: self._figure(node[key], f"{where}.{key}", key) for key in figures if key in node}
        if "device" not in node:
            if "precision" in node:
                self.fail(f"{where}.precision", node["precision"], "picks a catalogue device's peak; needs device = "
                          "<catalogue key> (without one, give peak_flops at the training precision)")  # fmt: skip
            for key in figures:
                if key not in given:
                    self.fail(f"{where}.{key}", None, "a gpu needs device = <catalogue key> or this figure > 0")
            return Device(name=name, server=server, rack=rack, **given)
        if node["device"] not in DEVICES:
            self.fail(f"{where}.device", node["device"], f"unknown device; known: {', '.join(DEVICES)}")
        if "precision" in node and "peak_flops" in given:
            self.fail(f"{where}.peak_flops", node["peak_flops"], "give precision or peak_flops, not both")
        precision = node.get("precision", "bf16")
        try:
            device = make_device(node["device"], name=name, server=server, rack=rack, precision=precision)
        except ValueError as exc:
            self.fail(f"{where}.precision", precision, str(exc))
        return dataclasses.replace(device, **given)

    def _figure(self, value: Any, where: str, key: str) -> float | int:
        if key == "memory_bytes":
            if not _is_number(value) or value < 1:
                self.fail(where, value, "device memory must be a number of bytes >= 1")
            return int(value)
        if not _is_number(value) or value <= 0:
            self.fail(where, value, "must be a number > 0")
        return float(value)

    def link(self, topology: Topology, link: dict, where: str) -> None:
        self._keys(link, _LINK_KEYS, where)
        for end in ("a", "b"):
            if link.get(end) not in topology.graph:
                self.fail(f"{where}.{end}", link.get(end), "a link to an unknown node; declare it in [[node]]")
        kind = link.get("kind")
        if kind not in LINKS:
            self.fail(f"{where}.kind", kind, f"unknown link kind; known: {', '.join(LINKS)}")
        count = link.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            self.fail(f"{where}.count", count, "must be a whole number >= 1")
        latency = link.get("latency_s", LINKS[kind].latency_s)
        if not _is_number(latency) or latency < 0:
            self.fail(f"{where}.latency_s", latency, "must be a number of seconds >= 0")
        duplex = link.get("duplex", True)
        if not isinstance(duplex, bool):
            self.fail(f"{where}.duplex", duplex, "must be true or false")
        rate = self._rate(link, where) or count * LINKS[kind].bytes_per_s
        try:
            topology.add_link(link["a"], link["b"], bytes_per_s=rate, latency_s=latency, kind=kind, duplex=duplex)
        except ValueError as exc:
            self.fail(where, f"{link['a']} -> {link['b']}", str(exc))

    def _rate(self, link: dict, where: str) -> float | None:
        given = [key for key in _RATE_KEYS if key in link]
        if len(given) > 1:
            self.fail(f"{where}.{given[1]}", link[given[1]], f"give one rate, not both {given[0]} and {given[1]}")
        if not given:
            return None
        key, value = given[0], link[given[0]]
        if not _is_number(value) or value <= 0:
            self.fail(f"{where}.{key}", value, "a rate must be a number > 0")
        if key == "gbit_per_s":
            return units.gbit_per_s_to_bytes_per_s(value)
        return units.gbyte_per_s_to_bytes_per_s(value) if key == "gbyte_per_s" else float(value)

    def _keys(self, table: dict, allowed: set[str], where: str) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            self.fail(f"{where}.{unknown[0]}", table[unknown[0]], f"unknown key; expected {', '.join(sorted(allowed))}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
