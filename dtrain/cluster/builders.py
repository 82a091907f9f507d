"""Builders: a server, a rack, a leaf-spine or multi-level tree with a chosen oversubscription.

The shapes are those of GPU training clusters such as NVIDIA's DGX SuperPOD (DGX A100 and DGX H100 user
guides and reference architectures): servers of several accelerators, inside each a
heterogeneous network (GPUs on NVLink/NVSwitch or only on PCIe, PCIe switches under CPUs joined by QPI/UPI,
NICs beside the GPUs); servers in a rack under a top-of-rack (ToR) switch; ToRs under spine switches. A ToR's
uplink capacity is its downlink capacity divided by the oversubscription ratio (Al-Fares et al., "A Scalable,
Commodity Data Center Network Architecture", SIGCOMM 2008, section 2.1: typical designs run 2.5:1 to 8:1), spread
evenly over the spines; every ToR reaches every spine, so cross-rack traffic has one equal-cost path per spine
for :meth:`Topology.route` to hash flows over (ECMP). A multi-level tree groups racks into pods, each with its
own spines, under core switches with a second ratio.

Names: servers ``s0, s1, ...`` numbered across the cluster, their parts ``s0/gpu3``, ``s0/cpu1``,
``s0/pcie2``, ``s0/nic5``, ``s0/nvswitch``; racks ``r0, ...`` with switch ``r0/tor``; spines ``spine0`` (or
``p1/spine0`` in pod 1 of a multi-level tree); cores ``core0``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from dtrain.cluster.catalogue import LINKS, link_spec
from dtrain.cluster.devices import device_spec, make_device
from dtrain.cluster.routing import NIC_AFFINITIES, ROUTINGS
from dtrain.cluster.topology import Topology, collector_paused

__all__ = [
    "ServerSpec",
    "ClusterSpec",
    "INTRA_KINDS",
    "FABRICS",
    "add_server",
    "build",
    "build_server",
    "fat_tree",
    "spec_parts",
]

#: How a server's GPUs talk to each other: an NVSwitch fabric, NVLink between every pair, or only PCIe.
INTRA_KINDS = ("nvswitch", "nvlink-mesh", "pcie")
#: How racks are joined: ToRs under spines (and pods under cores, every spine to every core), rail-optimised (one
#: leaf a NIC index per scalable unit, every leaf under every spine), or a fat-tree (a folded Clos of two or
#: three tiers: leaves under their pod's spines, spine ``j`` of every pod under core group ``j``).
FABRICS = ("leaf-spine", "rail", "fat-tree")
#: Link families a NIC or a switch uplink may be.
NETWORK_FAMILIES = ("ethernet", "infiniband")


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """One server.

    ``gpus`` accelerators of catalogue ``device``, their ``peak_flops`` taken at ``precision``; ``intra`` how
    they reach each other (:data:`INTRA_KINDS`; an NVLink mesh splits a GPU's links evenly over its peers, any
    remainder unused), over ``nvlinks_per_gpu`` links of kind ``nvlink`` (both default to the device's own);
    ``gpus_per_pcie_switch`` GPUs under each PCIe switch of kind ``pcie`` (default: the device's), whose one
    uplink to a CPU they share; ``cpus`` joined in a chain by ``cpu_link``; ``nics`` NICs of kind ``nic``, under
    the GPUs' PCIe switches when ``gpudirect_rdma`` (the NIC reads GPU memory directly) and on the CPUs when not.
    """

    gpus: int = 8
    device: str = "a100-sxm"
    precision: str = "bf16"
    intra: str = "nvswitch"
    nvlink: str | None = None
    nvlinks_per_gpu: int | None = None
    pcie: str | None = None
    gpus_per_pcie_switch: int = 2
    cpus: int = 2
    cpu_link: str = "upi"
    nics: int = 8
    nic: str = "ib-hdr"
    gpudirect_rdma: bool = True

    def __post_init__(self) -> None:
        device_spec(self.device).flops(self.precision)
        for name, least in (("gpus", 1), ("cpus", 1), ("nics", 0), ("gpus_per_pcie_switch", 1)):
            _whole(f"server {name}", getattr(self, name), least)
        if self.nvlinks_per_gpu is not None:
            _whole("server nvlinks_per_gpu", self.nvlinks_per_gpu, 1)
        if not isinstance(self.gpudirect_rdma, bool):
            raise ValueError(f"server gpudirect_rdma must be true or false, got {self.gpudirect_rdma!r}")
        if self.intra not in INTRA_KINDS:
            raise ValueError(f"server intra {self.intra!r} is not one of {INTRA_KINDS}")
        _expect_family("nvlink", self.nvlink_kind, ("nvlink",))
        _expect_family("pcie", self.pcie_kind, ("pcie",))
        _expect_family("cpu_link", self.cpu_link, ("cpu-interconnect",))
        _expect_family("nic", self.nic, NETWORK_FAMILIES)
        if self.intra == "nvlink-mesh" and self.gpus > 1 and self.links_per_gpu < self.gpus - 1:
            raise ValueError(f"nvlink-mesh of {self.gpus} GPUs needs >= {self.gpus - 1} NVLinks a GPU")

    @property
    def nvlink_kind(self) -> str:
        return self.nvlink or device_spec(self.device).nvlink or "nvlink3"

    @property
    def links_per_gpu(self) -> int:
        return self.nvlinks_per_gpu or LINKS[self.nvlink_kind].links_per_chip or 1

    @property
    def pcie_kind(self) -> str:
        return self.pcie or device_spec(self.device).pcie

    @property
    def pcie_switches(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_pcie_switch)

    @property
    def nic_bytes_per_s(self) -> float:
        """All the server's NICs together, one direction: what it can put into its ToR."""
        return self.nics * LINKS[self.nic].bytes_per_s


def _expect_family(what: str, key: str, families: tuple[str, ...]) -> None:
    if link_spec(key).family not in families:
        raise ValueError(f"{what} {key!r} is a {LINKS[key].family} link, expected {' or '.join(families)}")


def _whole(what: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be a whole number >= {least}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Racks of identical servers; ``spines`` above the ToRs when there are several racks (per pod when
    ``pods > 1``, with ``cores`` above the pods). ``oversubscription`` is the ToR's downlink:uplink ratio
    (4 means 1:4: a quarter of the servers' rate leaves the rack), ``pod_oversubscription`` the spine's.

    ``fabric`` (:data:`FABRICS`) wires the tiers; with ``fabric="fat-tree"`` and ``rails`` each rack has one
    leaf per NIC index (rail-optimised leaves) instead of one ToR, and ``cores`` must be a multiple of
    ``spines`` (spine ``j`` of each pod reaches cores ``j * cores / spines`` onwards, Al-Fares et al. 2008,
    section 3.2). ``nic_affinity`` (:data:`dtrain.cluster.routing.NIC_AFFINITIES`): ``"rail"`` sends GPU
    ``k``'s traffic through NIC ``k`` on servers with one NIC per GPU (others hash over their NICs). ``routing``
    (:data:`dtrain.cluster.routing.ROUTINGS`): how the switches pick among equal-cost paths, ``"ecmp"`` (a hash
    per flow, Ethernet/RoCE) or ``"d-mod-k"`` (by destination, an InfiniBand subnet manager's fat-tree routing)."""

    server: ServerSpec = field(default_factory=ServerSpec)
    racks: int = 1
    servers_per_rack: int = 1
    spines: int = 2
    oversubscription: float = 1.0
    uplink: str | None = None  # link kind of ToR-spine and spine-core links; default: the server's NIC kind
    pods: int = 1
    cores: int = 2
    pod_oversubscription: float = 1.0
    fabric: str = "leaf-spine"
    nic_affinity: str = "rail"
    rails: bool = False
    routing: str = "ecmp"

    def __post_init__(self) -> None:
        if self.fabric not in FABRICS:
            raise ValueError(f"cluster fabric {self.fabric!r} is not one of {FABRICS}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"cluster routing {self.routing!r} is not one of {ROUTINGS}")
        if self.nic_affinity not in NIC_AFFINITIES:
            raise ValueError(f"cluster nic_affinity {self.nic_affinity!r} is not one of {NIC_AFFINITIES}")
        if self.fabric == "rail" and self.pods > 1:
            raise ValueError("cluster fabric 'rail' has one tier of spines; set pods = 1")
        if self.rails and self.fabric != "fat-tree":
            raise ValueError(
                f"cluster rails = true needs fabric 'fat-tree' (fabric 'rail' always has them), got {self.fabric!r}"
            )
        if not isinstance(self.rails, bool):
            raise ValueError(f"cluster rails must be true or false, got {self.rails!r}")
        for name in ("racks", "servers_per_rack", "spines", "pods", "cores"):
            _whole(f"cluster {name}", getattr(self, name), 1)
        for name in ("oversubscription", "pod_oversubscription"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 1):
                raise ValueError(f"cluster {name} must be a ratio >= 1 (1 is 1:1, 4 is 1:4), got {value!r}")
        if self.racks % self.pods:
            raise ValueError(f"{self.racks} racks do not split into {self.pods} equal pods")
        if self.fabric == "fat-tree" and self.pods > 1 and self.cores % self.spines:
            raise ValueError(
                f"cluster fabric 'fat-tree': cores ({self.cores}) must be a multiple of spines ({self.spines}), "
                "one group of cores a spine index"
            )
        if self.server.nics == 0 and self.racks * self.servers_per_rack > 1:
            raise ValueError("servers with no NICs cannot be joined into a rack; set server nics >= 1")
        _expect_family("uplink", self.uplink_kind, NETWORK_FAMILIES)

    @property
    def uplink_kind(self) -> str:
        return self.uplink or self.server.nic

    @property
    def tor_downlink_bytes_per_s(self) -> float:
        """One direction of all the links from a ToR down to its servers."""
        return self.servers_per_rack * self.server.nic_bytes_per_s

    @property
    def tor_uplink_bytes_per_s(self) -> float:
        """One direction of all of a ToR's uplinks: its downlink capacity over the oversubscription ratio."""
        return self.tor_downlink_bytes_per_s / self.oversubscription


def _row(a: str, b: str, kind: str, count: float = 1) -> tuple[str, str, float, float, str]:
    spec = LINKS[kind]
    return a, b, float(count * spec.bytes_per_s), float(spec.latency_s), kind


@functools.cache
def _server_parts(spec: ServerSpec) -> tuple[tuple, tuple, tuple]:
    """A server of ``spec`` by part names (``gpu3``, ``nic5``): its nodes as runs of ``(kind, parts)`` in the order
    they are added (GPUs a run of their own), its links as rows of :meth:`Topology.add_links`, its NICs."""
    cpus = [f"cpu{c}" for c in range(spec.cpus)]
    switches = [f"pcie{i}" for i in range(spec.pcie_switches)]
    gpus = [f"gpu{g}" for g in range(spec.gpus)]
    nics = [f"nic{k}" for k in range(spec.nics)]
    links = [_row(cpus[c - 1], cpus[c], spec.cpu_link) for c in range(1, spec.cpus)]
    # PCIe switches spread over the CPUs; under each, its GPUs and NICs share the switch's one x16 uplink.
    links += [_row(switch, cpus[i * spec.cpus // len(switches)], spec.pcie_kind) for i, switch in enumerate(switches)]
    links += [_row(gpu, switches[g // spec.gpus_per_pcie_switch], spec.pcie_kind) for g, gpu in enumerate(gpus)]
    runs = [("cpu", cpus), ("pcie-switch", switches), ("gpu", gpus)]
    if spec.intra == "nvswitch" and len(gpus) >= 2:
        runs.append(("nvswitch", ["nvswitch"]))
        links += [_row(gpu, "nvswitch", spec.nvlink_kind, spec.links_per_gpu) for gpu in gpus]
    elif spec.intra != "pcie" and len(gpus) >= 2:
        per_pair = spec.links_per_gpu // (len(gpus) - 1)  # every GPU's links split evenly over its peers
        links += [_row(a, b, spec.nvlink_kind, per_pair) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    # GPUDirect RDMA needs the NIC and the GPU under one PCIe root (NVIDIA GPUDirect RDMA documentation); without
    # it a NIC hangs off a CPU and every byte between servers passes through the host.
    runs.append(("nic", nics))
    for k, nic in enumerate(nics):
        parent = switches[k * len(switches) // spec.nics] if spec.gpudirect_rdma else cpus[k % spec.cpus]
        links.append(_row(nic, parent, spec.pcie_kind))
    # each server's links are added unchecked (_add_checked_links): check the template's once
    pairs = [pair for a, b, *_ in links for pair in ((a, b), (b, a))]
    if len(set(pairs)) != len(pairs) or any(
        a == b or not (rate > 0 and latency >= 0) for a, b, rate, latency, _ in links
    ):
        raise ValueError(f"server spec {spec!r} gives duplicate or invalid links")
    return tuple((kind, tuple(parts)) for kind, parts in runs), tuple(links), tuple(nics)


def add_server(topology: Topology, spec: ServerSpec, name: str, rack: str | None = None) -> list[str]:
    """Add server ``name`` to ``topology``; its NIC node names (to cable to a ToR)."""
    runs, links, nics = _server_parts(spec)
    prefix = f"{name}/"
    topology.add_nodes(
        make_device(spec.device, name=prefix + part, server=name, rack=rack, precision=spec.precision)
        if kind == "gpu"
        else (prefix + part, kind, name, rack)
        for kind, parts in runs
        for part in parts
    )
    # the server's parts are new nodes (add_nodes checked their names): no link joins them yet
    topology._add_checked_links([(prefix + a, prefix + b, rate, latency, kind) for a, b, rate, latency, kind in links])
    return [prefix + nic for nic in nics]


def build_server(spec: ServerSpec | None = None, *, name: str = "server") -> Topology:
    """A topology of one server ``s0``."""
    topology = Topology(name)
    add_server(topology, spec or ServerSpec(), "s0")
    return topology


def spec_parts(spec: ClusterSpec) -> int:
    """How many parts ``spec`` builds, as the command line bounds them (``dtrain.cli.cluster_common.MAX_PARTS``):
    every server's devices, NICs and CPUs, and the links between switches (ToR to spine, spine to core)."""
    servers = spec.racks * spec.servers_per_rack
    parts = servers * (spec.server.gpus + spec.server.nics + spec.server.cpus)
    return parts + spec.racks * spec.spines + spec.pods * spec.spines * spec.cores


def build(spec: ClusterSpec, *, name: str = "cluster") -> Topology:
    """The whole cluster: one server alone, one rack under its ToR, or racks under spines (and cores)."""
    with collector_paused():
        return _build(spec, name)


def _build(spec: ClusterSpec, name: str) -> Topology:
    topology = Topology(name)
    topology.nic_affinity = spec.nic_affinity
    topology.routing = spec.routing
    if spec.racks * spec.servers_per_rack == 1:
        add_server(topology, spec.server, "s0")
        return topology
    if spec.fabric == "rail":
        _add_rails(topology, spec)
        return topology
    if spec.fabric == "fat-tree":
        _add_fat_tree(topology, spec)
        return topology
    tors = [_add_rack(topology, spec, r) for r in range(spec.racks)]
    if spec.racks > 1:
        _add_spines(topology, spec, tors)
    return topology


def _add_rails(topology: Topology, spec: ClusterSpec) -> None:
    """A rail-optimised fabric (NVIDIA DGX SuperPOD reference architecture): each rack is a scalable unit with one
    leaf switch per NIC index (rail); NIC ``k`` of every server of the unit is cabled to leaf ``rail{k}``, and
    every leaf to every spine at the unit's downlink rate over the oversubscription ratio, split over the
    spines. Traffic between GPUs of equal index stays on their rail's leaf within a unit."""
    nics = spec.server.nics
    uplink = LINKS[spec.uplink_kind]
    per_spine = spec.servers_per_rack * LINKS[spec.server.nic].bytes_per_s / spec.oversubscription / spec.spines
    spines = [f"spine{k}" for k in range(spec.spines)]
    for spine in spines:
        topology.add_node(spine, kind="switch", layer="spine")
    for r in range(spec.racks):
        rack = f"r{r}"
        leaves = [f"{rack}/rail{k}" for k in range(nics)]
        for leaf in leaves:
            topology.add_node(leaf, kind="switch", rack=rack, layer="tor")
            topology.add_links((leaf, spine, per_spine, uplink.latency_s, uplink.key) for spine in spines)
        for s in range(spec.servers_per_rack):
            ports = add_server(topology, spec.server, f"s{r * spec.servers_per_rack + s}", rack)
            topology.add_links(_row(nic, leaf, spec.server.nic) for nic, leaf in zip(ports, leaves, strict=True))


def _add_rack(topology: Topology, spec: ClusterSpec, r: int) -> str:
    rack, tor = f"r{r}", f"r{r}/tor"
    topology.add_node(tor, kind="switch", rack=rack, layer="tor")
    for s in range(spec.servers_per_rack):
        ports = add_server(topology, spec.server, f"s{r * spec.servers_per_rack + s}", rack)
        topology.add_links(_row(nic, tor, spec.server.nic) for nic in ports)
    return tor


def _add_spines(topology: Topology, spec: ClusterSpec, tors: list[str]) -> None:
    racks_per_pod = spec.racks // spec.pods
    tor_to_spine = spec.tor_uplink_bytes_per_s / spec.spines
    spine_uplink = racks_per_pod * tor_to_spine / spec.pod_oversubscription / spec.cores
    uplink = LINKS[spec.uplink_kind]
    cores = [f"core{c}" for c in range(spec.cores)] if spec.pods > 1 else []
    for core in cores:
        topology.add_node(core, kind="switch", layer="core")
    for p in range(spec.pods):
        prefix = f"p{p}/" if spec.pods > 1 else ""
        for k in range(spec.spines):
            spine = f"{prefix}spine{k}"
            topology.add_node(spine, kind="switch", layer="spine")
            for tor in tors[p * racks_per_pod : (p + 1) * racks_per_pod]:
                topology.add_link(tor, spine, bytes_per_s=tor_to_spine, latency_s=uplink.latency_s, kind=uplink.key)
            for core in cores:
                topology.add_link(spine, core, bytes_per_s=spine_uplink, latency_s=uplink.latency_s, kind=uplink.key)


def _add_fat_tree(topology: Topology, spec: ClusterSpec) -> None:
    """A folded Clos (fat-tree) of two tiers (``pods == 1``: leaves under spines) or three (leaves under their
    pod's spines, spines under cores). Each leaf (a rack's ToR, or with ``rails`` one leaf per NIC index of the
    rack) sends its servers' rate over the oversubscription ratio up, split evenly over its pod's spines; each
    spine sends what its leaves give it over ``pod_oversubscription`` up, split over its group of
    ``cores / spines`` cores (Al-Fares et al., SIGCOMM 2008, section 3.2; a k-ary fat-tree is :func:`fat_tree`).
    Every leaf pair of a pod has ``spines`` equal-cost paths, every pair across pods ``cores``."""
    server, uplink = spec.server, LINKS[spec.uplink_kind]
    rails = spec.server.nics if spec.rails else 0
    per_leaf_down = spec.servers_per_rack * LINKS[server.nic].bytes_per_s * (1 if rails else server.nics)
    leaf_to_spine = per_leaf_down / spec.oversubscription / spec.spines
    racks_per_pod = spec.racks // spec.pods
    leaves_per_pod = racks_per_pod * (rails or 1)
    group = spec.cores // spec.spines if spec.pods > 1 else 0
    spine_to_core = leaves_per_pod * leaf_to_spine / spec.pod_oversubscription / group if group else 0.0
    cores = [f"core{c}" for c in range(spec.cores)] if spec.pods > 1 else []
    for core in cores:
        topology.add_node(core, kind="switch", layer="core")
    for p in range(spec.pods):
        prefix = f"p{p}/" if spec.pods > 1 else ""
        spines = [f"{prefix}spine{k}" for k in range(spec.spines)]
        for k, spine in enumerate(spines):
            topology.add_node(spine, kind="switch", layer="spine")
            for core in cores[k * group : (k + 1) * group]:
                topology.add_link(spine, core, bytes_per_s=spine_to_core, latency_s=uplink.latency_s, kind=uplink.key)
        for r in range(p * racks_per_pod, (p + 1) * racks_per_pod):
            rack = f"r{r}"
            leaves = [f"{rack}/rail{k}" for k in range(rails)] if rails else [f"{rack}/tor"]
            for leaf in leaves:
                topology.add_node(leaf, kind="switch", rack=rack, layer="tor")
                for spine in spines:
                    topology.add_link(leaf, spine, bytes_per_s=leaf_to_spine, latency_s=uplink.latency_s,
                                      kind=uplink.key)  # fmt: skip
            for s in range(spec.servers_per_rack):
                ports = add_server(topology, server, f"s{r * spec.servers_per_rack + s}", rack)
                topology.add_links(_row(nic, leaves[i if rails else 0], server.nic) for i, nic in enumerate(ports))


def fat_tree(k: int, server: ServerSpec | None = None, **changes: object) -> ClusterSpec:
    """The k-ary fat-tree of Al-Fares et al. (SIGCOMM 2008, section 3.2): ``k`` pods, each of ``k/2`` edge
    (leaf) and ``k/2`` aggregation (spine) switches, ``(k/2)^2`` cores, ``k/2`` servers under each edge switch:
    ``k^3/4`` servers, 1:1 at every tier when each server has one NIC. ``server`` defaults to one A100 with one
    HDR NIC; ``changes`` are further :class:`ClusterSpec` fields."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 2 or k % 2:
        raise ValueError(f"fat-tree k must be an even whole number >= 2, got {k!r}")
    server = server or ServerSpec(gpus=1, gpus_per_pcie_switch=1, cpus=1, nics=1)
    half = k // 2
    fields = dict(server=server, racks=k * half, servers_per_rack=half, pods=k, spines=half, cores=half * half,
                  fabric="fat-tree")  # fmt: skip
    fields.update(changes)
    return ClusterSpec(**fields)
