"""The link catalogue: every interconnect a training cluster is built from, each figure with its source.

``bytes_per_s`` is always ONE direction of ONE link (or one x16 slot, one port) in decimal bytes per second;
network links are quoted in Gb/s (bits) and converted with :mod:`dtrain.cluster.units`, never by hand. ``quoted``
keeps the figure exactly as the source states it, so a reader can check the conversion.

Sources: NVIDIA's NVLink and NVSwitch specifications and the P100, V100, A100, H100, H200 and B200 datasheets
(NVLink generations, HBM rates), the DGX A100 and DGX H100 user guides (NVSwitch fabrics), the PCI-SIG base
specifications (PCIe), IEEE 802.3 (Ethernet), the InfiniBand Trade Association's specifications and roadmap
(EDR, HDR, NDR; RoCE v2), the IETF RFCs of iWARP and IP over InfiniBand, Intel's Xeon datasheets (QPI, UPI)
and JEDEC (DDR4, DDR5).

Latencies are one-hop, order-of-magnitude figures (the wire and the port, not the software): NVLink about
0.5 us and PCIe about 1 us per step as in NCCL's tuning model (src/graph/tuning.cc, ``hwLat``), a
cut-through data-centre Ethernet switch port about 1 us, an InfiniBand switch port about 0.2 us (NVIDIA
Quantum switch datasheets: 130 ns). Software overheads belong to the protocol (:data:`PROTOCOLS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.units import gbit_per_s_to_bytes_per_s, gbyte_per_s_to_bytes_per_s

__all__ = [
    "LinkSpec",
    "NVLinkGeneration",
    "NVSwitchSpec",
    "ProtocolSpec",
    "NVLINK_TABLE",
    "LINKS",
    "NVSWITCHES",
    "PROTOCOLS",
    "link_spec",
    "protocol_spec",
    "pcie_x16_bytes_per_s",
]

_NVLINK_SPEC = "NVIDIA NVLink and NVSwitch specifications; P100, V100, A100, H100 and B200 datasheets"
FAMILIES = ("nvlink", "pcie", "cpu-interconnect", "memory", "ethernet", "infiniband")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One kind of link: ``bytes_per_s`` per direction for one link, ``latency_s`` for one hop over it."""

    key: str
    name: str
    family: str  # one of FAMILIES
    bytes_per_s: float
    latency_s: float
    quoted: str  # the rate as the source states it
    source: str
    links_per_chip: int | None = None  # NVLink: links one GPU has (NVIDIA's "links per GPU")

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"link {self.key!r}: family {self.family!r} is not one of {FAMILIES}")
        if not self.bytes_per_s > 0 or not self.latency_s >= 0:
            raise ValueError(f"link {self.key!r}: rate {self.bytes_per_s!r} must be > 0, latency >= 0")

    @property
    def bidirectional_bytes_per_s(self) -> float:
        """Both directions together, as vendors often quote (NVIDIA's "total bandwidth per link")."""
        return 2 * self.bytes_per_s

    @property
    def chip_bytes_per_s(self) -> float:
        """One direction of all of a chip's links (NVLink only): what a GPU can send at once."""
        if self.links_per_chip is None:
            raise ValueError(f"link {self.key!r} has no per-chip figure (only NVLink does)")
        return self.links_per_chip * self.bytes_per_s


@dataclass(frozen=True, kw_only=True)
class NVLinkGeneration:
    """One NVLink generation as NVIDIA specifies it, in its own units (Gb/s signalling per lane, GB/s)."""

    generation: int
    signaling_gbit_per_s: float
    lanes_per_link: int
    gbyte_per_s_per_direction_per_link: float
    gbyte_per_s_total_per_link: float
    links_per_chip: int
    chip: str
    gbyte_per_s_per_chip: float  # both directions, all links: the headline figure (600 GB/s for A100)


#: The NVLink generations (NVIDIA's NVLink specification and each GPU's datasheet), one row each.
NVLINK_TABLE: tuple[NVLinkGeneration, ...] = (
    NVLinkGeneration(generation=1, signaling_gbit_per_s=20, lanes_per_link=8, gbyte_per_s_per_direction_per_link=20,
                     gbyte_per_s_total_per_link=40, links_per_chip=4, chip="P100", gbyte_per_s_per_chip=160),
    NVLinkGeneration(generation=2, signaling_gbit_per_s=25, lanes_per_link=8, gbyte_per_s_per_direction_per_link=25,
                     gbyte_per_s_total_per_link=50, links_per_chip=6, chip="V100", gbyte_per_s_per_chip=300),
    NVLinkGeneration(generation=3, signaling_gbit_per_s=50, lanes_per_link=4, gbyte_per_s_per_direction_per_link=25,
                     gbyte_per_s_total_per_link=50, links_per_chip=12, chip="A100", gbyte_per_s_per_chip=600),
    NVLinkGeneration(generation=4, signaling_gbit_per_s=100, lanes_per_link=2, gbyte_per_s_per_direction_per_link=25,
                     gbyte_per_s_total_per_link=50, links_per_chip=18, chip="H100", gbyte_per_s_per_chip=900),
    NVLinkGeneration(generation=5, signaling_gbit_per_s=200, lanes_per_link=2, gbyte_per_s_per_direction_per_link=50,
                     gbyte_per_s_total_per_link=100, links_per_chip=18, chip="B200", gbyte_per_s_per_chip=1800),
)  # fmt: skip


def _nvlink(row: NVLinkGeneration) -> LinkSpec:
    return LinkSpec(
        key=f"nvlink{row.generation}",
        name=f"NVLink {row.generation} (one link; {row.links_per_chip} per {row.chip})",
        family="nvlink",
        bytes_per_s=gbyte_per_s_to_bytes_per_s(row.gbyte_per_s_per_direction_per_link),
        latency_s=0.5e-6,
        quoted=f"{row.gbyte_per_s_per_direction_per_link:g} GB/s per direction per link, "
        f"{row.gbyte_per_s_per_chip:g} GB/s per chip",
        source=_NVLINK_SPEC,
        links_per_chip=row.links_per_chip,
    )


def pcie_x16_bytes_per_s(giga_transfers_per_s: float, encoding_efficiency: float, lanes: int = 16) -> float:
    """PCIe payload rate per direction: lanes x GT/s x line-code efficiency / 8 bits (PCI-SIG base specs)."""
    return lanes * giga_transfers_per_s * 1e9 * encoding_efficiency / 8


# (generation, GT/s per lane, line-code efficiency): 128b/130b from 3.0 to 5.0; 6.0's FLIT mode carries 242
# payload bytes in a 256-byte flit (PCI-SIG PCIe 6.0 specification).
_PCIE = ((3, 8, 128 / 130), (4, 16, 128 / 130), (5, 32, 128 / 130), (6, 64, 242 / 256))


def _pcie(generation: int, gt_per_s: float, efficiency: float) -> LinkSpec:
    rate = pcie_x16_bytes_per_s(gt_per_s, efficiency)
    return LinkSpec(
        key=f"pcie{generation}x16",
        name=f"PCIe {generation}.0 x16",
        family="pcie",
        bytes_per_s=rate,
        latency_s=1.0e-6,
        quoted=f"{gt_per_s} GT/s per lane x 16 lanes, {efficiency:.4f} line code = {rate / 1e9:.1f} GB/s per direction",
        source=f"PCI-SIG PCI Express base specification {generation}.0",
    )


def _network(key: str, name: str, family: str, gbit_per_s: float, latency_s: float, source: str) -> LinkSpec:
    return LinkSpec(
        key=key,
        name=name,
        family=family,
        bytes_per_s=gbit_per_s_to_bytes_per_s(gbit_per_s),
        latency_s=latency_s,
        quoted=f"{gbit_per_s:g} Gb/s",
        source=source,
    )


def _fixed(key: str, name: str, family: str, gbyte_per_s: float, latency_s: float, source: str) -> LinkSpec:
    return LinkSpec(
        key=key,
        name=name,
        family=family,
        bytes_per_s=gbyte_per_s_to_bytes_per_s(gbyte_per_s),
        latency_s=latency_s,
        quoted=f"{gbyte_per_s:g} GB/s",
        source=source,
    )


_ETHERNET = "IEEE 802.3 (10GBASE to 400GBASE)"
_IB = "InfiniBand Trade Association specification and roadmap (4x ports: EDR 100, HDR 200, NDR 400 Gb/s)"

_LINK_LIST: list[LinkSpec] = [
    *(_nvlink(row) for row in NVLINK_TABLE),
    *(_pcie(*row) for row in _PCIE),
    _fixed("qpi", "Intel QuickPath Interconnect 1.1 (9.6 GT/s x 2 bytes)", "cpu-interconnect", 19.2, 0.1e-6,
           "Intel Xeon E5 v2-v4 datasheets"),
    _fixed("upi", "Intel Ultra Path Interconnect (10.4 GT/s)", "cpu-interconnect", 20.8, 0.1e-6,
           "Intel Xeon Scalable (1st-3rd gen) datasheets"),
    _fixed("upi2", "Intel UPI 2.0 (16 GT/s)", "cpu-interconnect", 32.0, 0.1e-6,
           "Intel Xeon Scalable 4th gen datasheets"),
    _fixed("hbm2e-a100", "A100 80GB PCIe HBM2e", "memory", 1935, 0.0, "NVIDIA A100 datasheet (80GB PCIe: 1935 GB/s)"),
    _fixed("hbm2e-a100-sxm", "A100 80GB SXM HBM2e", "memory", 2039, 0.0, "NVIDIA A100 datasheet"),
    _fixed("hbm3-h100", "H100 SXM5 HBM3", "memory", 3350, 0.0, "NVIDIA H100 datasheet (3.35 TB/s)"),
    _fixed("hbm3e-h200", "H200 SXM HBM3e", "memory", 4800, 0.0, "NVIDIA H200 datasheet (4.8 TB/s)"),
    _fixed("ddr4-3200x8", "host memory, DDR4-3200 x 8 channels (one socket)", "memory", 204.8, 0.1e-6,
           "JEDEC DDR4-3200: 25.6 GB/s a channel"),
    _fixed("ddr5-4800x8", "host memory, DDR5-4800 x 8 channels (one socket)", "memory", 307.2, 0.1e-6,
           "JEDEC DDR5-4800: 38.4 GB/s a channel"),
    # A copy through shared memory reads and writes every byte: half the channels' bandwidth.
    _fixed("shm", "host shared memory (a memcpy through DDR4-3200 x 8)", "memory", 102.4, 0.2e-6,
           "JEDEC DDR4-3200 (each byte read and written)"),
    *(_network(f"ethernet{g}", f"{g} Gb Ethernet", "ethernet", g, 1.0e-6, _ETHERNET) for g in (10, 25, 100, 200, 400)),
    _network("ib-edr", "InfiniBand EDR (4x 25 Gb/s)", "infiniband", 100, 0.2e-6, _IB),
    _network("ib-hdr", "InfiniBand HDR (4x 50 Gb/s)", "infiniband", 200, 0.2e-6, _IB),
    _network("ib-ndr", "InfiniBand NDR (4x 100 Gb/s)", "infiniband", 400, 0.2e-6, _IB),
]  # fmt: skip

#: Every link kind by key; ``Link.kind`` in a topology is one of these.
LINKS: dict[str, LinkSpec] = {spec.key: spec for spec in _LINK_LIST}


def link_spec(key: str) -> LinkSpec:
    """The catalogue entry for ``key`` (e.g. ``"nvlink3"``, ``"pcie4x16"``, ``"ethernet100"``, ``"ib-ndr"``)."""
    try:
        return LINKS[key]
    except KeyError:
        raise ValueError(f"unknown link kind {key!r}; known: {', '.join(LINKS)}") from None


@dataclass(frozen=True, kw_only=True)
class NVSwitchSpec:
    """An NVSwitch fabric inside a server: every GPU reaches every other at its full NVLink rate."""

    key: str
    name: str
    nvlink: str  # the NVLink generation its ports speak
    switches_per_server: int
    gpus: int
    links_per_gpu: int
    latency_s: float
    source: str

    @property
    def gpu_bytes_per_s(self) -> float:
        """One direction of one GPU's links into the fabric."""
        return self.links_per_gpu * LINKS[self.nvlink].bytes_per_s


#: NVSwitch generations as built into NVIDIA's 8-GPU servers (the DGX user guides).
NVSWITCHES: dict[str, NVSwitchSpec] = {
    "nvswitch2": NVSwitchSpec(
        key="nvswitch2", name="NVSwitch gen 2 (DGX A100: 6 switches)", nvlink="nvlink3", switches_per_server=6,
        gpus=8, links_per_gpu=12, latency_s=0.5e-6, source="NVIDIA DGX A100 user guide; NVIDIA NVSwitch specification"),
    "nvswitch3": NVSwitchSpec(
        key="nvswitch3", name="NVSwitch gen 3 (DGX H100: 4 switches of 64 NVLink4 ports)", nvlink="nvlink4",
        switches_per_server=4, gpus=8, links_per_gpu=18, latency_s=0.5e-6,
        source="NVIDIA DGX H100 user guide; NVIDIA NVSwitch specification"),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ProtocolSpec:
    """A way to move bytes between servers over a network link: sockets or RDMA."""

    key: str
    name: str
    families: tuple[str, ...]  # link families it runs on
    kernel_bypass: bool
    zero_copy: bool
    host_copies_per_side: int  # copies between the application's buffer and the kernel's, each end
    routable: bool  # crosses IP routers (layer 3)
    overhead_s: float  # software cost of one message, each way, on top of the wire
    needs: str
    source: str


#: Inter-server protocols. Overheads are typical small-message ping-pong figures, order of magnitude only.
PROTOCOLS: dict[str, ProtocolSpec] = {
    "tcp-ip": ProtocolSpec(
        key="tcp-ip", name="TCP/IP sockets", families=("ethernet",), kernel_bypass=False, zero_copy=False,
        host_copies_per_side=1, routable=True, overhead_s=10e-6, needs="any NIC and switch",
        source="IETF RFC 9293 (TCP) over the kernel's socket path: copies and protocol processing on the CPU"),
    "ib-rdma": ProtocolSpec(
        key="ib-rdma", name="RDMA over InfiniBand (verbs)", families=("infiniband",), kernel_bypass=True,
        zero_copy=True, host_copies_per_side=0, routable=False, overhead_s=1e-6,
        needs="InfiniBand NICs and switches", source="InfiniBand Architecture Specification, volume 1 (IBTA)"),
    "roce-v2": ProtocolSpec(
        key="roce-v2", name="RoCE v2 (RDMA over UDP/IP on Ethernet)", families=("ethernet",), kernel_bypass=True,
        zero_copy=True, host_copies_per_side=0, routable=True, overhead_s=2e-6,
        needs="RoCE NICs; ordinary Ethernet switches", source="IBTA InfiniBand specification, annex A17 (RoCEv2)"),
    "iwarp": ProtocolSpec(
        key="iwarp", name="iWARP (RDMA over TCP)", families=("ethernet",), kernel_bypass=True, zero_copy=True,
        host_copies_per_side=0, routable=True, overhead_s=3e-6,
        needs="iWARP NICs; ordinary Ethernet switches; memory for many TCP connections",
        source="IETF RFC 5040, 5041 and 5044 (RDMAP, DDP, MPA: iWARP)"),
    "ipoib": ProtocolSpec(
        key="ipoib", name="IP over InfiniBand (sockets on an RDMA fabric)", families=("infiniband",),
        kernel_bypass=False, zero_copy=False, host_copies_per_side=1, routable=True, overhead_s=8e-6,
        needs="InfiniBand NICs and switches", source="IETF RFC 4391 and 4392 (IP over InfiniBand: sockets unchanged)"),
}  # fmt: skip


def protocol_spec(key: str) -> ProtocolSpec:
    """The protocol called ``key`` (``"tcp-ip"``, ``"ib-rdma"``, ``"roce-v2"``, ``"iwarp"``, ``"ipoib"``)."""
    try:
        return PROTOCOLS[key]
    except KeyError:
        raise ValueError(f"unknown protocol {key!r}; known: {', '.join(PROTOCOLS)}") from None
