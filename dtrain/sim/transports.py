"""The three ways NCCL moves bytes between the GPUs of one server, as topologies the simulator runs on.

NCCL's transports inside a server are NVLink (P2P), host shared memory (SHM) and TCP/IP sockets (NET); NCCL
picks among them per GPU pair and can be told not to use the faster ones (NCCL documentation, environment
variables: ``NCCL_P2P_DISABLE=1``: no GPU-to-GPU copies, so host shared memory; ``NCCL_SHM_DISABLE=1`` as well:
the network transport, sockets over the loopback). Each is a graph of rated links
(:mod:`dtrain.cluster.topology`) with catalogue figures (:mod:`dtrain.cluster.catalogue`):

- ``nvlink``: each GPU joined to an NVSwitch by its NVLink 4 links (18 x 25 GB/s a direction, 0.5 us a hop):
  GPUDirect P2P, the bytes never touch host memory (CUDA C++ Programming Guide, peer-to-peer memory access);
- ``shm``: GPU -> PCIe 5.0 x16 -> host memory -> PCIe 5.0 x16 -> GPU. The sender's kernel writes a buffer
  in pinned host memory and the receiver's reads it (NCCL's SHM transport), so every byte crosses host DRAM
  twice. All four GPUs share that DRAM: one ``host memory`` link at ``memory / 2`` carries every pair's
  bytes (DDR5-4800 x 8 channels, one socket: 307.2 GB/s);
- ``socket``: the same PCIe hops, but between them the bytes go through a loopback TCP connection: the GPU
  stages them in host memory, the sending proxy thread's ``send()`` copies them into the kernel's socket
  buffers, the receiving proxy's ``recv()`` copies them out, and the receiving GPU reads them: six passes
  over DRAM (the link runs at ``memory / 6``), plus TCP/IP's software overhead on the hop.

What the catalogue cannot say is how fast one connection goes: a GPU reading host memory over PCIe, or one
proxy thread copying through a TCP socket, is limited by outstanding requests and one CPU core, not by the
wires. That is ``connection_bytes_per_s``, a cap on each flow, fitted to measurements
(benchmarks/sim/validate.py transports); ``memory_bytes_per_s`` may be fitted too (what DRAM really delivers).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.catalogue import LINKS, protocol_spec
from dtrain.cluster.topology import Device, Topology

__all__ = ["TRANSPORTS", "MEMORY_PASSES", "Transport", "transport_node"]

#: The transports, fastest first, with the NCCL setting that selects each on an NVLink machine.
TRANSPORTS = {"nvlink": "(default)", "shm": "NCCL_P2P_DISABLE=1", "socket": "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"}
#: Times each byte crosses host DRAM on its way from one GPU to another.
MEMORY_PASSES = {"nvlink": 0, "shm": 2, "socket": 6}

_H200 = {"peak_flops": 989e12, "memory_bytes": 141 * 10**9, "memory_bytes_per_s": LINKS["hbm3e-h200"].bytes_per_s}


@dataclass(frozen=True, kw_only=True)
class Transport:
    """One transport's figures: ``nvlink_bytes_per_s`` a GPU's NVLink rate (default 18 NVLink 4 links),
    ``pcie`` the GPU's slot, ``memory_bytes_per_s`` host DRAM (default DDR5-4800 x 8), and
    ``connection_bytes_per_s`` the most one point-to-point connection moves (dtrain's messages: NCCL send /
    recv), ``kernel_connection_bytes_per_s`` the most one connection of NCCL's own collective kernel moves, all
    its channels together (None: as a point-to-point one). NCCL gives the two different numbers of channels,
    hence of sockets or of SMs polling host memory."""

    name: str
    nvlink_bytes_per_s: float = 18 * LINKS["nvlink4"].bytes_per_s
    pcie: str = "pcie5x16"
    memory_bytes_per_s: float = LINKS["ddr5-4800x8"].bytes_per_s
    connection_bytes_per_s: float | None = None
    kernel_connection_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.name not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.name!r}; known: {', '.join(TRANSPORTS)}")
        if self.pcie not in LINKS or LINKS[self.pcie].family != "pcie":
            raise ValueError(f"transport {self.name!r}: pcie must be a PCIe link of the catalogue, got {self.pcie!r}")
        for field in ("nvlink_bytes_per_s", "memory_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"transport {self.name!r}: {field} must be > 0, got {getattr(self, field)!r}")
        for field in ("connection_bytes_per_s", "kernel_connection_bytes_per_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"transport {self.name!r}: {field} must be > 0 or None, got {value!r}")

    @property
    def kernel_cap(self) -> float | None:
        """One connection's cap in NCCL's collective kernels."""
        if self.kernel_connection_bytes_per_s is not None:
            return self.kernel_connection_bytes_per_s
        return self.connection_bytes_per_s

    @property
    def host_bytes_per_s(self) -> float | None:
        """The rate of the shared host-memory hop (None for NVLink, which skips host memory)."""
        passes = MEMORY_PASSES[self.name]
        return self.memory_bytes_per_s / passes if passes else None

    def topology(self, gpus: int = 4) -> Topology:
        """A server of ``gpus`` H200s whose GPU-to-GPU paths are this transport's."""
        return transport_node(self, gpus)


def transport_node(transport: Transport, gpus: int = 4) -> Topology:
    """See :class:`Transport.topology`."""
    if gpus < 2:
        raise ValueError(f"a transport node needs at least 2 GPUs, got {gpus}")
    topo = Topology(f"h200x{gpus}-{transport.name}")
    for i in range(gpus):
        topo.add_device(Device(name=f"n0/gpu{i}", server="n0", **_H200))
    if transport.name == "nvlink":
        topo.add_node("n0/nvswitch", kind="nvswitch", server="n0")
        latency = LINKS["nvlink4"].latency_s
        for i in range(gpus):
            topo.add_link(f"n0/gpu{i}", "n0/nvswitch", bytes_per_s=transport.nvlink_bytes_per_s,
                          latency_s=latency, kind="nvlink4")  # fmt: skip
        return topo
    # host memory as a one-way hop between a PCIe root (in) and the memory's far side (out): every GPU's
    # upstream PCIe link enters it, every GPU's downstream one leaves it, so all pairs share it
    topo.add_node("n0/root", kind="cpu", server="n0")
    topo.add_node("n0/memory", kind="host", server="n0")
    pcie = LINKS[transport.pcie]
    hop_latency = LINKS["ddr5-4800x8"].latency_s
    if transport.name == "socket":
        hop_latency += 2 * protocol_spec("tcp-ip").overhead_s  # the sending and the receiving stack
    topo.add_link("n0/root", "n0/memory", bytes_per_s=transport.host_bytes_per_s, latency_s=hop_latency,
                  kind="ddr5-4800x8", duplex=False)  # fmt: skip
    for i in range(gpus):
        gpu = f"n0/gpu{i}"
        topo.add_link(gpu, "n0/root", bytes_per_s=pcie.bytes_per_s, latency_s=pcie.latency_s, kind=pcie.key,
                      duplex=False)  # fmt: skip
        topo.add_link("n0/memory", gpu, bytes_per_s=pcie.bytes_per_s, latency_s=pcie.latency_s, kind=pcie.key,
                      duplex=False)  # fmt: skip
    return topo
