"""Hardware as data: devices, links, topologies and routing (no torch: the simulator and the planner run without it).

- :mod:`~dtrain.cluster.topology`: the graph of devices, hosts, NICs and switches, routing with ECMP;
- :mod:`~dtrain.cluster.catalogue`, :mod:`~dtrain.cluster.devices`, :mod:`~dtrain.cluster.paths`: the link
  catalogue, accelerator specs and GPUDirect data paths, each figure with its source;
- :mod:`~dtrain.cluster.builders`, :mod:`~dtrain.cluster.presets`: servers, racks, leaf-spine trees;
- :mod:`~dtrain.cluster.files`: TOML topology files; :mod:`~dtrain.cluster.draw`: PNG drawings;
- :mod:`~dtrain.cluster.calc`: back-of-the-envelope bandwidth arithmetic (``dtrain calc``).
"""

from dtrain.cluster.builders import ClusterSpec, ServerSpec, build, build_server
from dtrain.cluster.catalogue import LINKS, link_spec
from dtrain.cluster.files import load, save
from dtrain.cluster.presets import PRESETS, preset
from dtrain.cluster.topology import Device, Link, Topology

__all__ = [
    "Device",
    "Link",
    "Topology",
    "LINKS",
    "link_spec",
    "ServerSpec",
    "ClusterSpec",
    "build",
    "build_server",
    "PRESETS",
    "preset",
    "load",
    "save",
]
