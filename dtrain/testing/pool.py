"""A pool of real Gloo processes, started once and given many jobs: the way multi-process tests stay quick.

Starting a process that imports torch and joins a process group costs seconds; a test suite that did it per
test would spend its time there. The pool starts ``world_size`` processes once, each joins the Gloo group
and builds subgroups of the first 2, 3, ... ranks, then runs jobs (``"module:function"`` plus arguments) on
the ranks a caller names and hands back each rank's result or traceback.

A job that fails, on any rank, or that some rank does not finish in time, leaves the group in an unknown state
(a rank still inside a collective, messages in flight that the next job would receive), so the pool reports it
and starts its processes again: one failing test costs one test, not every later one. A rank that did not
answer has its Python stack written into the report first.

The jobs travel over multiprocessing pipes between processes of this one test run on one machine; nothing
here listens on a network beyond the loopback rendezvous of torch.distributed.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver

__all__ = ["ProcessPool", "JobError", "group_of", "job_target", "world_group_size"]

_GROUPS: dict[int, object] = {}


def group_of(size: int):
    """Inside a worker: the process group of ranks 0..size-1 (the world group for the full size)."""
    return _GROUPS[size]


def world_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def job_target(job: Callable) -> str:
    """``"module:function"`` for a module-level function, which a worker process can import again."""
    module, name = getattr(job, "__module__", None), getattr(job, "__qualname__", "")
    if not callable(job) or not module or not name or "." in name or "<" in name:
        raise TypeError(f"a pool job must be a module-level function, got {job!r}")
    return f"{module}:{name}"


class JobError(RuntimeError):
    """A job raised on one or more ranks; the message holds their tracebacks."""


@dataclass(frozen=True)
class _Job:
    job_id: int
    target: str
    args: tuple
    kwargs: dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, sizes: Sequence[int], jobs, results, timeout_s: float, stacks: str, env: dict
) -> None:
    import faulthandler

    # the environment of the process that made the pool, not the fork server's (started by whichever caller
    # came first, with whatever variables that caller had set then)
    os.environ.clear()
    os.environ.update(env)

    # SIGUSR1 writes every thread's Python stack to this rank's file: what a job that did not finish was doing
    stack_file = open(stacks, "w")  # noqa: SIM115  (open for the process's life, for the signal handler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    for size in sizes:  # every rank takes part in building every subgroup, in the same order
        _GROUPS[size] = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
    results.put(("ready", rank, None))
    while True:
        job = jobs.get()
        if job is None:
            break
        try:
            module, name = job.target.split(":")
            fn = getattr(importlib.import_module(module), name)
            results.put((job.job_id, rank, ("ok", fn(*job.args, **job.kwargs))))
        except BaseException:  # noqa: BLE001  (a job's failure is reported, the worker lives on)
            results.put((job.job_id, rank, ("error", traceback.format_exc())))
    dist.destroy_process_group()
    # Every answer is handed to the pipe, then the process ends without the interpreter's teardown of torch,
    # which takes seconds a process and would run for all workers at once on the test machine's few cores.
    results.close()
    results.join_thread()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _context():
    """Processes forked from a server process that imported torch (and torch._dynamo, which torch.optim loads)
    once, each with one OpenMP thread: the imports cost seconds a process, paid once rather than per worker.
    The server starts with the first pool and serves later ones; ``OMP_NUM_THREADS`` is set for its start only,
    this process's environment is left as it was."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: torch.optim's optimizers import it when the first one is made (2-3 s of CPU a process)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
    return ctx


class ProcessPool:
    """``world_size`` processes in one Gloo group, running jobs on demand."""

    def __init__(self, world_size: int, *, sizes: Sequence[int] = (), timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.sizes = sorted({*sizes, world_size})
        self.env = dict(os.environ)  # every start of the workers, restarts too, gets this environment
        self.restarts = 0
        self._next_id = 0
        self._stack_dir = tempfile.TemporaryDirectory(prefix="dtrain-pool-")
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.sizes,
                    self._jobs[r],
                    self._results,
                    self.timeout_s,
                    self._stack_path(r),
                    self.env,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready = set()
        while len(ready) < self.world_size:
            tag, rank, _ = self._get(max(self.timeout_s * 2, 120.0), "start-up")  # forks and a rendezvous
            if tag == "ready":
                ready.add(rank)

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir.name, f"rank-{rank}.txt")

    def _get(self, timeout_s: float, what: str):
        try:
            return self._results.get(timeout=timeout_s)
        except queue.Empty:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            raise JobError(f"{what}: no answer within {timeout_s:.0f} s (dead workers: {dead})") from None

    def _stacks(self, ranks: Sequence[int]) -> str:
        """The Python stacks of ``ranks`` now (through their SIGUSR1 handler), as text."""
        for r in ranks:
            p = self._procs[r]
            if p.is_alive() and p.pid is not None:
                os.truncate(self._stack_path(r), 0)
                os.kill(p.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 3.0  # a loaded machine may take a moment to schedule them
        while time.monotonic() < deadline and not all(os.path.getsize(self._stack_path(r)) for r in ranks):
            time.sleep(0.05)
        time.sleep(0.05)  # the last lines of a stack being written
        parts = []
        for r in ranks:
            with open(self._stack_path(r)) as f:
                text = f.read().strip() or "(no stack: the process is gone)"
            parts.append(f"--- rank {r}, still running ---\n{text}")
        return "\n".join(parts)

    def restart(self) -> None:
        """End every worker, whatever it is doing, and start the group again."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for q in (*self._jobs, self._results):
            q.cancel_join_thread()
            q.close()
        self.restarts += 1
        self._start()

    def run(self, job: Callable, *args, ranks: int | Sequence[int] | None = None, **kwargs) -> list:
        """Run ``job`` (a module-level function, imported by the caller) on ``ranks`` (a count n means 0..n-1).

        The caller passes the function itself, so a renamed or moved job fails where it is imported; the
        workers import it again by its module and name. Results come back by rank.
        """
        target = job_target(job)
        if ranks is None:
            ranks = range(self.world_size)
        elif isinstance(ranks, int):
            ranks = range(ranks)
        ranks = list(ranks)
        self._next_id += 1
        message = _Job(self._next_id, target, args, kwargs)
        for r in ranks:
            self._jobs[r].put(message)
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + self.timeout_s
        stalled = ""
        while len(answers) < len(ranks):
            try:
                job_id, rank, answer = self._get(max(deadline - time.monotonic(), 0.0), target)
            except JobError as err:
                stalled = f"{err}\n" + self._stacks([r for r in ranks if r not in answers])
                break
            if job_id == message.job_id:
                answers[rank] = answer
        errors = [f"--- rank {r} ---\n{a[1]}" for r, a in sorted(answers.items()) if a[0] == "error"]
        if errors or stalled:
            self.restart()  # the group may hold a rank inside a collective, or messages the next job would take
            raise JobError(f"{target} failed:\n" + "\n".join([*errors, stalled]).strip())
        return [answers[r][1] for r in ranks]

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._stack_dir.cleanup()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
