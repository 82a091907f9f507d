"""The parameter server: sharded keys, push / pull / wait, sync / quorum / async / SSP, hot-key copies,
chain and primary-backup replication with failover (DESIGN.md; seed 001's parameter-server section).

Modules: :mod:`~dtrain.ps.wire` (message format and checks), :mod:`~dtrain.ps.keys` (key ranges),
:mod:`~dtrain.ps.optimizers`, :mod:`~dtrain.ps.shard`, :mod:`~dtrain.ps.consistency`,
:mod:`~dtrain.ps.replication`, :mod:`~dtrain.ps.hotkeys`, :mod:`~dtrain.ps.server`,
:mod:`~dtrain.ps.coordinator`, :mod:`~dtrain.ps.worker`, :mod:`~dtrain.ps.launch` (roles as processes),
:mod:`~dtrain.ps.train` (training an ``nn.Module`` through it), :mod:`~dtrain.ps.data` (click-through data).
"""

from dtrain.ps.config import JobConfig
from dtrain.ps.worker import PSError, PSTimeoutError, Worker

__all__ = ["JobConfig", "PSError", "PSTimeoutError", "Worker"]
