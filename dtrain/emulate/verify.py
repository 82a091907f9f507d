"""Check a built emulation before trusting it: every server reaches server 0 (on a routed fabric every server
reaches every other, since each pair has routes of its own in several namespaces), and one path between the
first and the last rack carries its configured rate (the smallest shaped rate along it) within a tolerance."""

from __future__ import annotations

import statistics

from dtrain.emulate.netns import EmulationError
from dtrain.emulate.plan import EmulationPlan, path_bit_per_s
from dtrain.emulate.probe import ping, throughput_bit_per_s

__all__ = ["verify"]


def verify(plan: EmulationPlan, *, tolerance: float = 0.15, seconds: float = 1.5) -> dict:
    """Ping every server from server 0 (routed: every server from every other) and measure the path from server 0
    to the last server, up to three times while its rate reads low; the results (round-trip times keyed by the
    destination, or routed by ``"src->dst"``). Raises :class:`EmulationError` if a server is unreachable or the
    rate is off by more than ``tolerance``."""
    first = plan.servers[0]
    rtts = {}
    if plan.fabric_kind == "routed":
        for a in plan.servers:
            for b in plan.servers:
                if a is not b:
                    rtts[f"{a.server}->{b.server}"] = statistics.median(ping(a.namespace, b.namespace, b.ip))
    else:
        for server in plan.servers[1:]:
            rtts[server.server] = statistics.median(ping(first.namespace, server.namespace, server.ip))
    last = len(plan.servers) - 1
    result = {"median_rtt_s": rtts, "path": f"{first.server}->{plan.servers[last].server}"}
    if last > 0:
        expected = path_bit_per_s(plan, 0, last)
        measured = throughput_bit_per_s(first.namespace, plan.servers[last].namespace, plan.servers[last].ip,
                                        seconds=seconds, attempts=3, at_least=expected * (1 - tolerance))  # fmt: skip
        result |= {"configured_bit_per_s": expected, "measured_bit_per_s": measured}
        if abs(measured / expected - 1) > tolerance:
            raise EmulationError(
                f"path {result['path']} carries {measured / 1e6:.1f} Mbit/s, configured {expected / 1e6:.1f} "
                f"Mbit/s (off by more than {tolerance:.0%}): the host may be too busy for this --scale"
            )
    return result
