"""The fork server :func:`dtrain.launch.run_ranks` starts its local workers from, with no torch import here.

A worker forked from a server that has already imported torch, torch.distributed and torch._dynamo (which the
first optimizer step imports) starts without importing them itself: 5-6 s of CPU a worker on a 2-core machine.
:func:`start_fork_server` starts that server; ``dtrain train`` calls it as soon as its flags are checked, so that
the server imports torch while the launching process imports it too, on another core.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

__all__ = ["PRELOAD", "start_fork_server"]

#: What the workers' fork server imports before it forks any: the first ends the server quietly on a Ctrl-C during
#: the imports (:mod:`dtrain.forkserver_start`); the last gives SIGINT back to Python and makes the server end
#: without the interpreter's teardown of the others (:mod:`dtrain.forkserver_exit`).
PRELOAD = ("dtrain.forkserver_start", "torch", "torch.distributed", "torch._dynamo", "dtrain.forkserver_exit")


def start_fork_server(nproc: int) -> None:
    """Start this process's fork server for ``nproc`` workers, preloading :data:`PRELOAD` (once; a later call
    finds it running). With more than one worker, OpenMP gets one thread a process first, as torchrun does: the
    server's environment is its children's. The server starts with SIGINT blocked, which its first preloaded
    module unblocks once its quiet handler is in place; a Ctrl-C meanwhile reaches this process when the call
    returns."""
    if nproc > 1:
        # N processes each running a full OpenMP pool oversubscribe the cores, and the pools' spin-waits then
        # stall every rank's reductions (measured: 1 MiB all-reduce on 4 ranks of a 2-core machine 7x slower)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # the server starts it first, and unblocks SIGINT after it
    masked = hasattr(signal, "pthread_sigmask")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if masked else set()
    try:
        forkserver.ensure_running()
    finally:
        if masked and signal.SIGINT not in blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
