"""Simulation of collectives and training steps on a cluster topology (no torch; DESIGN.md layers).

- :mod:`dtrain.sim.flows`: flow-level network, max-min fair sharing of links, event-driven;
- :mod:`dtrain.sim.collective`: a ``dtrain.comm`` schedule replayed rank by rank on a placement;
"""

from dtrain.sim.collective import CollectiveResult, SoftwareCost, replay
from dtrain.sim.flows import FlowNetwork, FlowSpec, LinkUsage, max_min_rates, simulate_flows

__all__ = [
    "CollectiveResult",
    "FlowNetwork",
    "FlowSpec",
    "LinkUsage",
    "SoftwareCost",
    "max_min_rates",
    "replay",
    "simulate_flows",
]
