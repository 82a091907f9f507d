"""Build an :class:`~dtrain.emulate.plan.EmulationPlan` on this host and tear it down, also on failure.

:class:`Emulation` is a context manager: entering builds the namespaces (routers' too, on a routed fabric),
bridges, veths, token buckets and routes; leaving (normally, on an exception, on Ctrl-C or on SIGTERM, which it
turns into an exception while it is active) stops what still runs in its namespaces and deletes them, which
removes every veth and bridge inside.
:func:`teardown_leftovers` is ``dtrain emulate down``: it removes every namespace whose name starts with the
prefix, for what a killed process left behind.
"""

from __future__ import annotations

import signal
import threading
import types

from dtrain.emulate import links, netns
from dtrain.emulate.plan import PREFIX, SERVER_INTERFACE, EmulationPlan

__all__ = ["Emulation", "Terminated", "build", "teardown", "teardown_leftovers", "SERVER_INTERFACE"]


def build(plan: EmulationPlan) -> None:
    """Create everything ``plan`` names. On a failure half-way the caller tears down (see :class:`Emulation`)."""
    netns.require_root()
    _refuse_clash(plan)
    if plan.fabric_kind == "routed":
        _build_routers(plan)
    else:
        _build_bridges(plan)
    for server in plan.servers:
        netns.create(server.namespace)
        links.add_veth(server.namespace, SERVER_INTERFACE, server.switch_namespace, server.port)
        links.attach(server.switch_namespace, server.port, server.bridge)
        links.set_address(server.namespace, SERVER_INTERFACE, f"{server.ip}/{server.address_bits}")
        links.limit_rate(server.namespace, SERVER_INTERFACE, server.up_bit_per_s)
        links.limit_rate(server.switch_namespace, server.port, server.down_bit_per_s)
    for route in plan.routes:  # after every address and link is up: a nexthop must be reachable when added
        netns.ip("route", "add", *route.ip_args(), namespace=route.namespace)


def _build_bridges(plan: EmulationPlan) -> None:
    """One fabric namespace holding a bridge per (merged) switch, joined by shaped veths."""
    netns.create(plan.fabric)
    for bridge in plan.bridges:
        links.add_bridge(plan.fabric, bridge)
    for link in plan.switch_links:
        links.add_veth(plan.fabric, link.a_end, plan.fabric, link.b_end)
        links.attach(plan.fabric, link.a_end, link.a)
        links.attach(plan.fabric, link.b_end, link.b)
        links.limit_rate(plan.fabric, link.a_end, link.a_to_b_bit_per_s)
        links.limit_rate(plan.fabric, link.b_end, link.b_to_a_bit_per_s)


def _build_routers(plan: EmulationPlan) -> None:
    """A namespace per ToR and spine, forwarding with the plan's sysctls (set before any interface exists, so
    every interface inherits the defaults), each ToR with its servers' bridge; a shaped veth per ToR-spine link."""
    for router in plan.routers:
        netns.create(router.namespace)
        for key, value in router.sysctls.items():
            netns.set_sysctl(router.namespace, key, value)
        if router.bridge is not None:
            links.add_bridge(router.namespace, router.bridge)
            links.set_address(router.namespace, router.bridge, f"{router.gateway}/32")
    for link in plan.router_links:
        links.add_veth(link.tor_namespace, link.tor_end, link.spine_namespace, link.spine_end)
        links.set_address(link.tor_namespace, link.tor_end, f"{link.tor_ip}/31")
        links.set_address(link.spine_namespace, link.spine_end, f"{link.spine_ip}/31")
        links.limit_rate(link.tor_namespace, link.tor_end, link.up_bit_per_s)
        links.limit_rate(link.spine_namespace, link.spine_end, link.down_bit_per_s)


def _refuse_clash(plan: EmulationPlan) -> None:
    clash = [n for n in plan.namespaces if netns.exists(n)]
    if clash:
        raise netns.EmulationError(
            f"namespaces {clash} exist already (another emulation with tag {plan.tag!r}?); pick another tag or "
            f"remove them with `dtrain emulate down --tag {plan.tag}`"
        )


def teardown(plan: EmulationPlan) -> None:
    """Remove the plan's namespaces (servers first, then the fabric); missing ones are fine."""
    for namespace in reversed(plan.namespaces):
        netns.delete(namespace)


def teardown_leftovers(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (which must start with ``dte-``); their names."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r} (the emulator's own names), got {prefix!r}")
    netns.require_root()
    names = netns.list_namespaces(prefix)
    for name in sorted(names, key=lambda n: not _is_server(n)):  # servers before fabrics and routers
        netns.delete(name)
    return names


def _is_server(namespace: str) -> bool:
    return namespace.rsplit("-", 1)[-1].startswith("s")


class Terminated(BaseException):
    """SIGTERM while an emulation is up: unwinds like Ctrl-C so the teardown runs; ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class Emulation:
    """``with Emulation(plan) as plan: ...``: the plan built on entry, removed on any exit, unless :meth:`keep` was
    called inside and the block ends normally (``dtrain emulate up``: built, checked and left up)."""

    def __init__(self, plan: EmulationPlan) -> None:
        self.plan = plan
        self._previous: object = None
        self._kept = False

    def keep(self) -> None:
        """Leave the emulation up when the block ends without an exception."""
        self._kept = True

    def __enter__(self) -> EmulationPlan:
        netns.require_root()
        _refuse_clash(plan=self.plan)  # before anything is ours to tear down: those namespaces belong to another
        if _main_thread():  # signal handlers can only be set there
            self._previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            build(self.plan)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.plan

    def __exit__(self, kind: type | None, error: BaseException | None, tb: types.TracebackType | None) -> None:
        if not _main_thread():
            if not (self._kept and kind is None):
                teardown(self.plan)
            return
        # Ctrl-C or SIGTERM during the teardown must not leave half of it behind: both are ignored until it is done.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        previous_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if not (self._kept and kind is None):
                teardown(self.plan)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            if previous_term is _raise_terminated:  # ours, from __enter__: give back what was there before
                previous_term = self._previous
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_term is None else previous_term)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum: int, frame: types.FrameType | None) -> None:
    raise Terminated(signum)
