"""Start N local ranks through torch's own launcher, or join the job torchrun already started.

``run_ranks(fn, nproc, *args)`` calls ``fn(*args)`` on every rank with the default process group initialized
(Gloo on CPU, NCCL with each rank on cuda:LOCAL_RANK when GPUs are there) and returns rank 0's result. Under
torchrun (RANK and WORLD_SIZE set) it runs ``fn`` in this process; otherwise it starts ``nproc`` processes
with ``torch.distributed.launcher.api.elastic_launch`` and a c10d rendezvous on loopback. No home-made
launcher.

Failures, as torchelastic defines them (https://pytorch.org/docs/stable/elastic/agent.html): the agent watches
its workers every ``monitor_interval`` seconds, and when one fails it stops the others and starts them all
again, up to ``max_restarts`` times; a worker sees ``TORCHELASTIC_RESTART_COUNT`` (:func:`restart_count`), so
``fn`` can continue from its last checkpoint. While ``fn`` runs, every rank beats in the job's store
(:class:`dtrain.comm.peer.watchdog.Heartbeat`); a rank whose collective fails because a peer died logs one line
naming that peer (rank, host and pid). A ``ValueError`` is bad input, which no restart mends: the rank that
raises it records it in the store; a rank whose collective fails meanwhile ends with it too (no restart), every
rank of a later attempt stops with it at once, and the launching process raises it (one line) instead of using
up the restarts.

Workers start from a fork server that has imported torch, torch.distributed and torch._dynamo (which the first
optimizer step imports) once, rather than each importing them anew (``start_method="forkserver"``,
:mod:`dtrain.workers`; 5-6 s of CPU a worker on a 2-core machine). A fork server's children inherit its
environment, not the launcher's at the call, so each worker takes the launcher's environment from the call's
arguments, with the agent's own variables (RANK, MASTER_ADDR, TORCHELASTIC_*, ...) over it, as a spawned worker
would have them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain import env
from dtrain.env import under_torchrun
from dtrain.interrupts import raise_noted_interrupt
from dtrain.workers import start_fork_server

__all__ = [
    "KILL_ENV",
    "OUT_OF_MEMORY",
    "HOST_OUT_OF_MEMORY",
    "init_rank",
    "last_saved_step",
    "mark_saved",
    "maybe_kill",
    "out_of_memory_line",
    "rank_device",
    "restart_count",
    "run_ranks",
    "under_torchrun",
]

#: Fault injection for resilience tests (:func:`dtrain.env.kill_at`): ``RANK:STEP`` makes that rank kill itself
#: with SIGKILL when :func:`maybe_kill` is called at that step, in the first attempt only; ``RANK:STEP:node`` kills
#: the elastic agent that started it first (its parent process: torchrun's agent, or :func:`run_ranks`' launching
#: process), as a node that goes down with all its workers; ``:+SECONDS`` after either waits that long first.
KILL_ENV = env.KILL_AT
_RUN_PREFIX = "dtrain-launch-"  # the run id of run_ranks' own launches


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def maybe_kill(step: int) -> None:
    """Kill this process with SIGKILL if :data:`KILL_ENV` names this rank and ``step`` (first attempt only); with
    ``:node``, its agent first; with ``:+SECONDS``, that long into the step."""
    target = env.kill_at()
    if target is None or restart_count() > 0:
        return
    if target == (dist.get_rank(), step):
        delay = env.kill_delay()
        if delay:  # its peers go on into the step and wait for it in the step's collectives
            time.sleep(delay)
        sys.stdout.flush()
        sys.stderr.flush()
        if env.kill_node():  # the agent first, so that it cannot restart this node's workers
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


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
    kwargs: dict[str, Any] = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives the workers, and so do the keys a group's setup leaves there: a restarted
        # worker could read an address its dead predecessor published (pytorch/pytorch#135712). Each attempt
        # sets its groups up under a prefix of its own.
        root = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        kwargs = {
            "store": dist.PrefixStore(f"dtrain/attempt-{restart_count()}/", root),
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
        }
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _BadInput:
    """What a launched rank returns instead of raising a ``ValueError``: the agent then does not restart it."""

    message: str


def _root_store():
    """The job's store without the prefixes torch puts on the default group's (the agent's store under
    torchelastic: it outlives the workers)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


_FATAL_KEY = "dtrain/bad-input"
_SAVED_KEY = "dtrain/saved/"


def mark_saved(step: int) -> None:
    """After this rank's checkpoint of ``step`` is written: count it in the job's store; the last rank to do so
    records ``step`` as the job's last complete checkpoint, which a restarted attempt reads
    (:func:`last_saved_step`). Ranks save in step order, so the record only grows."""
    store = _root_store()
    if store.add(f"{_SAVED_KEY}{step}", 1) == dist.get_world_size():
        store.set(f"{_SAVED_KEY}last", str(step))


def last_saved_step() -> int | None:
    """The step of this job's last complete checkpoint (written by any earlier attempt), or None."""
    store = _root_store()
    key = f"{_SAVED_KEY}last"
    try:
        return int(store.get(key).decode()) if store.check([key]) else None
    except Exception:
        return None


def _recorded_bad_input(store) -> str | None:
    try:
        return store.get(_FATAL_KEY).decode() if store.check([_FATAL_KEY]) else None
    except Exception:
        return None


def _token(value: object) -> str:
    """Rank 0's heartbeat namespace: twelve hexadecimal digits."""
    if not (isinstance(value, str) and len(value) == 12 and all(c in "0123456789abcdef" for c in value)):
        raise ValueError(f"a heartbeat token of twelve hexadecimal digits, not {value!r}"[:200])
    return value


def _start_heartbeat():
    """This rank's heartbeat in a namespace of its own for this attempt (rank 0 draws it)."""
    from dtrain.comm.peer.watchdog import Heartbeat
    from dtrain.comm.values import broadcast_json

    token = broadcast_json(uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None, _token, src=0)
    store = dist.PrefixStore(f"dtrain/heartbeat/{token}/", _root_store())
    return Heartbeat(store, dist.get_rank(), dist.get_world_size()).start()


def _is_collective_failure(err: BaseException) -> bool:
    """A failure a dead peer can cause: torch.distributed's own errors, or a backend's RuntimeError."""
    return isinstance(err, dist.DistError | RuntimeError | ConnectionError | TimeoutError)


#: The variables torch's elastic agent sets for each worker (LocalElasticAgent._start_workers), kept over the
#: launcher's environment in a worker; and every TORCHELASTIC_* one.
AGENT_VARIABLES = frozenset(
    {
        "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
    }
)  # fmt: skip


def worker_environment(launcher: dict[str, str], worker: dict[str, str]) -> dict[str, str]:
    """A worker's environment: the launcher's at the call, with the agent's variables of this worker over it."""
    agent = {k: v for k, v in worker.items() if k in AGENT_VARIABLES or k.startswith("TORCHELASTIC_")}
    return {**launcher, **agent}


def _forked_rank_main(launcher: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`_rank_main` in a worker forked from the fork server, in the launcher's environment."""
    environment = worker_environment(launcher, dict(os.environ))
    os.environ.clear()
    os.environ.update(environment)
    return _rank_main(fn, *args)


def _rank_main(fn: Callable[..., Any], *args: Any) -> Any:
    """What every launched rank runs: set up the group and the heartbeat, call ``fn``, tear them down. Under our
    own launcher a ``ValueError`` comes back as :class:`_BadInput`; under torchrun it is raised (recorded)."""
    created = init_rank()
    store = _root_store()
    heartbeat = None
    try:
        recorded = _recorded_bad_input(store)
        if recorded is not None:  # an earlier attempt of this job stopped on bad input: no retry mends it
            raise ValueError(recorded)
        if dist.get_world_size() > 1:
            heartbeat = _start_heartbeat()
        try:
            return fn(*args)
        except OUT_OF_MEMORY as err:  # what runs does not fit the device: no restart mends it either
            raise ValueError(out_of_memory_line(err)) from None
        except RuntimeError as err:
            if HOST_OUT_OF_MEMORY not in str(err):
                raise
            raise ValueError(out_of_memory_line(err)) from None  # nor the host's memory
    except ValueError as err:
        with contextlib.suppress(Exception):  # a store that is gone cannot carry it to a later attempt
            store.set(_FATAL_KEY, str(err))
        if not under_torchrun_job():
            return _BadInput(str(err))
        raise
    except Exception as err:
        recorded = _recorded_bad_input(store)
        if recorded is not None:  # a peer stopped on bad input and this rank's collective with it failed
            if not under_torchrun_job():
                return _BadInput(recorded)  # no restart: the job ends with that one line
            raise ValueError(recorded) from None
        line = None
        if heartbeat is not None and _is_collective_failure(err):
            line = heartbeat.describe_failure(err)
        if line is None and dist.is_initialized() and dist.get_world_size() > 1:
            # said now: the teardown below can wait on a peer still inside a collective with this rank (an NCCL
            # communicator's destruction), and the traceback comes only after it
            message = str(err).strip().splitlines()
            line = f"dtrain: rank {dist.get_rank()} stopped: {type(err).__name__}" + (
                f": {message[0]}" if message else ""
            )
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if created:
            from dtrain.comm.peer import window as peer

            peer.close_windows()  # the peer transport's windows and the graphs recorded on them go first
            gc.collect()  # CUDA graphs still holding NCCL kernels would stall the teardown
            dist.destroy_process_group()


#: The allocator's error when a device runs out of memory (``torch.cuda.OutOfMemoryError`` before torch 2.5). A
#: rank that raises it stops the job in one line, as on bad input: a restart would run out of memory again.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


#: What torch's CPU allocator says where the host has no memory left for a tensor (a ``RuntimeError``).
HOST_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory_line(err: BaseException) -> str:
    """One line for a rank that ran out of device memory: the rank and the allocator's first three sentences
    (CUDA's: what ran out, how much was asked for, how much the device has free); for host memory, the CPU
    allocator's words from what it could not allocate."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    rank = f"rank {dist.get_rank()}" if dist.is_initialized() else "a rank"
    if HOST_OUT_OF_MEMORY in first:
        return f"{rank} ran out of host memory ({first[first.index(HOST_OUT_OF_MEMORY) :]})"
    return f"{rank} ran out of device memory ({'. '.join(first.split('. ')[:3]).rstrip('.')})"


def under_torchrun_job() -> bool:
    """True in a process torchrun started (not a worker of :func:`run_ranks`' own launch)."""
    return not os.environ.get("TORCHELASTIC_RUN_ID", "").startswith(_RUN_PREFIX)


def _one_line(record: logging.LogRecord) -> bool:
    """The agent's report of a failed worker without the traceback of its own bookkeeping that follows it."""
    record.exc_info = None
    record.exc_text = None
    return True


def frame_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up from this one: what torch's dynamic rendezvous asks
    ``inspect.stack()[depth].function`` for, twice for every event it records. ``inspect.stack`` reads the source
    lines of every frame on the stack, seconds of an agent's start-up; the frame alone gives the name (as
    PyTorch itself does elsewhere, pytorch/pytorch#105940)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack: torch's own answer
        return "no_method_name"


def _quick_rendezvous_events() -> None:
    """Name the rendezvous' events by :func:`frame_name` (same names, no source read), where torch has the hook."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = frame_name


def _stop_orphans(before: set[int]) -> None:
    """Kill and reap the workers this launch started that the agent left behind (SIGKILL: nothing printed): the
    children of this process not among the pids in ``before`` (its others, a test's process pool, are left alone).

    A signal that reaches the agent while it starts its workers (Ctrl-C, 5-8 s into a launch of two ranks on 2
    cores) leaves it without their handles: the workers already forked are neither stopped nor waited for. Each
    one reads its arguments from the fork server after its fork, among them named semaphores of the launch (the
    workers' return queues and their finished event), and this process unlinks those as it exits: left alone, a
    worker still reading its arguments then prints multiprocessing's traceback ending ``FileNotFoundError``. The
    workers are killed and waited for here, while the semaphores are still there."""
    import multiprocessing

    launched = [child for child in multiprocessing.active_children() if child.pid not in before]
    for child in launched:
        with contextlib.suppress(OSError, ValueError):
            child.kill()
    for child in launched:
        with contextlib.suppress(OSError, ValueError):
            child.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0, monitor_interval: float = 0.1
) -> Any:
    """Run ``fn(*args)`` on every rank (see the module docstring); rank 0's return value. When a worker fails,
    the agent restarts all of them up to ``max_restarts`` times (``fn`` reads :func:`restart_count`), checking
    them every ``monitor_interval`` seconds. A ``ValueError`` on any rank is raised here, once, unrestarted."""
    if under_torchrun():
        return _rank_main(fn, *args)
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if not monitor_interval > 0:
        raise ValueError(f"monitor_interval must be > 0 seconds, got {monitor_interval}")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    start_fork_server(nproc)  # OpenMP's threads a process first: the server's environment is its workers'
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        run_id=f"{_RUN_PREFIX}{uuid.uuid4().hex[:8]}",  # its workers return bad input rather than fail
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        local_addr="127.0.0.1",
        start_method="forkserver",
    )
    # the agent's warnings (workers shut down on Ctrl-C, ...) repeat what the caller reports in one line
    for name in list(logging.root.manager.loggerDict):  # each module's logger has its own level set
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
            logging.getLogger(name).addFilter(_one_line)  # "failed (exitcode: -9) local_rank: 1 (pid: N)"
    env.kill_at()  # a bad DTRAIN_KILL_AT stops here, before any rank starts
    _quick_rendezvous_events()  # 3-4 s less a launch of two ranks on a 2-core machine
    raise_noted_interrupt()  # a Ctrl-C that an import callback dropped: no worker starts
    import multiprocessing

    before = {child.pid for child in multiprocessing.active_children()}
    try:
        results = elastic_launch(config, _forked_rank_main)(dict(os.environ), fn, *args)
    except BaseException:
        _stop_orphans(before)
        raise
    bad = next((r for _, r in sorted(results.items()) if isinstance(r, _BadInput)), None)
    if bad is not None:
        raise ValueError(bad.message)
    return results[0]
