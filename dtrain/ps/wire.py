"""The parameter server's wire format: a msgpack header, raw tensor frames and an HMAC, over ZeroMQ.

A message is a ZeroMQ multipart message ``[header, tensor_0, ..., tensor_{n-1}, mac]``:

- ``header`` is a msgpack map with at least ``"op"`` (str) and ``"t"``, the list of ``[dtype, shape]`` of the
  tensor frames that follow (msgpack, like ps-lite's small meta header beside its raw ``SArray`` data);
- each tensor frame is the tensor's raw little-endian bytes, nothing else: it is turned into a NumPy array with
  ``np.frombuffer`` and never unpickled;
- ``mac`` is the signing key's 8-byte id (:func:`key_id`, a hash of the key that says which key to check
  with and nothing about the key) followed by HMAC-SHA256 (RFC 2104) over every frame, each prefixed by its
  length, keyed by that key.

Keys: the job's secret (:func:`local_secret` for one machine, ``DTRAIN_PS_SECRET`` on a cluster) signs what
the coordinator, the servers and tools send; workers are given only :func:`worker_key` of it, from which the
secret cannot be recovered. A receiver that holds both learns from :attr:`Message.key` which one signed a
message, so a server takes replication traffic only from holders of the job's secret, never from a worker.

Every header also carries a send time ``"ts"`` and a random ``"nonce"``; a receiver with a :class:`ReplayGuard`
refuses a message whose time is more than ``window_s`` off its own clock or whose nonce it has already seen in
that window, so a captured message cannot be played again (hosts' clocks must agree to well within the window).

:func:`decode` checks, in this order and before any payload is interpreted: the frame count, the header and
total sizes, the MAC, the header's schema (op name, send time and nonce, ``[dtype, shape]`` entries with each
part's type checked before it is used, dtype names from a fixed list, shapes of at most ``max_ndim``
non-negative ints), and that each frame holds exactly ``prod(shape) * itemsize`` bytes. Any failure, whatever
the header holds, is a :class:`WireError`; a server drops that message and goes on serving. What a decoded
message says is checked next, against its kind's schema and the job's configuration (:mod:`dtrain.ps.messages`).
:func:`oversize` lets a sender see that a message would be refused for its size before sending it. Sockets
also carry ZeroMQ's ``MAXMSGSIZE``, which bounds each *frame*: a peer that sends a larger frame is disconnected
by the transport before the bytes reach Python. The number of frames is checked only once ZeroMQ has received
the whole multipart message, and the receive queue holds at most ``RCVHWM`` messages a peer, so a process that
can reach the port but lacks the secret can still make a server buffer up to ``RCVHWM x frames x MAXMSGSIZE``
bytes before the MAC rejects them. Keep the servers on loopback or a private network (the default binds
loopback); ZeroMQ's CURVE would authenticate connections before any message is buffered, and is not used here.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np
import zmq

from dtrain.env import PS_SECRET, PsEnv

__all__ = [
    "DTYPES",
    "Limits",
    "Message",
    "ReplayGuard",
    "WireError",
    "decode",
    "encode",
    "local_secret",
    "key_id",
    "oversize",
    "secret_from_env",
    "worker_key",
    "configure_socket",
]

# The only dtypes a message may carry: what keys, values and counters need; no object dtype, ever.
DTYPES = {"f4": np.float32, "f8": np.float64, "i8": np.int64, "i4": np.int32, "u8": np.uint64, "f2": np.float16}
_NAMES = {np.dtype(t): name for name, t in DTYPES.items()}
MAC_BYTES = hashlib.sha256().digest_size
KEY_ID_BYTES = 8
SECRET_ENV = PS_SECRET


class WireError(ValueError):
    """A message that is malformed, too large, truncated or not authenticated by the shared secret."""


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts. The defaults allow a 256 MiB message of at most 16 tensors."""

    max_message_bytes: int = 256 << 20
    max_header_bytes: int = 64 << 10
    max_tensors: int = 16
    max_ndim: int = 4


@dataclass
class Message:
    """A decoded message: its header (a dict, ``"t"`` removed), its tensors (read-only NumPy views) and the key
    that signed it (one of those :func:`decode` was given; an answer is signed with the same key)."""

    header: dict[str, Any]
    tensors: list[np.ndarray] = field(default_factory=list)
    key: bytes = field(default=b"", repr=False)

    @property
    def op(self) -> str:
        return self.header["op"]


class ReplayGuard:
    """Remembers the nonces of the last ``window_s`` seconds; :meth:`check` refuses stale or repeated ones."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.seen: dict[int, float] = {}
        self._next_prune = 0.0

    def check(self, header: dict[str, Any]) -> None:
        ts, nonce, now = header.get("ts"), header.get("nonce"), time.time()
        if type(ts) is not float or type(nonce) is not int:
            raise WireError("header lacks its send time 'ts' (float) and 'nonce' (int)")
        if not abs(now - ts) <= self.window_s:  # also a NaN time
            raise WireError(f"message sent {now - ts:.1f} s from now, outside the {self.window_s} s replay window")
        if nonce in self.seen:
            raise WireError("message replayed: its nonce was already seen")
        self.seen[nonce] = ts
        if now >= self._next_prune:
            self.seen = {n: t for n, t in self.seen.items() if now - t <= self.window_s}
            self._next_prune = now + self.window_s / 4


def local_secret() -> bytes:
    """A fresh 32-byte secret for a job on one machine (its processes get it through the environment)."""
    return secrets.token_bytes(32)


def worker_key(secret: bytes) -> bytes:
    """The key a worker is given: HMAC-SHA256 of the job's ``secret`` over a fixed label. It signs requests to
    servers and the coordinator; it cannot sign what servers send each other, and it does not give the secret."""
    return hmac.new(secret, b"dtrain.ps worker key", hashlib.sha256).digest()


@lru_cache(maxsize=64)
def key_id(key: bytes) -> bytes:
    """The 8 bytes in front of a message's MAC that say which key signed it (a hash: it does not reveal the key)."""
    return hashlib.sha256(b"dtrain.ps key id\0" + key).digest()[:KEY_ID_BYTES]


def secret_from_env() -> bytes:
    """The job's secret from ``DTRAIN_PS_SECRET`` (hex); a clear error when it is missing or short."""
    return PsEnv.from_env().need("secret")


_RECEIVE_QUEUE_MESSAGES = 1000


def configure_socket(sock: zmq.Socket, limits: Limits = Limits()) -> zmq.Socket:
    """Bound what ZeroMQ accepts on ``sock`` and never block at close on unsent messages."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + limits.max_header_bytes + 4096)  # a frame's bound
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    # What a peer can make us buffer before decode() sees it is RCVHWM whole messages (see the module docstring);
    # a sender past it blocks, nothing is lost.
    sock.setsockopt(zmq.RCVHWM, _RECEIVE_QUEUE_MESSAGES)
    return sock


def _hmac(secret: bytes, frames: Sequence[bytes | memoryview]) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.digest()


def _mac(secret: bytes, frames: Sequence[bytes | memoryview]) -> bytes:
    """The last frame of a message signed by ``secret``: its key id, then the HMAC."""
    return key_id(secret) + _hmac(secret, frames)


def oversize(frames: Sequence, limits: Limits = Limits()) -> str:
    """Why a receiver with ``limits`` would refuse these encoded frames for their size, or ``""`` if they fit:
    a sender checks its answer with this, so that an answer too large becomes an error, not a silence."""
    header, total = len(frames[0]), sum(len(f) for f in frames)
    if header > limits.max_header_bytes:
        return f"its header of {header} bytes is over the {limits.max_header_bytes} bytes a header may take"
    if total > limits.max_message_bytes:
        return f"{total} bytes, over the {limits.max_message_bytes} bytes a message may carry"
    return ""


def encode(secret: bytes, header: dict[str, Any], tensors: Sequence[np.ndarray] = ()) -> list:
    """The frames of one message. Tensors are sent as their raw bytes (made contiguous if they are not)."""
    if "op" not in header or not isinstance(header["op"], str):
        raise ValueError(f"a message header needs a str 'op', got {header.get('op')!r}")
    arrays = [np.require(t, requirements="C") for t in tensors]  # (ascontiguousarray makes 0-d into 1-d)
    meta = []
    for a in arrays:
        if a.dtype not in _NAMES:
            raise ValueError(f"dtype {a.dtype} cannot go on the wire; use one of {sorted(DTYPES)}")
        meta.append([_NAMES[a.dtype], list(a.shape)])
    stamp = {"ts": time.time(), "nonce": secrets.randbits(63)}
    head = msgpack.packb({**header, **stamp, "t": meta}, use_bin_type=True)
    frames = [head, *(memoryview(a.reshape(-1)).cast("B") if a.size else b"" for a in arrays)]
    return [*frames, _mac(secret, frames)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_meta(meta: Any, payload: Sequence[memoryview], limits: Limits) -> list[tuple[np.dtype, tuple]]:
    if not isinstance(meta, list) or len(meta) != len(payload):
        listed = len(meta) if isinstance(meta, list) else _short(meta)
        raise WireError(f"header lists {listed} tensors, got {len(payload)}")
    out = []
    for i, (entry, frame) in enumerate(zip(meta, payload, strict=True)):
        # each part's type first: a list where a name goes is unhashable, and must be refused, not raise
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is str and entry[0] in DTYPES
                and isinstance(entry[1], list)):  # fmt: skip
            raise WireError(f"tensor {i}: bad [dtype, shape] entry {_short(entry)}")
        shape = entry[1]
        if len(shape) > limits.max_ndim or not all(type(d) is int and d >= 0 for d in shape):
            raise WireError(f"tensor {i}: bad shape {_short(shape)} (at most {limits.max_ndim} non-negative ints)")
        dtype = np.dtype(DTYPES[entry[0]])
        expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap around to a match
        if expected != len(frame):
            raise WireError(f"tensor {i}: {entry[0]}{shape} needs {expected} bytes, the frame holds {len(frame)}")
        out.append((dtype, tuple(shape)))
    return out


def decode(keys: bytes | Sequence[bytes], frames: Sequence, limits: Limits = Limits(),
           guard: ReplayGuard | None = None) -> Message:  # fmt: skip
    """Check and decode a received multipart message (bytes or ``zmq.Frame`` parts) signed by one of ``keys`` (a
    key or several); :class:`WireError` if bad (with ``guard``, also if it is stale or a replay), and never any
    other exception."""
    try:
        return _decode([keys] if isinstance(keys, bytes) else keys, frames, limits, guard)
    except WireError:
        raise
    except Exception as exc:  # every check above should have caught it; still a bad message, never a crash
        raise WireError(f"malformed message ({type(exc).__name__}: {_short(str(exc))})") from None


def _decode(keys: Sequence[bytes], frames: Sequence, limits: Limits, guard: ReplayGuard | None) -> Message:
    views = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames]
    if not 2 <= len(views) <= limits.max_tensors + 2:
        raise WireError(f"a message has 2 to {limits.max_tensors + 2} frames, got {len(views)}")
    if len(views[0]) > limits.max_header_bytes:
        raise WireError(f"header of {len(views[0])} bytes is over the limit of {limits.max_header_bytes}")
    total = sum(len(v) for v in views)
    if total > limits.max_message_bytes:
        raise WireError(f"message of {total} bytes is over the limit of {limits.max_message_bytes}")
    trailer = bytes(views[-1])
    key = next((k for k in keys if key_id(k) == trailer[:KEY_ID_BYTES]), None)
    if key is None or not hmac.compare_digest(trailer[KEY_ID_BYTES:], _hmac(key, views[:-1])):
        raise WireError("message not authenticated: its HMAC does not match a key of this job that it may use")
    try:
        header = msgpack.unpackb(views[0], raw=False, strict_map_key=True)  # size already bounded above
    except Exception as exc:  # msgpack raises several types on bad input; all mean the same here
        raise WireError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise WireError(f"header must be a map with a str 'op', got {type(header).__name__}")
    if guard is not None:
        guard.check(header)
    payload = views[1:-1]
    meta = _check_meta(header.pop("t", None), payload, limits)
    try:
        tensors = [np.frombuffer(v, dtype=d).reshape(s) for v, (d, s) in zip(payload, meta, strict=True)]
    except ValueError as exc:  # sizes were checked above; anything numpy still refuses is a bad message too
        raise WireError(f"tensor frames do not match their header: {exc}") from None
    return Message(header=header, tensors=tensors, key=key)
