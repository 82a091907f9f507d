"""Collective communication: our own algorithms, checked symbolically, priced by a cost model, run for real.

The public functions mirror torch.distributed; each takes ``algorithm=`` ("auto", "native"
or one of :func:`algorithms`). The torch-facing names load on first use, so the pure layers
(:mod:`dtrain.comm.ir`: schedules, algorithms, the checker; :mod:`dtrain.comm.cost`: the cost model and rules)
import without torch.
"""

from __future__ import annotations

import importlib

from dtrain.comm.ir.schedule import Collective, Schedule, ScheduleError, Transfer

_API = (
    "OPS",
    "SUPPORTED_DTYPES",
    "algorithms",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
    "set_local_size",
)

__all__ = [*_API, "capture", "CommTimeoutError", "Collective", "Schedule", "ScheduleError", "Transfer"]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module("dtrain.comm.api"), name)
    elif name == "capture":
        value = importlib.import_module("dtrain.comm.peer.graphs").capture
    elif name == "CommTimeoutError":
        value = importlib.import_module("dtrain.comm.p2p.runtime").CommTimeoutError
    else:
        raise AttributeError(f"module 'dtrain.comm' has no attribute {name!r}")
    globals()[name] = value  # loaded once: later lookups find it without this function
    return value
