"""dtrain.sim.fit: the fits recover known software costs and link rates from timings made with them."""

from __future__ import annotations

import pytest

from dtrain.sim.collective import SoftwareCost, replay
from dtrain.sim.fit import Measurement, fit_link_rate, fit_message_cap, fit_software, simulate_measurement
from tests.sim.test_sim_topologies import GB, star

TRUE = SoftwareCost(call_s=15e-6, alpha_s=60e-6, alpha_peer_s=20e-6, gamma_s_per_byte=1e-12)
CASES = [("all_reduce", a) for a in ("ring", "tree", "direct", "halving_doubling")] + [("all_to_all", "direct")]


def timed(nbytes: int, rate: float, cost: SoftwareCost) -> list[Measurement]:
    """Measurements whose times come from the given truth (a synthetic machine)."""
    shape = [Measurement(collective=c, algorithm=a, nbytes=nbytes, world_size=4, seconds=1.0) for c, a in CASES]
    topo = star(4, bytes_per_s=rate)
    return [
        Measurement(
            collective=m.collective,
            algorithm=m.algorithm,
            nbytes=nbytes,
            world_size=4,
            seconds=simulate_measurement(m, topo, cost),
        )
        for m in shape
    ]


def test_fit_software_recovers_the_start_up_costs_from_small_messages() -> None:
    small = timed(4096, 100 * GB, TRUE)
    fitted = fit_software(small, star(4, bytes_per_s=100 * GB), SoftwareCost(gamma_s_per_byte=1e-12))
    assert fitted.call_s == pytest.approx(TRUE.call_s, rel=0.05, abs=1e-6)
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.02)
    assert fitted.alpha_peer_s == pytest.approx(TRUE.alpha_peer_s, rel=0.05)


def test_fit_link_rate_recovers_the_rate_from_large_messages() -> None:
    large = timed(256 * 2**20, 40 * GB, TRUE)
    assert fit_link_rate(large, lambda rate: star(4, bytes_per_s=rate), TRUE) == pytest.approx(40 * GB, rel=1e-3)


def test_a_measurement_needs_a_positive_time() -> None:
    with pytest.raises(ValueError, match="seconds must be > 0"):
        Measurement(collective="all_reduce", algorithm="ring", nbytes=4, world_size=2, seconds=0.0)


def test_fit_message_cap_finds_the_size_where_messages_speed_up() -> None:
    truth = SoftwareCost(message_caps=((2.0**24, 10 * GB),))  # messages up to 16 MiB at 10 GB/s, larger free
    measured = [m for n in (2**24, 2**26) for m in timed(n, 40 * GB, truth)]
    candidates = [2.0**k for k in (22, 24, 26)]
    threshold, cap = fit_message_cap(measured, star(4, bytes_per_s=40 * GB), SoftwareCost(), thresholds=candidates)
    # the buffers' messages run from 4 MiB (ring, direct on 16 MiB) to 64 MiB (tree on 64 MiB): only a
    # threshold of 16 MiB caps exactly the messages the truth caps
    assert threshold == 2**24
    assert cap == pytest.approx(10 * GB, rel=1e-3)


def test_a_message_takes_the_first_cap_it_fits() -> None:
    cost = SoftwareCost(flow_cap_bytes_per_s=5.0, message_caps=((10.0, 1.0), (100.0, 2.0)))
    assert [cost.cap_for(n) for n in (1, 10, 11, 100, 1000)] == [1.0, 1.0, 2.0, 2.0, 5.0]
    with pytest.raises(ValueError, match="ascending"):
        SoftwareCost(message_caps=((100.0, 1.0), (10.0, 2.0)))


def test_a_measured_call_is_simulated_with_the_api_s_operations_around_its_schedule() -> None:
    m = Measurement(collective="reduce_scatter", algorithm="ring", nbytes=1 << 20, world_size=4, seconds=1.0)
    topo = star(4, bytes_per_s=10e9)
    cost = SoftwareCost(alpha_s=20e-6, launch_s=5e-6, copy_s_per_byte=1e-12)
    alone = replay(m.schedule(), m.nbytes, topo, cost=cost).time_s
    # the input cloned before, the rank's block copied out after
    assert simulate_measurement(m, topo, cost) == pytest.approx(alone + 2 * 5e-6 + (1 + 1 / 4) * (1 << 20) * 1e-12)
