"""Collective communication: our own algorithms, checked symbolically, priced by a cost model, run for real.

The public functions mirror torch.distributed (see DESIGN.md); each takes ``algorithm=`` ("auto", "native"
or one of :func:`algorithms`). The torch-facing names load on first use, so the pure parts (``schedule``,
``algorithms``, ``check``, ``cost``) import without torch.
"""

from __future__ import annotations

import importlib

from dtrain.comm.schedule import Collective, Schedule, ScheduleError, Transfer

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
        return getattr(importlib.import_module("dtrain.comm.api"), name)
    if name == "capture":
        return importlib.import_module("dtrain.comm.graph").capture
    if name == "CommTimeoutError":
        return importlib.import_module("dtrain.comm.runtime").CommTimeoutError
    raise AttributeError(f"module 'dtrain.comm' has no attribute {name!r}")
