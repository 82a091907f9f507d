"""Data paths between two GPUs: which links the bytes cross and whether they stop in host memory.

Four ways a GPU's buffer reaches another GPU (NVIDIA's GPUDirect overview and the CUDA C++ Programming
Guide, "Peer-to-Peer Memory Access"; NCCL's transports, ``NCCL_P2P_LEVEL`` and ``NCCL_SHM_DISABLE``):

- staged through host memory: the GPU copies to a pinned buffer, the CPU copies it to a second one, the other
  GPU copies it in;
- GPUDirect shared memory: both GPUs use one pinned host buffer, one copy fewer;
- GPUDirect P2P: the GPU reads or writes the other's memory over PCIe or NVLink, no host memory at all
  (zero-copy; needs NVLink or one PCIe root);
- across servers, TCP/IP copies between the application and the kernel at both ends; RDMA moves host memory
  without the CPU; GPUDirect RDMA lets the NIC read and write GPU memory directly (NVIDIA's GPUDirect RDMA
  documentation; needs the GPU and the NIC under one PCIe root).

A :class:`DataPath` is a sequence of segments: within a segment the links stream (cut-through); between two
segments the whole message lands in host memory (store and forward), and each CPU copy inside host memory is
one more pass over it. A message costs ``latency + sum(n / segment bottleneck) + copies * n / memcpy rate``:
an unpipelined bounce buffer (a pipelined one would hide part of it behind the wire).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.catalogue import LINKS, link_spec, protocol_spec

__all__ = ["Hop", "DataPath", "gpu_paths"]


@dataclass(frozen=True, kw_only=True)
class Hop:
    """``count`` links of catalogue kind ``kind`` used together (e.g. 12 NVLink 3 links of one A100)."""

    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        link_spec(self.kind)
        if self.count < 1:
            raise ValueError(f"hop over {self.kind}: count must be >= 1, got {self.count}")

    @property
    def bytes_per_s(self) -> float:
        return self.count * LINKS[self.kind].bytes_per_s


@dataclass(frozen=True, kw_only=True)
class DataPath:
    """A route from one GPU's memory to another's: segments of hops, with a stop in host memory between two."""

    name: str
    segments: tuple[tuple[Hop, ...], ...]
    host_copies: int = 0  # CPU copies inside host memory (bounce buffers, socket buffers)
    protocol: str | None = None  # catalogue protocol of the network hop, if any
    host_memory: str = "shm"  # catalogue key whose rate prices one host copy
    source: str = ""

    def __post_init__(self) -> None:
        if not self.segments or not all(self.segments):
            raise ValueError(f"path {self.name!r}: every segment needs a hop, got {self.segments!r}")
        if self.host_copies < 0 or (self.host_copies and not self.through_host_memory):
            raise ValueError(f"path {self.name!r}: {self.host_copies} host copies on a path that skips host memory")
        if self.protocol is not None:
            protocol_spec(self.protocol)
        link_spec(self.host_memory)

    @property
    def hops(self) -> tuple[Hop, ...]:
        """Every hop, in order."""
        return tuple(hop for segment in self.segments for hop in segment)

    @property
    def through_host_memory(self) -> bool:
        """Whether the bytes land in host DRAM on the way (False: GPUDirect P2P or RDMA)."""
        return len(self.segments) > 1

    @property
    def bottleneck_bytes_per_s(self) -> float:
        """The slowest hop's rate: the most the path can stream."""
        return min(hop.bytes_per_s for hop in self.hops)

    @property
    def latency_s(self) -> float:
        """Every hop's latency, plus the protocol's software overhead."""
        overhead = protocol_spec(self.protocol).overhead_s if self.protocol else 0.0
        return sum(LINKS[hop.kind].latency_s for hop in self.hops) + overhead

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes``: latency, each segment streaming at its bottleneck one after another, and
        each host copy in full."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        streams = sum(nbytes / min(hop.bytes_per_s for hop in segment) for segment in self.segments)
        return self.latency_s + streams + self.host_copies * nbytes / LINKS[self.host_memory].bytes_per_s


def gpu_paths(*, pcie: str = "pcie4x16", nvlink: str = "nvlink3", nvlinks: int = 12,
              network: str = "ib-hdr") -> dict[str, DataPath]:  # fmt: skip
    """The GPU-to-GPU paths for one server generation (defaults: an A100 server with HDR).

    Inside a server: ``staged`` (through host memory with a CPU copy), ``gpudirect-shm`` (one shared host
    buffer), ``p2p-pcie`` (GPUDirect P2P under one PCIe switch), ``p2p-nvlink`` (GPUDirect P2P through an
    NVSwitch). Across servers over ``network``: ``tcp`` (sockets, a kernel copy each end, host-staged),
    ``rdma`` (RDMA from host memory, the GPU copying in and out), ``gpudirect-rdma`` (the NIC reads and writes
    GPU memory)."""
    up, nv, wire = Hop(kind=pcie), Hop(kind=nvlink, count=nvlinks), Hop(kind=network)
    family = LINKS[network].family
    sockets = "tcp-ip" if family == "ethernet" else "ipoib"
    rdma = "roce-v2" if family == "ethernet" else "ib-rdma"
    gd = "NVIDIA GPUDirect"
    paths = [
        DataPath(name="staged", segments=((up,), (up,)), host_copies=1,
                 source="CUDA C++ Programming Guide, page-locked host memory"),
        DataPath(name="gpudirect-shm", segments=((up,), (up,)), source=f"{gd}; NCCL's SHM transport"),
        DataPath(name="p2p-pcie", segments=((up, up),), source=f"{gd} P2P; CUDA peer-to-peer memory access"),
        DataPath(name="p2p-nvlink", segments=((nv, nv),), source=f"{gd} P2P over NVLink; NVIDIA NVSwitch"),
        DataPath(name="tcp", segments=((up,), (up, wire, up), (up,)), host_copies=2, protocol=sockets,
                 source="IETF RFC 9293 (TCP) over sockets"),
        DataPath(name="rdma", segments=((up,), (up, wire, up), (up,)), protocol=rdma,
                 source="InfiniBand Architecture Specification (IBTA), RDMA"),
        DataPath(name="gpudirect-rdma", segments=((up, wire, up),), protocol=rdma, source=f"{gd} RDMA"),
    ]  # fmt: skip
    return {path.name: path for path in paths}
