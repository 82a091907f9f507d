"""Run a dtrain command across an emulated cluster: one torchrun per server namespace, c10d rendezvous.

Every server namespace starts ``torchrun --nnodes N --node-rank i --nproc-per-node k --rdzv-backend c10d
--rdzv-endpoint <node 0's address>:<port> --local-addr <its address> -m dtrain.emulate.rank <args>`` with
``GLOO_SOCKET_IFNAME`` set to its one interface, so every byte between servers crosses the shaped veths.
Node 0 prints to this terminal, the others to ``<log_dir>/<server>.log``. The first node to fail (or the time
limit) stops all of them, and the error names the node and the tail of its log.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.emulate.build import SERVER_INTERFACE
from dtrain.emulate.netns import EmulationError, in_ns
from dtrain.emulate.plan import EmulationPlan
from dtrain.emulate.rank import LOCAL_SIZE_ENV, NODE_RANK_ENV

__all__ = ["JobConfig", "run_job", "torchrun_argv"]


@dataclass(kw_only=True)
class JobConfig:
    """A dtrain command line (``command``, the words after ``dtrain``) and how to spread it over the servers."""

    command: list[str]
    script: str | None = None  # a Python file to run instead of dtrain (``command`` are then its arguments)
    procs_per_server: int = 1
    local_size: int | None = None  # ranks per hierarchy "node" for hierarchical algorithms (None: one server)
    port: int = 29500
    timeout_s: float = 900.0
    join_timeout_s: float = 60.0
    log_dir: Path = field(default_factory=lambda: Path("runs/emulate"))

    def __post_init__(self) -> None:
        if not self.command and self.script is None:
            raise ValueError("no dtrain command to run; give one after --, e.g. -- bench comm --collectives all_reduce")
        if self.script is None and self.command[0] in ("dtrain", "-m"):
            raise ValueError(f"give the words after 'dtrain' (e.g. 'bench comm ...'), got {self.command[:2]}")
        if self.procs_per_server < 1:
            raise ValueError(f"procs_per_server must be >= 1, got {self.procs_per_server}")
        if self.local_size is not None and self.local_size < 1:
            raise ValueError(f"local_size must be >= 1 or None, got {self.local_size}")
        if not 1024 <= self.port < 65536:
            raise ValueError(f"port must be in [1024, 65536), got {self.port}")
        for name in ("timeout_s", "join_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")


def torchrun_argv(plan: EmulationPlan, job: JobConfig, node: int) -> list[str]:
    """The torchrun command line of server ``node`` (run inside its namespace). ``is_host`` says who hosts the
    rendezvous store: torch guesses it from the host name, which inside a namespace names the host's address."""
    server = plan.servers[node]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(len(plan.servers)), "--node-rank", str(node),
        "--nproc-per-node", str(job.procs_per_server),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{plan.servers[0].ip}:{job.port}",
        "--rdzv-id", f"dtrain-emulate-{plan.tag}",
        "--rdzv-conf", f"join_timeout={int(job.join_timeout_s)},is_host={int(node == 0)}",
        "--local-addr", server.ip, "--max-restarts", "0", "--monitor-interval", "0.2",
        *(["-m", "dtrain.emulate.rank"] if job.script is None else [job.script]), *job.command,
    ]  # fmt: skip


def _environment(plan: EmulationPlan, job: JobConfig, node: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=SERVER_INTERFACE, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env[NODE_RANK_ENV] = str(node)
    if job.local_size is not None:
        env[LOCAL_SIZE_ENV] = str(job.local_size)
    return env


def run_job(plan: EmulationPlan, job: JobConfig) -> int:
    """Run ``job`` on every server of the built ``plan``; 0 when all succeed, else the first failure's status."""
    job.log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as logs:
        try:
            for node in range(len(plan.servers)):
                procs.append(_start(plan, job, node, logs))
            return _wait(plan, job, procs)
        finally:
            _stop(procs)


def _log_path(job: JobConfig, plan: EmulationPlan, node: int) -> Path:
    return job.log_dir / f"{plan.servers[node].server.replace('/', '_')}.log"


def _start(plan: EmulationPlan, job: JobConfig, node: int, logs: contextlib.ExitStack) -> subprocess.Popen:
    """Server ``node``'s torchrun in its namespace, in a process session of its own (setsid:
    stopped as a group); node 0 writes to this terminal, the others to their log file."""
    log = None if node == 0 else logs.enter_context(_log_path(job, plan, node).open("w"))
    argv = in_ns(plan.servers[node].namespace, torchrun_argv(plan, job, node))
    return subprocess.Popen(
        argv, env=_environment(plan, job, node), stdout=log, stderr=subprocess.STDOUT if log else None,
        start_new_session=True,
    )  # fmt: skip


def _wait(plan: EmulationPlan, job: JobConfig, procs: list[subprocess.Popen]) -> int:
    deadline = time.monotonic() + job.timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            node = failed[0]
            print(f"dtrain emulate: node {node} ({plan.servers[node].server}) exited with {codes[node]}"
                  f"{_tail(job, plan, node)}", file=sys.stderr)  # fmt: skip
            return codes[node]
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            waiting = [plan.servers[i].server for i, c in enumerate(codes) if c is None]
            raise EmulationError(f"job still running after {job.timeout_s} s on servers {waiting}; stopped them")
        time.sleep(0.1)


def _tail(job: JobConfig, plan: EmulationPlan, node: int) -> str:
    if node == 0:
        return ""
    path = _log_path(job, plan, node)
    text = path.read_text(errors="replace")[-2000:] if path.exists() else ""
    return f"; the end of {path}:\n{text}"


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each torchrun's process group (its workers too), SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
    for p in procs:
        p.wait()
