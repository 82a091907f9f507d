"""Roles as processes: ``python -m dtrain.ps`` takes its role from the environment; :class:`LocalCluster`
starts a coordinator and servers on this machine and stops every process it started, whatever happens.

Environment of a role (ps-lite's ``DMLC_ROLE`` / ``DMLC_PS_ROOT_URI`` convention):

- ``DTRAIN_PS_ROLE``: ``coordinator``, ``server`` or ``worker``;
- ``DTRAIN_PS_COORDINATOR``: the coordinator's address, e.g. ``tcp://10.0.0.1:9100`` (the coordinator binds it;
  locally it binds a free loopback port and prints ``DTRAIN_PS_COORDINATOR=<address>`` as its first line);
- ``DTRAIN_PS_SECRET``: the shared HMAC secret, hex (for a worker, :func:`~dtrain.ps.wire.worker_key` of it,
  which lets it talk to servers and the coordinator but not sign what servers send each other; a worker given
  the secret itself works too, without that separation); ``DTRAIN_PS_RANK``: the server's or worker's rank;
- ``DTRAIN_PS_HOST``: the address a server binds (default loopback ``127.0.0.1``);
- ``DTRAIN_PS_JOB``: the coordinator's :class:`~dtrain.ps.config.JobConfig` as JSON;
- ``DTRAIN_PS_TASK``: the worker's :class:`~dtrain.ps.train.TaskConfig` as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import zmq

from dtrain.env import PS_COORDINATOR, PS_JOB, PS_RANK, PS_ROLE, PS_SECRET, PS_TASK, EnvError, PsEnv
from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.transport import Endpoint, await_message

__all__ = ["LocalCluster", "main", "request"]


def _die_with_parent() -> None:
    """In a child, before exec: ask Linux to SIGKILL it when the process that started it dies, so roles never
    outlive a launcher that was itself killed (a test runner hitting its timeout, say)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: close() still kills every process group


def main() -> int:
    """Run the role the environment names; the exit status."""
    ps = PsEnv.from_env()
    role, secret = ps.need("role"), ps.need("secret")
    if role == "coordinator":
        from dtrain.ps.coordinator import Coordinator

        address = ps.coordinator or "tcp://127.0.0.1:0"
        job = _parsed(ps.need("job"), JobConfig.from_dict, PS_JOB)
        try:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            coordinator = Coordinator(job, secret, host, int(port))
        except (ValueError, zmq.ZMQError) as exc:
            raise EnvError(f"{PS_COORDINATOR}: the coordinator cannot listen at {address!r}: {exc}") from None
        print(f"{PS_COORDINATOR}={coordinator.endpoint}", flush=True)
        coordinator.serve()
        return 0
    rank, coordinator_address = ps.need("rank"), ps.need("coordinator")
    if role == "server":
        from dtrain.ps.server import Server

        Server(coordinator_address, secret, rank, ps.host).serve()
        return 0
    from dtrain.ps.train import TaskConfig, run_task  # the one role left: PsEnv accepts no other

    return run_task(coordinator_address, secret, rank, _parsed(ps.need("task"), TaskConfig.from_dict, PS_TASK))


def _parsed(text: str, make, variable: str):
    """``make`` of the JSON object ``text`` holds; anything else is an :class:`EnvError` naming ``variable``."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return make(data)
    except (ValueError, TypeError, KeyError) as err:  # JSONDecodeError is a ValueError
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise EnvError(f"{variable}: not a valid configuration ({reason})") from None


def request(address: str, secret: bytes, header: dict, timeout_s: float = 10.0, name: str = "peer") -> wire.Message:
    """One request to a server or the coordinator (``stats``, ``dump``, ``events``, ...) and its reply."""
    ctx = zmq.Context()
    try:
        ep = Endpoint(ctx, address, secret, name)
        ep.send({"req": 1, **header})
        return await_message(ep, "reply", timeout_s)
    finally:
        ctx.destroy(linger=0)


class LocalCluster:
    """A coordinator and ``config.num_servers`` servers as processes on this machine (a context manager).

    Each process runs in its own process session (process group); :meth:`close` kills every group still alive, so no
    role outlives the cluster, also when a test fails.
    """

    def __init__(self, config: JobConfig, secret: bytes | None = None, start_timeout_s: float = 60.0) -> None:
        self.config = config
        self.secret = secret or wire.local_secret()
        self.worker_secret = wire.worker_key(self.secret)  # what its workers are given
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.coordinator = ""

    def _spawn(self, name: str, role: str, extra: dict[str, str], stdout: Any = None) -> subprocess.Popen:
        secret = self.worker_secret if role == "worker" else self.secret
        env = {**os.environ, PS_ROLE: role, PS_SECRET: secret.hex(), **extra}
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen([sys.executable, "-m", "dtrain.ps"], env=env, stdout=stdout, start_new_session=True,
                                preexec_fn=_die_with_parent)  # fmt: skip
        self.procs[name] = proc
        return proc

    def start(self) -> LocalCluster:
        job = json.dumps(self.config.to_dict())
        proc = self._spawn("coordinator", "coordinator", {PS_JOB: job}, stdout=subprocess.PIPE)
        line = proc.stdout.readline().decode().strip()
        if not line.startswith(f"{PS_COORDINATOR}="):
            self.close()
            raise RuntimeError(f"the coordinator did not start (printed {line!r}, exit status {proc.poll()})")
        self.coordinator = line.split("=", 1)[1]
        for rank in range(self.config.num_servers):
            self._spawn(f"server{rank}", "server", {PS_RANK: str(rank), PS_COORDINATOR: self.coordinator})
        return self

    def start_worker(self, rank: int, task: dict, stdout: Any = None) -> subprocess.Popen:
        """A worker process running the training task ``task`` (a :class:`~dtrain.ps.train.TaskConfig` map)."""
        extra = {
            PS_RANK: str(rank),
            PS_COORDINATOR: self.coordinator,
            PS_TASK: json.dumps(task),
        }
        return self._spawn(f"worker{rank}", "worker", extra, stdout=stdout)

    def layout(self) -> dict:
        return request(self.coordinator, self.secret, {"op": "layout?"}, name="coordinator").header["layout"]

    def server_address(self, rank: int) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            layout = self.layout()
            if layout["endpoints"][rank]:
                return layout["endpoints"][rank]
            time.sleep(0.05)
        raise TimeoutError(f"server {rank} did not register with the coordinator at {self.coordinator}")

    def ask_server(self, rank: int, header: dict, address: str | None = None) -> wire.Message:
        return request(address or self.server_address(rank), self.secret, header, name=f"server {rank}")

    def events(self) -> list[dict]:
        return request(self.coordinator, self.secret, {"op": "events"}, name="coordinator").header["events"]

    def kill(self, name: str) -> None:
        """``kill -9`` a role's process group (e.g. ``"server1"``)."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait_workers(self, timeout_s: float) -> dict[int, int]:
        """Wait for every worker process; their exit statuses. A worker still running then is killed."""
        deadline, statuses = time.monotonic() + timeout_s, {}
        for name, proc in self.procs.items():
            if name.startswith("worker"):
                try:
                    statuses[int(name[6:])] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill(name)
                    statuses[int(name[6:])] = -9
        return statuses

    def close(self) -> None:
        """Stop the coordinator (which stops the servers), give every process a moment, then kill what is left;
        also when interrupted (a second Ctrl-C) while waiting."""
        try:
            if self.coordinator and self.procs["coordinator"].poll() is None:
                with contextlib.suppress(TimeoutError, OSError):
                    request(self.coordinator, self.secret, {"op": "stop"}, timeout_s=2.0, name="coordinator")
            for name, proc in self.procs.items():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0 if name != "coordinator" else 0.5)
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                if proc.stdout:
                    proc.stdout.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
