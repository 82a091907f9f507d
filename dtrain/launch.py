"""Start N local ranks through torch's own launcher, or join the job torchrun already started.

``run_ranks(fn, nproc, *args)`` calls ``fn(*args)`` on every rank with the default process group initialized
(Gloo on CPU, NCCL with each rank on cuda:LOCAL_RANK when GPUs are there) and returns rank 0's result. Under
torchrun (RANK and WORLD_SIZE set) it runs ``fn`` in this process; otherwise it starts ``nproc`` processes
with ``torch.distributed.launcher.api.elastic_launch`` and a c10d rendezvous on loopback. No home-made
launcher.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["under_torchrun", "run_ranks", "init_rank", "rank_device"]


def under_torchrun() -> bool:
    """True when a launcher already set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_rank() -> bool:
    """Initialize the default process group from the environment; True if this call created it."""
    if dist.is_initialized():
        return False
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], *args: Any) -> Any:
    """What every launched rank runs: set up the group, call ``fn``, tear the group down."""
    created = init_rank()
    try:
        return fn(*args)
    finally:
        if created:
            from dtrain.comm.peer import window as peer

            peer.close_windows()  # the peer transport's windows and the graphs recorded on them go first
            gc.collect()  # CUDA graphs still holding NCCL kernels would stall the teardown
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> Any:
    """Run ``fn(*args)`` on every rank (see the module docstring); rank 0's return value."""
    if under_torchrun():
        return _rank_main(fn, *args)
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc > 1:
        # As torchrun does: N processes each running a full OpenMP pool oversubscribe the cores, and the
        # pools' spin-waits then stall every rank's reductions (measured: 1 MiB all-reduce on 4 ranks of a
        # 2-core machine 7x slower).
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        run_id=f"dtrain-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
    )
    # the agent's warnings (workers shut down on Ctrl-C, ...) repeat what the caller reports in one line
    for name in list(logging.root.manager.loggerDict):  # each module's logger has its own level set
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    results = elastic_launch(config, _rank_main)(fn, *args)
    return results[0]
