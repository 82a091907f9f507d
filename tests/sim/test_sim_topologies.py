"""Small topologies for the simulator's tests, built through the Topology API."""

from __future__ import annotations

from dtrain.cluster.topology import Device, Topology

GB = 1e9


def device(name: str, server: str, *, memory_bytes_per_s: float = 2e12, rack: str | None = None) -> Device:
    return Device(
        name=name,
        server=server,
        rack=rack,
        peak_flops=1e15,
        memory_bytes=80 * 2**30,
        memory_bytes_per_s=memory_bytes_per_s,
    )


def star(n: int, *, bytes_per_s: float = 10 * GB, latency_s: float = 0.0, memory_bytes_per_s: float = 2e12) -> Topology:
    """``n`` devices on one non-blocking switch, every link alike (the uniform network of the closed forms)."""
    topo = Topology(f"star{n}")
    topo.add_node("sw", kind="switch")
    for i in range(n):
        topo.add_device(device(f"g{i}", f"s{i}", memory_bytes_per_s=memory_bytes_per_s))
        topo.add_link(f"g{i}", "sw", bytes_per_s=bytes_per_s, latency_s=latency_s, kind="test")
    return topo


def chain(*names: str, bytes_per_s: float = 10 * GB) -> Topology:
    """Switches in a line, a-b-c-..., equal links: for hand-worked sharing cases."""
    topo = Topology("chain")
    for name in names:
        topo.add_node(name, kind="switch")
    for a, b in zip(names, names[1:], strict=False):
        topo.add_link(a, b, bytes_per_s=bytes_per_s, latency_s=0.0, kind="test")
    return topo


def test_the_star_is_a_valid_uniform_network() -> None:
    topo = star(4)
    topo.validate()
    assert {link.bytes_per_s for link in topo.links()} == {10 * GB}
    assert len(topo.route("g0", "g3")) == 2
