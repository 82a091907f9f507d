"""An emulated cluster on one Linux host: network namespaces as servers, bridges as switches (or, with
``fabric="routed"``, router namespaces with per-flow ECMP), tc-shaped veths as links, built from a
:class:`~dtrain.cluster.topology.Topology` (see docs/emulation.md). Needs root.

Names resolve lazily, so the small processes the emulator starts inside namespaces (``python -m
dtrain.emulate.probe``, ``-m dtrain.emulate.rank``) do not pay for networkx.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Emulation", "EmulationPlan", "JobConfig", "PREFIX", "build", "plan_emulation", "run_job", "teardown",
    "teardown_leftovers",
]  # fmt: skip

_HOME = {
    "Emulation": "build", "build": "build", "teardown": "build", "teardown_leftovers": "build",
    "EmulationPlan": "plan", "PREFIX": "plan", "plan_emulation": "plan", "JobConfig": "run", "run_job": "run",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'dtrain.emulate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dtrain.emulate.{_HOME[name]}"), name)
