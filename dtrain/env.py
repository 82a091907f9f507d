"""Every ``DTRAIN_*`` environment variable, read and checked in one place (imports no torch).

Three groups, each a frozen dataclass built by ``from_env(environ=os.environ)``:

- :class:`CommEnv`: how ``dtrain.comm`` runs its collectives (transport, captured calls, peer-memory mode and
  window size, per-round timeout, rules and calibration files, lanes, the Triton kernel);
- :class:`PsEnv`: what a parameter-server process (``python -m dtrain.ps``) is, set by its launcher;
- :class:`EmulateEnv`: what the emulated cluster tells each torchrun worker.

A value that does not parse raises :class:`EnvError` (a ``ValueError``) whose one-line message names the
variable, the value and what is accepted. Values are read when asked for, so a variable set between two calls
takes effect at the next one; :func:`comm_env` keeps the last parse while the variables are unchanged.
docs/configuration.md lists every variable with its default and effect.

Interactions: ``DTRAIN_COMM_TIMEOUT`` set (> 0) makes ``DTRAIN_COMM_TRANSPORT=auto`` pick the point-to-point
transport and turns captured calls (``DTRAIN_COMM_PERSISTENT``) off; ``DTRAIN_COMM_PEER_MODE``,
``DTRAIN_COMM_PEER_WINDOW_BYTES``, ``DTRAIN_COMM_TRITON`` and ``DTRAIN_COMM_FUSED`` only matter on the peer
transport;
``DTRAIN_COMM_LANES`` only cuts schedules that reduce.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = [
    "EnvError",
    "CommEnv",
    "PsEnv",
    "EmulateEnv",
    "comm_env",
    "parse_size",
    "ALL_VARIABLES",
    "KILL_AT",
    "kill_at",
    "kill_node",
    "kill_delay",
    "COMM_TRANSPORT",
    "COMM_PERSISTENT",
    "COMM_PEER_MODE",
    "COMM_PEER_WINDOW_BYTES",
    "COMM_TIMEOUT",
    "COMM_RULES",
    "COMM_LANES",
    "COMM_TRITON",
    "COMM_FUSED",
    "COMM_ONE_PASS",
    "COMM_WIDE",
    "COMM_AUTOTUNE",
    "COMM_CHECK",
    "CALIBRATION",
    "PS_ROLE",
    "PS_COORDINATOR",
    "PS_SECRET",
    "PS_RANK",
    "PS_HOST",
    "PS_JOB",
    "PS_TASK",
    "EMULATE_NODE_RANK",
    "EMULATE_LOCAL_SIZE",
]

COMM_TRANSPORT = "DTRAIN_COMM_TRANSPORT"
COMM_PERSISTENT = "DTRAIN_COMM_PERSISTENT"
COMM_PEER_MODE = "DTRAIN_COMM_PEER_MODE"
COMM_PEER_WINDOW_BYTES = "DTRAIN_COMM_PEER_WINDOW_BYTES"
COMM_TIMEOUT = "DTRAIN_COMM_TIMEOUT"
COMM_RULES = "DTRAIN_COMM_RULES"
COMM_LANES = "DTRAIN_COMM_LANES"
COMM_TRITON = "DTRAIN_COMM_TRITON"
COMM_FUSED = "DTRAIN_COMM_FUSED"
COMM_ONE_PASS = "DTRAIN_COMM_ONE_PASS"
COMM_WIDE = "DTRAIN_COMM_WIDE"
COMM_AUTOTUNE = "DTRAIN_COMM_AUTOTUNE"
COMM_CHECK = "DTRAIN_COMM_CHECK"
CALIBRATION = "DTRAIN_CALIBRATION"
PS_ROLE = "DTRAIN_PS_ROLE"
PS_COORDINATOR = "DTRAIN_PS_COORDINATOR"
PS_SECRET = "DTRAIN_PS_SECRET"
PS_RANK = "DTRAIN_PS_RANK"
PS_HOST = "DTRAIN_PS_HOST"
PS_JOB = "DTRAIN_PS_JOB"
PS_TASK = "DTRAIN_PS_TASK"
EMULATE_NODE_RANK = "DTRAIN_EMULATE_NODE_RANK"
EMULATE_LOCAL_SIZE = "DTRAIN_EMULATE_LOCAL_SIZE"
KILL_AT = "DTRAIN_KILL_AT"

_COMM_NAMES = (
    COMM_TRANSPORT,
    COMM_PERSISTENT,
    COMM_PEER_MODE,
    COMM_PEER_WINDOW_BYTES,
    COMM_TIMEOUT,
    COMM_RULES,
    COMM_LANES,
    COMM_TRITON,
    COMM_FUSED,
    COMM_ONE_PASS,
    COMM_WIDE,
    COMM_AUTOTUNE,
    COMM_CHECK,
    CALIBRATION,
)
_PS_NAMES = (PS_ROLE, PS_COORDINATOR, PS_SECRET, PS_RANK, PS_HOST, PS_JOB, PS_TASK)
_EMULATE_NAMES = (EMULATE_NODE_RANK, EMULATE_LOCAL_SIZE)
#: Every variable dtrain reads.
ALL_VARIABLES = (*_COMM_NAMES, *_PS_NAMES, *_EMULATE_NAMES, KILL_AT)


class EnvError(ValueError):
    """An environment variable whose value does not parse; the message names it, the value and what is
    accepted."""


def under_torchrun() -> bool:
    """True when a launcher (torchrun, an elastic agent) already set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class SameOnEveryRank(ValueError):
    """Bad input found before any rank-specific work, from what every rank of a torchrun job reads alike (flags,
    configuration, files): each rank raises it, and the command line says it once a node (:func:`says_refusals`)."""


#: Seconds a torchrun rank that leaves a :class:`SameOnEveryRank` refusal to its node's first rank waits before it
#: exits: torchrun stops every rank once one has ended, which could cut the first rank short of its line.
QUIET_REFUSAL_WAIT_S = 5.0


def says_refusals() -> bool:
    """Whether this process prints a :class:`SameOnEveryRank` refusal: every process but a torchrun job's ranks
    other than a node's first (``LOCAL_RANK`` 0), which exit with the same status without a word."""
    return not under_torchrun() or os.environ.get("LOCAL_RANK", "0") == "0"


def _get(environ: Mapping[str, str], name: str) -> str:
    return (environ.get(name) or "").strip()


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = _get(environ, name) or default
    if value not in choices:
        accepted = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise EnvError(f"{name}={value!r} is not accepted; use {accepted} (default {default})")
    return value


def _int(environ: Mapping[str, str], name: str, *, least: int, what: str) -> int | None:
    text = _get(environ, name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise EnvError(f"{name}={text!r} is not accepted; use {what}")
    return value


def _path(environ: Mapping[str, str], name: str) -> Path | None:
    text = _get(environ, name)
    return Path(text) if text else None


def parse_size(name: str, text: str) -> int:
    """A size in bytes from ``text``: digits, optionally followed by K, M or G (and B or iB), e.g. 4096, 64M,
    2GiB; 0 for an empty text. :class:`EnvError` naming ``name`` otherwise."""
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    if not body:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(body[-1], 1)
    digits = body[:-1] if body[-1] in units else body
    if not digits.isdigit():
        raise EnvError(f"{name}={text!r} is not accepted; use a size such as 4096, 64M or 2G")
    return int(digits) * scale


@dataclass(frozen=True)
class CommEnv:
    """How ``dtrain.comm`` runs collectives; see docs/configuration.md for each field's variable."""

    #: ``DTRAIN_COMM_TRANSPORT``: "auto", "p2p" (torch.distributed messages), "peer" (peer memory, one host) or
    #: "mpi" (the default group is MPI_COMM_WORLD, in a job mpirun started).
    transport: str = "auto"
    #: ``DTRAIN_COMM_PERSISTENT``: "auto", "1" (capture repeated peer-transport calls as CUDA graphs) or "0".
    persistent: str = "auto"
    #: ``DTRAIN_COMM_PEER_MODE``: "auto", "pull" or "push": the peer transport's form of a schedule.
    peer_mode: str = "auto"
    #: ``DTRAIN_COMM_PEER_WINDOW_BYTES``: the least size of a peer-memory window, bytes (0: the call's size).
    peer_window_bytes: int = 0
    #: ``DTRAIN_COMM_TIMEOUT``: seconds any round may wait, or None (the process group's own timeout).
    timeout_s: float | None = None
    #: ``DTRAIN_COMM_RULES``: the rules file for ``algorithm="auto"``, or None (``~/.cache/dtrain``).
    rules: Path | None = None
    #: ``DTRAIN_CALIBRATION``: the calibrated cost-model file, or None (``~/.cache/dtrain``).
    calibration: Path | None = None
    #: ``DTRAIN_COMM_LANES``: lanes a reducing schedule is cut into.
    lanes: int = 1
    #: ``DTRAIN_COMM_TRITON``: whether the peer transport may use its fused Triton kernel.
    triton: bool = True
    #: ``DTRAIN_COMM_FUSED``: whether the one-shot and two-shot (``direct``) all-reduce run as one kernel on CUDA
    #: symmetric memory (torch's kernels, sums of float32 and bfloat16) rather than a barrier and a pass a round.
    fused: bool = True
    #: ``DTRAIN_COMM_ONE_PASS``: whether all-gather, reduce-scatter, all-to-all and broadcast named ``direct`` (or
    #: ``star`` for broadcast) run in one pass over CUDA symmetric memory (one barrier, one kernel) rather than
    #: the round-at-a-time plan, up to 8 MiB a rank (docs/collectives.md).
    one_pass: bool = True
    #: ``DTRAIN_COMM_WIDE``: whether ``auto`` may run a large NCCL collective on the group's wide communicator
    #: (:func:`dtrain.comm.native.wide_group`: NCCL's own collective on more CTAs), where the rules measured it faster.
    wide: bool = True
    #: ``DTRAIN_COMM_AUTOTUNE``: "1" makes the first ``auto`` call of a group with no measured rules measure
    #: them (a short calibration, saved to the per-machine cache); "0" (default) leaves such a group ``native``.
    autotune: bool = False
    #: ``DTRAIN_COMM_CHECK``: "1" makes every rank compare each collective call's signature (the collective, the
    #: algorithm, the element count and dtype) with the group's before it moves a byte, and raise the same
    #: one-line error on every rank where they differ (a debugging mode: one small all-gather a call).
    check: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CommEnv:
        timeout_text = _get(environ, COMM_TIMEOUT)
        timeout_s = None
        if timeout_text:
            try:
                seconds = float(timeout_text)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds):
                raise EnvError(f"{COMM_TIMEOUT}={timeout_text!r} is not accepted; use a number of seconds (0: off)")
            timeout_s = seconds if seconds > 0 else None
        lanes = _int(environ, COMM_LANES, least=1, what="a whole number of lanes >= 1")
        return cls(
            transport=_choice(environ, COMM_TRANSPORT, ("auto", "p2p", "peer", "mpi"), "auto"),
            persistent=_choice(environ, COMM_PERSISTENT, ("0", "1", "auto"), "auto"),
            peer_mode=_choice(environ, COMM_PEER_MODE, ("pull", "push", "auto"), "auto"),
            peer_window_bytes=parse_size(COMM_PEER_WINDOW_BYTES, _get(environ, COMM_PEER_WINDOW_BYTES)),
            timeout_s=timeout_s,
            rules=_path(environ, COMM_RULES),
            calibration=_path(environ, CALIBRATION),
            lanes=1 if lanes is None else lanes,
            triton=_choice(environ, COMM_TRITON, ("0", "1"), "1") == "1",
            fused=_choice(environ, COMM_FUSED, ("0", "1"), "1") == "1",
            one_pass=_choice(environ, COMM_ONE_PASS, ("0", "1"), "1") == "1",
            wide=_choice(environ, COMM_WIDE, ("0", "1"), "1") == "1",
            autotune=_choice(environ, COMM_AUTOTUNE, ("0", "1"), "0") == "1",
            check=_choice(environ, COMM_CHECK, ("0", "1"), "0") == "1",
        )

    @property
    def captures(self) -> bool:
        """Whether repeated peer-transport calls may be captured as graphs: ``persistent`` not "0" and no
        per-round timeout (a graph cannot report which round stalled)."""
        return self.persistent != "0" and self.timeout_s is None


# the variables a parse depends on, and LOCAL_WORLD_SIZE (a default group's node size), so that what
# dtrain.comm keeps per environment (comm_env's identity) is dropped when either changes
_WATCHED = (*_COMM_NAMES, "LOCAL_WORLD_SIZE")
_COMM_KEYS = tuple(getattr(os.environ, "encodekey", lambda name: name)(name) for name in _WATCHED)
_LAST: list = [None, None]  # [raw values, CommEnv]: the last parse of os.environ (one process-wide cache)


def comm_env() -> CommEnv:
    """:meth:`CommEnv.from_env` of this process's environment, parsed again only when a variable changed
    (collectives ask for it on every call)."""
    data = getattr(os.environ, "_data", None)  # CPython's mapping behind os.environ: a lookup without encoding
    raw = tuple(map(data.get, _COMM_KEYS)) if isinstance(data, dict) else tuple(map(os.environ.get, _WATCHED))
    if raw != _LAST[0]:
        parsed = CommEnv.from_env(os.environ)
        _LAST[:] = [raw, parsed]
    return _LAST[1]


@dataclass(frozen=True)
class PsEnv:
    """What a parameter-server process is (set by :class:`dtrain.ps.launch.LocalCluster`, or by hand on a
    cluster). A field is None where its variable is unset; :meth:`need` asks for one that must be there."""

    #: ``DTRAIN_PS_ROLE``: "coordinator", "server" or "worker".
    role: str | None = None
    #: ``DTRAIN_PS_COORDINATOR``: the coordinator's address, ``tcp://host:port``.
    coordinator: str | None = None
    #: ``DTRAIN_PS_SECRET``: the job's shared HMAC secret (hex in the variable, at least 16 bytes).
    secret: bytes | None = None
    #: ``DTRAIN_PS_RANK``: a server's or worker's rank.
    rank: int | None = None
    #: ``DTRAIN_PS_HOST``: the address a server binds.
    host: str = "127.0.0.1"
    #: ``DTRAIN_PS_JOB``: the coordinator's job configuration, JSON.
    job: str | None = None
    #: ``DTRAIN_PS_TASK``: a worker's training task, JSON.
    task: str | None = None

    ROLES = ("coordinator", "server", "worker")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PsEnv:
        role = _get(environ, PS_ROLE) or None
        if role is not None and role not in cls.ROLES:
            raise EnvError(f"{PS_ROLE}={role!r} is not accepted; use coordinator, server or worker")
        coordinator = _get(environ, PS_COORDINATOR) or None
        if coordinator is not None:
            host, _, port = coordinator.removeprefix("tcp://").rpartition(":")
            if not coordinator.startswith("tcp://") or not host or not port.isdigit():
                raise EnvError(f"{PS_COORDINATOR}={coordinator!r} is not accepted; use tcp://HOST:PORT")
        return cls(
            role=role,
            coordinator=coordinator,
            secret=_secret(_get(environ, PS_SECRET)),
            rank=_int(environ, PS_RANK, least=0, what="a rank, a whole number >= 0"),
            host=_get(environ, PS_HOST) or "127.0.0.1",
            job=_get(environ, PS_JOB) or None,
            task=_get(environ, PS_TASK) or None,
        )

    def need(self, field: str):
        """The value of ``field``; :class:`EnvError` naming its variable when it is unset."""
        value = getattr(self, field)
        if value is None:
            name = {f.name: n for f, n in zip(fields(self), _PS_NAMES, strict=True)}[field]
            raise EnvError(f"{name} is not set; a parameter-server role needs it (see dtrain.ps.launch)")
        return value


def _secret(text: str) -> bytes | None:
    """The secret's bytes; the error never repeats the secret, only its length."""
    if not text:
        return None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise EnvError(f"{PS_SECRET} must be hex, got {len(text)} characters that are not") from None
    if len(secret) < 16:
        raise EnvError(f"{PS_SECRET} must hold at least 16 bytes of hex (32 hex digits), got {len(secret)} bytes")
    return secret


@dataclass(frozen=True)
class EmulateEnv:
    """What the emulated cluster tells each torchrun worker (:mod:`dtrain.emulate.rank`)."""

    #: ``DTRAIN_EMULATE_NODE_RANK``: the node rank the emulation placed this server at, or None.
    node_rank: int | None = None
    #: ``DTRAIN_EMULATE_LOCAL_SIZE``: ranks per hierarchy level for ``comm.set_local_size``, or None.
    local_size: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EmulateEnv:
        return cls(
            node_rank=_int(environ, EMULATE_NODE_RANK, least=0, what="a node rank, a whole number >= 0"),
            local_size=_int(environ, EMULATE_LOCAL_SIZE, least=1, what="a whole number of ranks >= 1"),
        )


def _kill_parts(environ: Mapping[str, str]) -> tuple[int, int, bool, float] | None:
    """``DTRAIN_KILL_AT`` as (rank, step, node, delay in seconds), or None when unset."""
    value = _get(environ, KILL_AT)
    if not value:
        return None
    parts = value.split(":")
    node, delay, ok = False, 0.0, len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit()
    for extra in parts[2:] if ok else ():
        if extra == "node" and not node:
            node = True
        elif extra.startswith("+") and delay == 0.0:
            try:
                delay = float(extra[1:])
            except ValueError:
                ok = False
            ok = ok and math.isfinite(delay) and delay > 0
        else:
            ok = False
    if not ok:
        raise EnvError(
            f"{KILL_AT}={value!r}: must be RANK:STEP, then optionally :node and :+SECONDS, RANK and STEP whole "
            f"numbers >= 0 and SECONDS > 0 (e.g. 1:3 or 1:3:+2)"
        )
    return int(parts[0]), int(parts[1]), node, delay


def kill_at(environ: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``DTRAIN_KILL_AT=RANK:STEP[:node][:+SECONDS]`` (fault injection for resilience tests: that rank of ``dtrain
    train`` kills itself with SIGKILL as step STEP starts, in the first attempt only; with ``:node`` it first kills
    the elastic agent that started it, as a whole node going down; with ``:+SECONDS`` it waits that long into the
    step first, so that its peers are waiting for it inside the step's collectives when it dies), or None when
    unset."""
    parts = _kill_parts(environ)
    return None if parts is None else parts[:2]


def kill_node(environ: Mapping[str, str] = os.environ) -> bool:
    """True when ``DTRAIN_KILL_AT`` has ``:node``: the rank kills its elastic agent before itself."""
    parts = _kill_parts(environ)
    return parts is not None and parts[2]


def kill_delay(environ: Mapping[str, str] = os.environ) -> float:
    """The seconds ``DTRAIN_KILL_AT``'s ``:+SECONDS`` makes the rank wait into its step before it dies (0 if
    none)."""
    parts = _kill_parts(environ)
    return 0.0 if parts is None else parts[3]
