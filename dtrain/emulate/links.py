"""Veth pairs, bridges and rate limits (tc tbf) inside namespaces.

A veth pair is a cable; tc shapes what a veth end *sends*, so a duplex link gets a token bucket on each end,
each at its direction's rate (tc-tbf(8)). The bucket (``burst``) holds a few milliseconds of traffic, at least
64 KiB: veths hand the qdisc segments of up to 64 KiB (GSO), and a bucket smaller than a segment makes tbf
split or drop it. The queue (``latency``) holds 10 ms beyond the bucket: at these rates that is far more than a
bandwidth-delay product (TCP keeps the link busy), and shallow, as data-centre switch buffers are, so the ACKs
and Gloo's small control messages that share a direction with bulk data wait milliseconds, not a deep
queue's tens of them. (No fq_codel/sfq on these kernels: only tbf, htb and fifos, so no per-flow queues.)
"""

from __future__ import annotations

from dtrain.emulate.netns import ip, run_tool

__all__ = ["add_bridge", "add_veth", "attach", "set_address", "limit_rate", "tbf_args"]

_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 0.004
_QUEUE_LATENCY_MS = 10


def add_bridge(namespace: str, name: str) -> None:
    """A Linux bridge (no STP: the plan has no loops) that forwards from the moment its ports are up."""
    ip("link", "add", "name", name, "type", "bridge", "stp_state", "0", "forward_delay", "0", namespace=namespace)
    ip("link", "set", name, "up", namespace=namespace)


def add_veth(ns_a: str, end_a: str, ns_b: str, end_b: str) -> None:
    """A veth pair with ``end_a`` in ``ns_a`` and ``end_b`` in ``ns_b``, both up (never in the host's)."""
    ip("link", "add", end_a, "type", "veth", "peer", "name", end_b, "netns", ns_b, namespace=ns_a)
    ip("link", "set", end_a, "up", namespace=ns_a)
    ip("link", "set", end_b, "up", namespace=ns_b)


def attach(namespace: str, port: str, bridge: str) -> None:
    ip("link", "set", port, "master", bridge, namespace=namespace)


def set_address(namespace: str, interface: str, cidr: str) -> None:
    ip("addr", "add", cidr, "dev", interface, namespace=namespace)


def tbf_args(bit_per_s: float) -> list[str]:
    """tc's words for a token bucket at ``bit_per_s``: rate, bucket (bytes) and queue (ms)."""
    burst = max(_MIN_BURST_BYTES, int(bit_per_s / 8 * _BURST_SECONDS))
    return ["tbf", "rate", f"{int(bit_per_s)}bit", "burst", str(burst), "latency", f"{_QUEUE_LATENCY_MS}ms"]


def limit_rate(namespace: str, interface: str, bit_per_s: float) -> None:
    """Shape what ``interface`` sends to ``bit_per_s`` (replacing any root qdisc it had)."""
    run_tool(["tc", "-n", namespace, "qdisc", "replace", "dev", interface, "root", *tbf_args(bit_per_s)])
