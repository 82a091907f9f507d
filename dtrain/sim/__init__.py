"""Simulation of collectives and training steps on a cluster topology (no torch: it runs on any machine).

- :mod:`dtrain.sim.flows`: flow-level network, max-min fair sharing of links, event-driven;
- :mod:`dtrain.sim.collective`: a ``dtrain.comm`` schedule replayed rank by rank on a placement;
- :mod:`dtrain.sim.api_passes`: the public API's own copies and clones around a schedule, per collective;
- :mod:`dtrain.sim.peer_model`: a schedule on the peer-memory transport, priced from its compiled plan;
- :mod:`dtrain.sim.api`: one call from (topology, collective, algorithm, bytes) to time and bottleneck;
- :mod:`dtrain.sim.fit`: the simulator's software costs and link rate fitted to measurements;
- :mod:`dtrain.sim.nccl`: NCCL's own collectives (``native``): one kernel, a pipelined ring over channels;
- :mod:`dtrain.sim.nccl_fit`: that model's figures fitted to measured calls;
- :mod:`dtrain.sim.transports`: NVLink, host shared memory and sockets between a server's GPUs, as topologies;
- :mod:`dtrain.sim.model`: a transformer's FLOPs and memory per device under a ``dp x tp x pp`` layout;
- :mod:`dtrain.sim.placement`: rank placements: dtrain train's two rank orders (its own, Megatron-LM's), oblivious;
- :mod:`dtrain.sim.pipeline`: a pipeline step's timing from its GPipe / 1F1B order;
- :mod:`dtrain.sim.traffic`: each strategy's collectives on the placement, every group at once;
- :mod:`dtrain.sim.ps`: one parameter-server step (pushes, chain replication, hot-row copies, pulls);
- :mod:`dtrain.sim.step`: a whole training step (compute, each strategy's communication, stragglers);
- :mod:`dtrain.sim.planner`: layouts and placements ranked by simulated step time.
"""

from dtrain.sim.api import simulate_collective
from dtrain.sim.collective import CollectiveResult, Job, SoftwareCost, replay, replay_concurrent
from dtrain.sim.flows import FlowNetwork, FlowSpec, LinkUsage, max_min_rates, simulate_flows
from dtrain.sim.model import MODELS, Layout, ModelSpec, memory_per_device
from dtrain.sim.nccl import NcclParams, NcclResult, simulate_nccl
from dtrain.sim.placement import place
from dtrain.sim.ps import PSResult, PSStep, ServerLoad, simulate_ps
from dtrain.sim.step import StepConfig, StepResult, simulate_step
from dtrain.sim.transports import Transport

__all__ = [
    "CollectiveResult",
    "FlowNetwork",
    "FlowSpec",
    "Job",
    "Layout",
    "LinkUsage",
    "MODELS",
    "ModelSpec",
    "NcclParams",
    "NcclResult",
    "PSResult",
    "PSStep",
    "ServerLoad",
    "SoftwareCost",
    "StepConfig",
    "StepResult",
    "Transport",
    "max_min_rates",
    "memory_per_device",
    "place",
    "replay",
    "replay_concurrent",
    "simulate_collective",
    "simulate_flows",
    "simulate_nccl",
    "simulate_ps",
    "simulate_step",
]
