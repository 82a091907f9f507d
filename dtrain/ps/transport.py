"""A ZeroMQ DEALER to one peer, speaking :mod:`dtrain.ps.wire`: what servers and workers use to send.

Waits are bounded: :func:`await_message` raises :class:`PSTimeoutError` naming the peer and its address, so a
peer that never answers is reported, never waited on forever.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import zmq

from dtrain.ps import wire

__all__ = ["Endpoint", "PSError", "PSTimeoutError", "await_message"]


class PSError(RuntimeError):
    """A peer refused a request or sent something malformed (the message names the peer and the problem)."""


class PSTimeoutError(TimeoutError):
    """A peer of the parameter server did not answer in time; the message names it and its address."""


class Endpoint:
    """A DEALER socket connected to ``address``; ``name`` (e.g. ``"server 2"``) is used in errors."""

    def __init__(self, ctx: zmq.Context, address: str, secret: bytes, name: str) -> None:
        self.address, self.secret, self.name = address, secret, name
        self.sock = wire.configure_socket(ctx.socket(zmq.DEALER))
        self.sock.connect(address)
        self.rejected = 0
        self.guard = wire.ReplayGuard()

    def send(self, header: dict, tensors: Sequence[np.ndarray] = ()) -> None:
        self.sock.send_multipart(wire.encode(self.secret, header, tensors), copy=False)

    def try_recv(self) -> wire.Message | None:
        """The next authenticated message, or ``None`` when none is waiting (bad ones are counted, skipped:
        :func:`~dtrain.ps.wire.decode` raises nothing but :class:`~dtrain.ps.wire.WireError`)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            try:
                return wire.decode(self.secret, frames, guard=self.guard)
            except wire.WireError:
                self.rejected += 1

    def close(self) -> None:
        self.sock.close(linger=0)


def await_message(endpoint: Endpoint, op: str, timeout_s: float) -> wire.Message:
    """Block until ``endpoint`` delivers a message with ``op`` (others are skipped), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if endpoint.sock.poll(timeout=max(1, int(left * 1000)), flags=zmq.POLLIN):
            msg = endpoint.try_recv()
            if msg is not None and msg.op == op:
                return msg
    raise PSTimeoutError(f"no {op!r} from {endpoint.name} at {endpoint.address} within {timeout_s:.1f} s")
