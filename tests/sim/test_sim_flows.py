"""dtrain.sim.flows: max-min fair sharing against hand-worked cases, and the event-driven run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.cluster.topology import Link
from dtrain.sim.flows import FlowNetwork, FlowSpec, max_min_rates, simulate_flows
from tests.sim.test_sim_topologies import GB, chain, star


def link(src: str, dst: str, rate: float) -> Link:
    return Link(src=src, dst=dst, bytes_per_s=rate, latency_s=0.0, kind="test")


def test_two_flows_on_one_link_get_half_each() -> None:
    ab = link("a", "b", 10.0)
    assert max_min_rates([[ab], [ab]]) == [5.0, 5.0]


def test_a_flow_bottlenecked_elsewhere_frees_capacity_for_the_other() -> None:
    ab, bc = link("a", "b", 10.0), link("b", "c", 2.0)
    # flow 0 crosses both links and is held to 2 by b->c; flow 1 takes the 8 left on a->b
    assert max_min_rates([[ab, bc], [ab]]) == pytest.approx([2.0, 8.0])


def test_the_textbook_three_link_example() -> None:
    # Bertsekas-Gallager style: links x (cap 1) and y (cap 1); flow 0 on x and y, flow 1 on x, flow 2 on y,
    # flow 3 on y: y is tightest (1/3 each), then flow 1 gets x's remaining 2/3
    x, y = link("a", "b", 1.0), link("b", "c", 1.0)
    assert max_min_rates([[x, y], [x], [y], [y]]) == pytest.approx([1 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_a_flow_cap_limits_one_flow_and_the_rest_share_the_remainder() -> None:
    ab = link("a", "b", 10.0)
    assert max_min_rates([[ab], [ab]], [1.0, None]) == pytest.approx([1.0, 9.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True), min_size=1, max_size=6))
def test_max_min_rates_are_feasible_and_every_flow_has_a_saturated_bottleneck(paths_idx: list[list[int]]) -> None:
    links = [link(f"n{i}", f"n{i + 1}", float(i + 1)) for i in range(4)]
    paths = [[links[i] for i in p] for p in paths_idx]
    rates = max_min_rates(paths)
    load = {i: sum(r for r, p in zip(rates, paths_idx, strict=True) if i in p) for i in range(4)}
    assert all(load[i] <= links[i].bytes_per_s * (1 + 1e-9) for i in range(4))
    for rate, p in zip(rates, paths_idx, strict=True):
        # max-min: some link of the flow is full and no flow on it gets more than this one
        assert any(
            load[i] >= links[i].bytes_per_s * (1 - 1e-9)
            and all(r <= rate * (1 + 1e-9) for r, q in zip(rates, paths_idx, strict=True) if i in q)
            for i in p
        )


def test_a_lone_flow_takes_size_over_rate_plus_path_latency() -> None:
    topo = star(2, bytes_per_s=10 * GB, latency_s=1e-6)
    finish, _ = simulate_flows(topo, [FlowSpec(src="g0", dst="g1", nbytes=10 * GB)])
    assert finish == [pytest.approx(1.0 + 2e-6)]


def test_when_one_flow_ends_the_other_speeds_up() -> None:
    topo = chain("a", "b", bytes_per_s=10.0)
    flows = [FlowSpec(src="a", dst="b", nbytes=10.0), FlowSpec(src="a", dst="b", nbytes=30.0, flow_id=1)]
    finish, _ = simulate_flows(topo, flows)
    # both at 5/s until the short one ends at t=2 (10 bytes), then 20 bytes left at 10/s: t=4
    assert finish == pytest.approx([2.0, 4.0])


def test_a_late_flow_shares_from_when_it_starts() -> None:
    topo = chain("a", "b", bytes_per_s=10.0)
    flows = [FlowSpec(src="a", dst="b", nbytes=20.0), FlowSpec(src="a", dst="b", nbytes=5.0, start_s=1.0)]
    finish, _ = simulate_flows(topo, flows)
    # first alone 1 s (10 bytes), then 5/s each: the late one needs 1 s, then the first's 5 left at 10/s
    assert finish == pytest.approx([2.5, 2.0])


def test_opposite_directions_do_not_share_a_duplex_link() -> None:
    topo = chain("a", "b", bytes_per_s=10.0)
    finish, _ = simulate_flows(topo, [FlowSpec(src="a", dst="b", nbytes=10.0), FlowSpec(src="b", dst="a", nbytes=10.0)])
    assert finish == pytest.approx([1.0, 1.0])


def test_incast_into_one_device_shares_its_downlink() -> None:
    topo = star(4, bytes_per_s=10.0)
    flows = [FlowSpec(src=f"g{i}", dst="g0", nbytes=10.0, flow_id=i) for i in (1, 2, 3)]
    finish, usage = simulate_flows(topo, flows)
    assert finish == pytest.approx([3.0, 3.0, 3.0])
    assert usage[0].link.name == "sw->g0" and usage[0].utilisation == pytest.approx(1.0)


def test_link_usage_counts_bytes_and_busy_time() -> None:
    topo = chain("a", "b", "c", bytes_per_s=10.0)
    flows = [FlowSpec(src="a", dst="c", nbytes=10.0), FlowSpec(src="a", dst="b", nbytes=10.0, start_s=1.0)]
    _, usage = simulate_flows(topo, flows)
    by_name = {u.link.name: u for u in usage}
    assert by_name["a->b"].nbytes == 20.0 and by_name["a->b"].busy_s == pytest.approx(2.0)
    assert by_name["b->c"].utilisation == pytest.approx(10.0 / (2.0 * 10.0))


def test_timers_and_flows_interleave_in_time_order() -> None:
    net = FlowNetwork(chain("a", "b", bytes_per_s=1.0))
    seen: list[tuple[str, float]] = []
    net.at(0.5, lambda: seen.append(("timer", net.now)))
    net.send("a", "b", 1.0, on_done=lambda t: seen.append(("flow", t)))
    assert net.run() == pytest.approx(1.0)
    assert seen == [("timer", 0.5), ("flow", pytest.approx(1.0))]


def test_bad_flow_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        FlowSpec(src="a", dst="b", nbytes=-1)
