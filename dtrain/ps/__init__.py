"""The parameter server: sharded keys, push / pull / wait, sync / quorum / async / SSP, hot-key copies,
chain and primary-backup replication with failover.

The architecture is ps-lite's (Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014): servers hold key ranges, workers push gradients and pull values; SSP is Ho et al.'s (NIPS 2013);
chain replication is van Renesse and Schneider's (OSDI 2004).

Modules: :mod:`~dtrain.ps.wire` (message format and envelope checks), :mod:`~dtrain.ps.messages` (every message
kind's schema, checked against the job), :mod:`~dtrain.ps.keys` (key ranges),
:mod:`~dtrain.ps.optimizers`, :mod:`~dtrain.ps.shard`, :mod:`~dtrain.ps.consistency`,
:mod:`~dtrain.ps.replication`, :mod:`~dtrain.ps.hotkeys`, :mod:`~dtrain.ps.server`,
:mod:`~dtrain.ps.coordinator`, :mod:`~dtrain.ps.worker`, :mod:`~dtrain.ps.launch` (roles as processes),
:mod:`~dtrain.ps.train` (training an ``nn.Module`` through it), :mod:`~dtrain.ps.data` (click-through data).
"""

from dtrain.ps.config import JobConfig
from dtrain.ps.worker import PSError, PSTimeoutError, Worker

__all__ = ["JobConfig", "PSError", "PSTimeoutError", "Worker"]
