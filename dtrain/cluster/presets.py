"""Named clusters: plain functions of their parameters, as torchtitan's presets are.

- ``dgx-a100``: 8 A100 SXM on an NVSwitch fabric (12 NVLink 3 links each, 300 GB/s a direction), four PCIe 4.0
  switches each holding 2 GPUs and 2 HDR NICs (8 x 200 Gb/s), two CPUs. The real DGX A100 has AMD EPYC CPUs
  on Infinity Fabric, which the catalogue lacks; UPI stands in (it carries no GPU traffic here).
- ``h100-node``: 8 H100 SXM on NVSwitch gen 3 (18 NVLink 4 links each, 450 GB/s a direction), PCIe 5.0, 8 NDR
  NICs (400 Gb/s), two CPUs on UPI 2.0: the DGX/HGX H100 layout.
- ``h200-4gpu``: 4 H200 on an NVSwitch fabric (18 NVLink 4 links each, 450 GB/s a direction), one PCIe 5.0
  switch a GPU, one 100 Gb/s Ethernet NIC: a node like the project's 4 x H200 test machine. NVSwitch, not the
  HGX 4-GPU board's direct NVLink (6 links, 150 GB/s a direction, to each peer): that machine moved 256 MiB to
  one peer at about 300 GB/s (benchmarks/results/probe-p2p-h200x4.txt, "pg coalesced ring step"), twice what a
  6-link pair can carry. Its NIC is a placeholder (inter-node traffic was never measured there).
- ``h100-rail``: scalable units (``racks``) of 32 ``h100-node`` servers on a rail-optimised fabric, NIC ``k`` of
  every server on rail leaf ``k`` of its unit, every leaf under 16 spines, GPU ``k`` sending through NIC ``k``
  (the DGX SuperPOD H100 compute fabric; grow it with ``racks=``).
- ``4-rack``: 4 racks of 4 ``dgx-a100`` servers (128 GPUs) under 2 spines at 1:4 oversubscription (within the
  2.5:1 to 8:1 that Al-Fares et al., SIGCOMM 2008, report for typical data-centre designs).
- ``dgx-a100-superpod``: a DGX A100 SuperPOD-like compute fabric (NVIDIA, "NVIDIA DGX SuperPOD: Scalable
  Infrastructure for AI Leadership, DGX A100 System Reference Architecture", RA-09950-001, 2020): scalable
  units (``racks``) of 20 ``dgx-a100`` servers, each server's 8 HDR 200 Gb/s NICs on 8 rail leaves of its unit,
  three non-blocking tiers (leaf, spine, core) of a fat-tree. 4 units (640 GPUs) in 2 pods of 8 spines under
  16 cores; the reference architecture's 140-server system is ``racks=7, pods=7``. Its switch counts per tier
  are this builder's, not the document's cabling plan.
- ``fat-tree-k8``: the k = 8 fat-tree of Al-Fares et al. (SIGCOMM 2008): 8 pods, 128 single-A100 servers with
  one HDR NIC each, 32 edge, 32 aggregation and 16 core switches, 1:1.

Every server with one NIC per GPU sends GPU ``k``'s traffic through NIC ``k`` (``nic_affinity="rail"``), as NCCL
picks the NIC nearest each GPU. The two SuperPOD fabrics (``h100-rail``, ``dgx-a100-superpod``) are InfiniBand
under a subnet manager's fat-tree routing (``routing="d-mod-k"``: every flow to one destination port over one
path, :mod:`dtrain.cluster.routing`); ``4-rack`` and ``fat-tree-k8`` hash flows over their equal-cost paths
(``routing="ecmp"``), as an Ethernet/RoCE fabric does.

Every preset takes the parameters of :class:`ClusterSpec` and :class:`ServerSpec` as overrides
(``gpus_per_server`` is ``gpus``): ``preset("4-rack", racks=2, oversubscription=16)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dtrain.cluster.builders import ClusterSpec, ServerSpec, build, fat_tree
from dtrain.cluster.topology import Topology

__all__ = ["PRESETS", "preset", "preset_spec", "preset_names", "with_overrides", "PARAMETERS"]

DGX_A100 = ServerSpec(gpus=8, device="a100-sxm", intra="nvswitch", gpus_per_pcie_switch=2, cpus=2, cpu_link="upi",
                      nics=8, nic="ib-hdr")  # fmt: skip
H100_NODE = ServerSpec(gpus=8, device="h100-sxm", intra="nvswitch", gpus_per_pcie_switch=2, cpus=2, cpu_link="upi2",
                       nics=8, nic="ib-ndr")  # fmt: skip
H200_4GPU = ServerSpec(gpus=4, device="h200-sxm", intra="nvswitch", gpus_per_pcie_switch=1, cpus=2,
                       cpu_link="upi2", nics=1, nic="ethernet100")  # fmt: skip

#: name -> (one-line description, the cluster it builds before overrides)
PRESETS: dict[str, tuple[str, Callable[[], ClusterSpec]]] = {
    "dgx-a100": ("8 A100 on NVSwitch, PCIe 4.0, 8 x HDR 200 Gb/s NICs", lambda: ClusterSpec(server=DGX_A100)),
    "h100-node": ("8 H100 on NVSwitch (NVLink 4), PCIe 5.0, 8 x NDR 400 Gb/s NICs",
                  lambda: ClusterSpec(server=H100_NODE)),
    "h200-4gpu": ("4 H200 on NVSwitch (NVLink 4), one 100 GbE NIC", lambda: ClusterSpec(server=H200_4GPU)),
    "4-rack": ("4 racks x 4 dgx-a100 servers, 2 spines, 1:4 oversubscribed",
               lambda: ClusterSpec(server=DGX_A100, racks=4, servers_per_rack=4, spines=2, oversubscription=4)),
    "h100-rail": ("2 scalable units x 32 h100-node servers (512 GPUs), rail-optimised, 16 spines, NIC k for GPU k",
                  lambda: ClusterSpec(server=H100_NODE, racks=2, servers_per_rack=32, spines=16, fabric="rail",
                                      nic_affinity="rail", routing="d-mod-k")),
    "dgx-a100-superpod": ("4 units x 20 dgx-a100 (640 GPUs), 8 HDR rails a unit, leaf/spine/core fat-tree, 1:1",
                          lambda: ClusterSpec(server=DGX_A100, racks=4, servers_per_rack=20, fabric="fat-tree",
                                              rails=True, pods=2, spines=8, cores=16, routing="d-mod-k")),
    "fat-tree-k8": ("k=8 fat-tree: 8 pods, 128 servers of one A100 and one HDR NIC, 80 switches, 1:1",
                    lambda: fat_tree(8)),
}  # fmt: skip

_SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerSpec)}
_CLUSTER_FIELDS = {f.name for f in dataclasses.fields(ClusterSpec)} - {"server"}
_ALIASES = {"gpus_per_server": "gpus"}
#: Every parameter a preset (or a builder spec in a topology file) accepts.
PARAMETERS = tuple(sorted(_SERVER_FIELDS | _CLUSTER_FIELDS | set(_ALIASES)))


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_spec(name: str, **overrides: Any) -> ClusterSpec:
    """The :class:`ClusterSpec` of preset ``name`` with ``overrides`` applied (server or cluster fields)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return with_overrides(PRESETS[name][1](), what=f"preset {name!r}", **overrides)


def with_overrides(spec: ClusterSpec, *, what: str = "cluster", **overrides: Any) -> ClusterSpec:
    """``spec`` with server or cluster fields replaced (``gpus_per_server`` is ``gpus``)."""
    server_changes, cluster_changes = {}, {}
    for key, value in overrides.items():
        field = _ALIASES.get(key, key)
        if field in _SERVER_FIELDS:
            server_changes[field] = value
        elif field in _CLUSTER_FIELDS:
            cluster_changes[field] = value
        else:
            raise ValueError(f"{what}: unknown parameter {key!r}; known: {', '.join(PARAMETERS)}")
    server = dataclasses.replace(spec.server, **server_changes)
    return dataclasses.replace(spec, server=server, **cluster_changes)


def preset(name: str, **overrides: Any) -> Topology:
    """Build preset ``name`` (see the module docstring) with ``overrides``."""
    return build(preset_spec(name, **overrides), name=name)
