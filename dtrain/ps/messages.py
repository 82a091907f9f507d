"""Every message kind's schema, checked against the job's configuration before a role acts on a message.

:func:`dtrain.ps.wire.decode` checks a message's envelope (frames, sizes, the HMAC, freshness, dtype names and
shapes); :func:`check` then checks what the message says, in one way for every kind. Each role has a table from
message kind (``op``) to :class:`Schema`: the header's fields (type, range, allowed values; fields not in the
schema are refused too) and the tensors, with shapes in terms of the job (``"width"``, the shard's ``"rows"``,
``"n"`` keys). Bounds come from the :class:`~dtrain.ps.config.JobConfig`: a shard id is in ``[0, num_servers)``,
a worker in ``[0, num_workers)``, every other int (clocks, rounds, push ids, sequence numbers) in
``[0, 2**62)`` so that no counter it sets can overflow, keys lie inside the named shard's key range (and are
distinct where a reply is sized by them), rows are ``width`` wide, every float a server is sent and every row a pull
reply carries is finite (the error names the first key that is not), and a kind the job does not use (hot-key copies
with ``hot_keys=0``, replication entries with ``replicas=1``, chain acknowledgements without chain replication) is
refused whatever it carries. Each field's type is checked before its value is used, so a message that fails is a
:class:`MessageError`, never another exception; the receiving role answers a request with an error reply, drops
anything else, and goes on serving.

Tables: :data:`SERVER` (requests from workers and tools, and what peer servers send), :data:`SERVER_CONTROL`
(what the coordinator sends a server), :data:`COORDINATOR`, :data:`WORKER_CONTROL` (what the coordinator sends
a worker) and :data:`WORKER_REPLIES` (a server's answers, keyed by the request's op).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.keys import KeyRange, partition

__all__ = [
    "COORDINATOR",
    "MessageError",
    "PEER",
    "SERVER",
    "SERVER_CONTROL",
    "WORKER_CONTROL",
    "WORKER_REPLIES",
    "Field",
    "Schema",
    "Tensor",
    "check",
    "job_config",
]

# set by wire.encode on every message, checked by wire.ReplayGuard
_ENVELOPE = frozenset({"op", "ts", "nonce"})

MAX_COUNT = 1 << 62
"""Bound of every int field without a job-given one: a counter set from it (``clock + 1``) still fits int64."""


class MessageError(ValueError):
    """An authenticated message that breaks its kind's schema or the job's configuration."""


@dataclass(frozen=True)
class Field:
    """A header field. ``kind``: ``int`` (``low <= v < high``; ``high`` a number or ``"shards"``, ``"servers"``,
    ``"workers"``, or ``"role"`` for a rank of the role the header names; without one, ``2**62``), ``str`` (one
    of ``choices`` if given), ``pushes`` (``[worker, push_id, clock]`` triples), ``ranks`` (server ranks),
    ``layout`` (the coordinator's layout), ``map`` or ``list`` (taken as they are)."""

    kind: str
    high: int | str | None = None
    low: int = 0
    choices: tuple[str, ...] = ()
    optional: bool = False


@dataclass(frozen=True)
class Tensor:
    """A tensor frame: ``dtype`` a :data:`~dtrain.ps.wire.DTYPES` name, ``shape`` of ints and the names ``"n"``
    (the same count in every tensor of the message), ``"width"``, ``"rows"`` (the shard's row count) and ``"*"``
    (any size). ``keys``:
    int64 keys inside the shard's range, strictly ``increasing`` or ``distinct`` if asked, at most ``most`` of
    them (a :class:`JobConfig` field's value). ``finite``: no NaN or infinity. ``optional``: may be left off
    (trailing tensors only)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    keys: bool = False
    increasing: bool = False
    distinct: bool = False
    most: str | None = None
    finite: bool = False
    optional: bool = False


# A reason the job refuses a message of this kind, or "" (config, header, receiving server's rank or None)
Refusal = Callable[[JobConfig, Mapping[str, Any], "int | None"], str]


@dataclass(frozen=True)
class Schema:
    """One message kind: fields, tensors, and, where the header's ``variants[0]`` field picks a variant, the
    fields and tensors each value adds (its tensors replace the base ones). ``refuse`` applies the job's
    configuration beyond ranges and shapes."""

    fields: Mapping[str, Field]
    tensors: tuple[Tensor, ...] = ()
    variants: tuple[str, Mapping[str, Schema]] | None = None
    refuse: Refusal | None = None


@lru_cache(maxsize=16)
def _ranges(num_keys: int, num_servers: int) -> tuple[KeyRange, ...]:
    return tuple(partition(num_keys, num_servers))


_DTYPE_WORDS = {"i8": "int64", "f4": "float32"}


def _bound(high: int | str, config: JobConfig, header: Mapping[str, Any]) -> int:
    if isinstance(high, int):
        return high
    if high == "role":
        return config.num_servers if header.get("role") == "server" else config.num_workers
    return {"shards": config.num_servers, "servers": config.num_servers, "workers": config.num_workers}[high]


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_field(name: str, spec: Field, value: Any, config: JobConfig, header: Mapping[str, Any]) -> None:
    s = config.num_servers
    if spec.kind == "int":
        high = _bound(spec.high, config, header) if spec.high is not None else MAX_COUNT
        if not _is_int(value) or value < spec.low or value >= high:
            if spec.high is None:
                raise MessageError(f"{name} must be an int in [{spec.low}, 2**62), got {_short(value)}")
            raise MessageError(f"{name} must be in [{spec.low}, {high}), got {_short(value)}")
    elif spec.kind == "str":
        if not isinstance(value, str) or (spec.choices and value not in spec.choices):
            allowed = f"one of {', '.join(spec.choices)}" if spec.choices else "a str"
            raise MessageError(f"{name} must be {allowed}, got {_short(value)}")
    elif spec.kind == "pushes":
        ok = isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 3 and all(_is_int(v) and 0 <= v < MAX_COUNT for v in p) for p in value
        )
        if not ok or any(p[0] >= config.num_workers for p in value):
            raise MessageError(f"{name} must be [worker < {config.num_workers}, push_id, clock] ints in [0, 2**62), "
                               f"got {_short(value)}")  # fmt: skip
    elif spec.kind == "ranks":
        if not (isinstance(value, list) and all(_is_int(r) and 0 <= r < s for r in value)):
            raise MessageError(f"{name} must be a list of server ranks in [0, {s}), got {_short(value)}")
    elif spec.kind == "layout":
        _check_layout(name, value, config)
    elif spec.kind == "map":
        if not isinstance(value, dict):
            raise MessageError(f"{name} must be a map, got {type(value).__name__}")
    elif spec.kind == "list":
        if not isinstance(value, list):
            raise MessageError(f"{name} must be a list, got {type(value).__name__}")
    else:  # a schema table's own mistake
        raise TypeError(f"unknown field kind {spec.kind!r}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_layout(name: str, layout: Any, config: JobConfig) -> None:
    s = config.num_servers
    ok = (
        isinstance(layout, dict)
        and set(layout) == {"epoch", "chains", "endpoints"}
        and _is_int(layout["epoch"])
        and 0 <= layout["epoch"] < MAX_COUNT
        and isinstance(layout["chains"], list)
        and len(layout["chains"]) == s
        and all(
            isinstance(c, list)
            and len(c) <= config.replicas
            and all(_is_int(r) and 0 <= r < s for r in c)
            and len(set(c)) == len(c)  # ints by now: set() of a list inside would raise
            for c in layout["chains"]
        )
        and isinstance(layout["endpoints"], list)
        and len(layout["endpoints"]) == s
        and all(e is None or isinstance(e, str) for e in layout["endpoints"])
    )
    if not ok:
        raise MessageError(f"{name} must be {{epoch, chains: {s} lists of at most {config.replicas} distinct server "
                           f"ranks, endpoints: {s} addresses or None}}")  # fmt: skip
    # a chain's servers are where requests go: each needs an address (None marks a server that is gone)
    gone = sorted({r for c in layout["chains"] for r in c if layout["endpoints"][r] is None})
    if gone:
        raise MessageError(f"{name}: chains name servers {gone}, which have no endpoint")


def _check_fields(fields: Mapping[str, Field], header: Mapping[str, Any], config: JobConfig) -> None:
    for name, spec in fields.items():
        if name not in header:
            if not spec.optional:
                raise MessageError(f"{name} is missing")
            continue
        _check_field(name, spec, header[name], config, header)


def _shape_text(shape: tuple) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(str(d) for d in shape)})"


def _first_not_finite(tensor: np.ndarray, keys: np.ndarray | None, key_range: KeyRange | None,
                      spec: Tensor) -> str:  # fmt: skip
    """Where ``tensor`` first holds NaN or infinity: ``" at key k"`` from the keys its rows are of (the message's own
    keys, a reply's request's, or the shard's rows), else ``" in row r"``."""
    row = int(np.argwhere(~np.isfinite(tensor.reshape(tensor.shape[0], -1)))[0, 0]) if tensor.ndim else 0
    if keys is not None and keys.shape[:1] == tensor.shape[:1]:
        return f" at key {int(keys[row])}"
    if spec.shape[:1] == ("rows",) and key_range is not None:
        return f" at key {key_range.lo + row}"
    return f" in row {row}" if tensor.ndim else ""


def _check_tensors(specs: tuple[Tensor, ...], tensors: list[np.ndarray], config: JobConfig, shard: int | None,
                   n: int | None, keys: np.ndarray | None = None) -> None:  # fmt: skip
    required = sum(not t.optional for t in specs)
    if not required <= len(tensors) <= len(specs):
        wanted = ", ".join(f"{t.name}{' (optional)' if t.optional else ''}" for t in specs) or "none"
        raise MessageError(f"carries {len(tensors)} tensors, expected: {wanted}")
    key_range = _ranges(config.num_keys, config.num_servers)[shard] if shard is not None else None
    for spec, tensor in zip(specs, tensors, strict=False):
        if n is None and spec.shape[:1] == ("n",) and tensor.ndim >= 1:
            n = tensor.shape[0]
        rows = len(key_range) if key_range is not None else "rows"
        sizes = {"n": "n" if n is None else n, "width": config.width, "rows": rows, "workers": config.num_workers}
        want = tuple(sizes.get(d, d) for d in spec.shape)
        if "*" in want and len(want) == tensor.ndim:  # any size there
            want = tuple(got if d == "*" else d for d, got in zip(want, tensor.shape, strict=True))
        word = _DTYPE_WORDS.get(spec.dtype, spec.dtype)
        if tensor.dtype != np.dtype(word) or tensor.shape != want:
            raise MessageError(f"{spec.name} must be {word} {_shape_text(want)}, got {tensor.dtype} "
                               f"{_shape_text(tensor.shape)}")  # fmt: skip
        if spec.keys:
            keys = tensor if keys is None else keys
            if key_range is not None and not key_range.holds(tensor):
                raise MessageError(f"{spec.name} outside shard {shard}'s range [{key_range.lo}, {key_range.hi})")
            if spec.increasing and tensor.size > 1 and not bool((tensor[1:] > tensor[:-1]).all()):
                raise MessageError(f"{spec.name} must be strictly increasing")
            if spec.distinct and tensor.size > 1 and np.unique(tensor).size != tensor.size:
                raise MessageError(f"{spec.name} must be distinct: a key is asked for once (at most the shard's "
                                   "rows, so that the answer fits a message)")  # fmt: skip
            if spec.most is not None and tensor.size > getattr(config, spec.most):
                raise MessageError(f"{spec.name}: {tensor.size} of them, over {spec.most}={getattr(config, spec.most)}")
        if spec.finite and tensor.size and not bool(np.isfinite(tensor).all()):
            where = _first_not_finite(tensor, keys, key_range, spec)
            raise MessageError(f"{spec.name} must be finite, got NaN or infinity{where}")


def check(
    table: Mapping[str, Schema],
    op: str,
    header: Mapping[str, Any],
    tensors: list[np.ndarray],
    config: JobConfig,
    *,
    rank: int | None = None,
    shard: int | None = None,
    n: int | None = None,
    keys: np.ndarray | None = None,
) -> None:
    """Check a message of kind ``op`` against ``table[op]`` and ``config``; :class:`MessageError` if it fails.

    ``rank``: the receiving server's; ``shard``, ``n`` and ``keys``: for a reply, the request's shard, key count
    and keys (a request names its shard in its header and carries its keys; a value that is not finite is named
    by its key)."""
    schema = table.get(op)
    if schema is None:
        raise MessageError(f"unknown op {op!r}; expected one of {', '.join(sorted(table))}")
    try:
        fields, tensor_specs = dict(schema.fields), schema.tensors
        _check_fields(schema.fields, header, config)
        if schema.variants is not None:
            key, options = schema.variants
            variant = options[header[key]]  # the base fields checked header[key] is one of them
            _check_fields(variant.fields, header, config)
            fields.update(variant.fields)
            tensor_specs = variant.tensors
        unknown = set(header) - set(fields) - _ENVELOPE
        if unknown:
            raise MessageError(f"fields not in the schema: {', '.join(sorted(map(str, unknown)))}")
        if schema.refuse is not None and (reason := schema.refuse(config, header, rank)):
            raise MessageError(reason)
        _check_tensors(tensor_specs, tensors, config, header.get("shard", shard), n, keys)
    except MessageError as exc:
        raise MessageError(f"{op}: {exc}") from None


# --- the tables -------------------------------------------------------------------------------------------------

_REQ = Field("int")
_SHARD = Field("int", high="shards")
_WORKER = Field("int", high="workers")
_COUNT = Field("int")
_KEYS = Tensor("keys", "i8", ("n",), keys=True)
_VALUES = Tensor("values", "f4", ("n", "width"), finite=True)
_ROWS = Tensor("rows", "f4", ("rows", "width"), finite=True)
# what every message between servers carries: the sender's view (layout epoch) and rank
_VIEW = {"epoch": _COUNT, "from": Field("int", high="servers")}


def _replication_off(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    return "" if config.replicas > 1 else "replication is off in this job (replicas=1)"


def _chain_off(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    if config.replicas > 1 and config.replication != "chain":
        return f"chain acknowledgements are not used with replication={config.replication}"
    return _replication_off(config, header, rank)


def _not_primary_backup(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    if config.replicas > 1 and config.replication != "primary_backup":
        return f"a leader's whole state is sent only with replication=primary_backup, not {config.replication}"
    return _replication_off(config, header, rank)


def _no_hot_copy(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    if not config.hot_keys:
        return "hot-key copies are off in this job (hot_keys=0)"
    holders = config.hot_copy_servers(header["shard"])
    if rank is not None and rank not in holders:
        return f"server {rank} holds no copies of shard {header['shard']}'s hot rows (servers {holders} do)"
    return ""


SERVER: dict[str, Schema] = {
    "pull": Schema(
        {
            "req": _REQ,
            "shard": _SHARD,
            "worker": _WORKER,
            "clock": _COUNT,
            "hot_seen": Field("int", high=2, optional=True),
        },
        (Tensor("keys", "i8", ("n",), keys=True, distinct=True),),
    ),
    "push": Schema(
        {"req": _REQ, "shard": _SHARD, "worker": _WORKER, "push_id": _COUNT, "clock": _COUNT}, (_KEYS, _VALUES)
    ),
    "init": Schema({"req": _REQ, "shard": _SHARD}, (_ROWS,)),
    "leave": Schema({"req": _REQ, "shard": _SHARD, "worker": _WORKER}),
    "stats": Schema({"req": _REQ}),
    "dump": Schema({"req": _REQ, "shard": _SHARD}),
    # a replication entry from the predecessor (chain) or the leader (primary_backup), as Entry.header builds it
    "rep": Schema(
        {
            "shard": _SHARD,
            "seq": Field("int", low=1),
            "kind": Field("str", choices=("init", "step")),
            "round": _COUNT,
            "pushes": Field("pushes"),
            **_VIEW,
        },
        variants=(
            "kind",
            {
                "init": Schema({}, (Tensor("keys", "i8", (0,)), _ROWS)),
                "step": Schema({}, (Tensor("keys", "i8", ("n",), keys=True, increasing=True), _VALUES)),
            },
        ),
        refuse=_replication_off,
    ),
    "chain_ack": Schema({"shard": _SHARD, "seq": _COUNT, **_VIEW}, refuse=_chain_off),
    # primary_backup: a new leader's whole state for its followers (dtrain.ps.shard.Snapshot)
    "state": Schema(
        {"shard": _SHARD, "seq": _COUNT, "round": _COUNT, **_VIEW},
        (
            Tensor("weights", "f4", ("*", "width"), finite=True),
            Tensor("optimizer rows", "f4", ("*", "*", "width"), finite=True),
            Tensor("optimizer counts", "i8", ("*", "*")),
            Tensor("progress", "i8", (3, "workers")),
            Tensor("pushes above", "i8", ("*", 2)),
        ),
        refuse=_not_primary_backup,
    ),
    # an owner's hot rows for the servers that hold copies of them (dtrain.ps.hotkeys)
    "hot_update": Schema(
        {"shard": _SHARD, "round": _COUNT, "slowest": _COUNT, **_VIEW},
        (Tensor("keys", "i8", ("n",), keys=True, increasing=True, most="hot_keys"), _VALUES),
        refuse=_no_hot_copy,
    ),
}
"""What a server takes on its ROUTER socket: requests from workers and tools (with ``req``, answered) and
peers' messages (:data:`PEER`)."""

PEER = frozenset({"rep", "chain_ack", "state", "hot_update"})
"""The kinds in :data:`SERVER` that peer servers send: taken only when signed with the job's secret (never with
the key workers hold, :func:`dtrain.ps.wire.worker_key`); never answered, also when they fail. Each carries its
sender's view (``epoch``, the layout it acted in) and rank (``from``), which the receiver checks against its own
view of the shard (:meth:`dtrain.ps.server.Server.handle`)."""

_ROLE = Field("str", choices=("server", "worker"))

_WELCOME = Schema({"role": _ROLE, "rank": Field("int", high="role"), "config": Field("map"), "layout": Field("layout")})
_LAYOUT = Schema({"layout": Field("layout")})

SERVER_CONTROL: dict[str, Schema] = {"welcome": _WELCOME, "layout": _LAYOUT, "stop": Schema({})}
"""What the coordinator sends a server (a ``welcome`` after the first is ignored)."""

WORKER_CONTROL: dict[str, Schema] = {"welcome": _WELCOME, "layout": _LAYOUT}
"""What the coordinator sends a worker."""


def job_config(header: Mapping[str, Any]) -> JobConfig:
    """The job a ``welcome`` hands over, checked before anything else of the welcome is read (its other fields
    are checked against it); :class:`MessageError` if it is not a valid :class:`JobConfig` map."""
    config = header.get("config")
    if not isinstance(config, dict):
        raise MessageError(f"welcome: config must be a map, got {type(config).__name__}")
    try:
        return JobConfig.from_dict(config)
    except (ValueError, TypeError) as exc:
        raise MessageError(f"welcome: config is not a valid job ({_short(str(exc))})") from None


def _needs_endpoint(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    if header["role"] == "server" and not isinstance(header.get("endpoint"), str):
        return "a server registers with its endpoint (a str)"
    if header["role"] == "worker" and "endpoint" in header:
        return "a worker registers without an endpoint"
    return ""


_QUERY = Schema({"req": Field("int", optional=True)})

COORDINATOR: dict[str, Schema] = {
    "register": Schema(
        {"role": _ROLE, "rank": Field("int", high="role"), "endpoint": Field("str", optional=True)},
        refuse=_needs_endpoint,
    ),
    "hb": Schema({"rank": Field("int", high="servers")}),
    "layout?": _QUERY,
    "events": _QUERY,
    "stop": _QUERY,
}
"""What the coordinator takes: registrations, heartbeats, and tools' queries."""

_ERROR = Schema({"code": Field("str", choices=("not_leader", "bad_request")), "error": Field("str")})


def _reply(statuses: dict[str, Schema], refuse: Refusal | None = None) -> Schema:
    return Schema({"req": _REQ, "status": Field("str", choices=tuple(statuses))}, variants=("status", statuses),
                  refuse=refuse)  # fmt: skip


def _hot_advert(config: JobConfig, header: Mapping[str, Any], rank: int | None) -> str:
    """A pull reply names a shard's hot rows with ``hot_version`` and ``hot_servers`` together, in a job with
    hot-key copies only (a worker routes its pulls by them)."""
    fields = [f for f in ("hot_version", "hot_servers") if f in header]
    if not fields:
        return ""
    if not config.hot_keys:
        return f"{fields[0]}: hot-key copies are off in this job (hot_keys=0)"
    if len(fields) == 1:
        return f"{fields[0]} without {'hot_servers' if fields[0] == 'hot_version' else 'hot_version'}: a reply " \
               "names hot rows with both"  # fmt: skip
    return ""


WORKER_REPLIES: dict[str, Schema] = {
    "pull": _reply(
        {
            "ok": Schema(
                {
                    "round": _COUNT,
                    "hot_version": Field("int", optional=True),
                    "hot_servers": Field("ranks", optional=True),
                },
                (
                    Tensor("rows", "f4", ("n", "width"), finite=True),
                    Tensor("hot keys", "i8", ("*",), keys=True, increasing=True, most="hot_keys", optional=True),
                ),
            ),
            "error": _ERROR,
        },
        refuse=_hot_advert,
    ),
    "push": _reply({"applied": Schema({}), "dropped": Schema({}), "folded": Schema({}), "error": _ERROR}),
    "init": _reply({"applied": Schema({}), "error": _ERROR}),
    "leave": _reply({"ok": Schema({}), "error": _ERROR}),
}
"""A server's answer to a worker's request, by the request's op (every one has ``op == "reply"``)."""
