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

import math
from dataclasses import dataclass, field

from dtrain.cluster.catalogue import LINKS, link_spec
from dtrain.cluster.devices import device_spec, make_device
from dtrain.cluster.routing import NIC_AFFINITIES
from dtrain.cluster.topology import Topology

__all__ = ["ServerSpec", "ClusterSpec", "INTRA_KINDS", "FABRICS", "add_server", "build", "build_server"]

#: How a server's GPUs talk to each other: an NVSwitch fabric, NVLink between every pair, or only PCIe.
INTRA_KINDS = ("nvswitch", "nvlink-mesh", "pcie")
#: How racks are joined: ToRs under spines (and pods under cores), or rail-optimised (one leaf a NIC index
#: per scalable unit, every leaf under every spine).
FABRICS = ("leaf-spine", "rail")
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
    (4 means 1:4: a quarter of the servers' rate leaves the rack), ``pod_oversubscription`` the spine's."""

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
    nic_affinity: str = "ecmp"

    def __post_init__(self) -> None:
        if self.fabric not in FABRICS:
            raise ValueError(f"cluster fabric {self.fabric!r} is not one of {FABRICS}")
        if self.nic_affinity not in NIC_AFFINITIES:
            raise ValueError(f"cluster nic_affinity {self.nic_affinity!r} is not one of {NIC_AFFINITIES}")
        if self.fabric == "rail" and self.pods > 1:
            raise ValueError("cluster fabric 'rail' has one tier of spines; set pods = 1")
        for name in ("racks", "servers_per_rack", "spines", "pods", "cores"):
            _whole(f"cluster {name}", getattr(self, name), 1)
        for name in ("oversubscription", "pod_oversubscription"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 1):
                raise ValueError(f"cluster {name} must be a ratio >= 1 (1 is 1:1, 4 is 1:4), got {value!r}")
        if self.racks % self.pods:
            raise ValueError(f"{self.racks} racks do not split into {self.pods} equal pods")
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


def _link(topology: Topology, a: str, b: str, kind: str, count: float = 1) -> None:
    spec = LINKS[kind]
    topology.add_link(a, b, bytes_per_s=count * spec.bytes_per_s, latency_s=spec.latency_s, kind=kind)


def add_server(topology: Topology, spec: ServerSpec, name: str, rack: str | None = None) -> list[str]:
    """Add server ``name`` to ``topology``; its NIC node names (to cable to a ToR)."""
    topology.add_node(f"{name}/cpu0", kind="cpu", server=name, rack=rack)
    for c in range(1, spec.cpus):
        topology.add_node(f"{name}/cpu{c}", kind="cpu", server=name, rack=rack)
        _link(topology, f"{name}/cpu{c - 1}", f"{name}/cpu{c}", spec.cpu_link)
    # PCIe switches spread over the CPUs; under each, its GPUs and NICs share the switch's one x16 uplink.
    switches = [f"{name}/pcie{i}" for i in range(spec.pcie_switches)]
    for i, switch in enumerate(switches):
        topology.add_node(switch, kind="pcie-switch", server=name, rack=rack)
        _link(topology, switch, f"{name}/cpu{i * spec.cpus // len(switches)}", spec.pcie_kind)
    gpus = [f"{name}/gpu{g}" for g in range(spec.gpus)]
    for g, gpu in enumerate(gpus):
        topology.add_device(make_device(spec.device, name=gpu, server=name, rack=rack, precision=spec.precision))
        _link(topology, gpu, switches[g // spec.gpus_per_pcie_switch], spec.pcie_kind)
    _add_nvlink(topology, spec, name, gpus, rack)
    # GPUDirect RDMA needs the NIC and the GPU under one PCIe root (NVIDIA GPUDirect RDMA documentation); without
    # it a NIC hangs off a CPU
    # and every byte between servers passes through the host.
    nics = [f"{name}/nic{k}" for k in range(spec.nics)]
    for k, nic in enumerate(nics):
        topology.add_node(nic, kind="nic", server=name, rack=rack)
        parent = switches[k * len(switches) // spec.nics] if spec.gpudirect_rdma else f"{name}/cpu{k % spec.cpus}"
        _link(topology, nic, parent, spec.pcie_kind)
    return nics


def _add_nvlink(topology: Topology, spec: ServerSpec, name: str, gpus: list[str], rack: str | None) -> None:
    if spec.intra == "pcie" or len(gpus) < 2:
        return
    if spec.intra == "nvswitch":
        fabric = f"{name}/nvswitch"
        topology.add_node(fabric, kind="nvswitch", server=name, rack=rack)
        for gpu in gpus:
            _link(topology, gpu, fabric, spec.nvlink_kind, spec.links_per_gpu)
        return
    per_pair = spec.links_per_gpu // (len(gpus) - 1)  # every GPU's links split evenly over its peers
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            _link(topology, a, b, spec.nvlink_kind, per_pair)


def build_server(spec: ServerSpec | None = None, *, name: str = "server") -> Topology:
    """A topology of one server ``s0``."""
    topology = Topology(name)
    add_server(topology, spec or ServerSpec(), "s0")
    return topology


def build(spec: ClusterSpec, *, name: str = "cluster") -> Topology:
    """The whole cluster: one server alone, one rack under its ToR, or racks under spines (and cores)."""
    topology = Topology(name)
    topology.nic_affinity = spec.nic_affinity
    if spec.racks * spec.servers_per_rack == 1:
        add_server(topology, spec.server, "s0")
        return topology
    if spec.fabric == "rail":
        _add_rails(topology, spec)
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
            for spine in spines:
                topology.add_link(leaf, spine, bytes_per_s=per_spine, latency_s=uplink.latency_s, kind=uplink.key)
        for s in range(spec.servers_per_rack):
            ports = add_server(topology, spec.server, f"s{r * spec.servers_per_rack + s}", rack)
            for nic, leaf in zip(ports, leaves, strict=True):
                _link(topology, nic, leaf, spec.server.nic)


def _add_rack(topology: Topology, spec: ClusterSpec, r: int) -> str:
    rack, tor = f"r{r}", f"r{r}/tor"
    topology.add_node(tor, kind="switch", rack=rack, layer="tor")
    for s in range(spec.servers_per_rack):
        for nic in add_server(topology, spec.server, f"s{r * spec.servers_per_rack + s}", rack):
            _link(topology, nic, tor, spec.server.nic)
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
