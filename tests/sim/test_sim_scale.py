"""Cluster-scale simulation: replaying independent and identical parts apart and once gives what the full
replay gives; rail NIC affinity; split pipeline sends; the rail-optimised builder."""

from __future__ import annotations

import pytest

from dtrain.cluster.builders import ClusterSpec, build
from dtrain.cluster.presets import DGX_A100, H100_NODE, preset
from dtrain.comm.ir.algorithms import build as build_schedule
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.classes import replay_jobs
from dtrain.sim.collective import Job, replay_concurrent
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import group, place
from dtrain.sim.step import StepConfig, simulate_step
from dtrain.sim.traffic import simulate_traffic

SMALL = MODELS["llama-7b"]


def _same(a, b) -> None:
    assert a.time_s == pytest.approx(b.time_s, rel=1e-9)
    assert a.rank_finish_s == pytest.approx(b.rank_finish_s, rel=1e-9)
    bytes_a = {u.link.name: u.nbytes for u in a.links}
    bytes_b = {u.link.name: u.nbytes for u in b.links}
    assert bytes_a.keys() == bytes_b.keys()
    assert [bytes_a[k] for k in sorted(bytes_a)] == pytest.approx([bytes_b[k] for k in sorted(bytes_b)], rel=1e-9)


@pytest.mark.parametrize(
    ("topology", "layout", "how"),
    [
        (preset("4-rack"), Layout(dp=4, tp=8, pp=2, global_batch=8), "aware"),
        (preset("4-rack"), Layout(dp=4, tp=4, pp=2, global_batch=8), "oblivious"),
        (preset("h100-rail", racks=2, servers_per_rack=8), Layout(dp=8, tp=8, pp=2, global_batch=16), "aware"),
        (build(ClusterSpec(server=DGX_A100, racks=2, servers_per_rack=4, pods=2, cores=2)),
         Layout(dp=16, tp=2, pp=2, global_batch=16), "aware"),
    ],
)  # fmt: skip
def test_parts_replayed_apart_and_once_equal_the_full_replay(topology, layout, how):
    placement = place(topology, layout, how)
    for axis, collective, nbytes in (("tp", Collective.ALL_REDUCE, 2**22), ("dp", Collective.ALL_REDUCE, 2**24)):
        size = getattr(layout, axis)
        groups = {tuple(group(layout, axis, d, p, t)) for d in range(layout.dp) for p in range(layout.pp)
                  for t in range(layout.tp)}  # fmt: skip
        schedule = build_schedule(collective, "ring", size)
        jobs = [Job(schedule, nbytes, tuple(placement[r] for r in g)) for g in sorted(groups)]
        _same(replay_jobs(jobs, topology, itemsize=2, flow_limit=None), replay_concurrent(jobs, topology, itemsize=2))


def test_lock_step_rounds_stay_close_to_the_full_replay():
    topology = preset("4-rack", nic_affinity="ecmp")
    layout = Layout(dp=16, tp=8, global_batch=16)
    placement = place(topology, layout)
    exact = simulate_traffic(SMALL, layout, topology, placement, flow_limit=None)
    rounds = simulate_traffic(SMALL, layout, topology, placement, flow_limit=10)
    assert rounds.dp[0].time_s == pytest.approx(exact.dp[0].time_s, rel=0.1)
    total = lambda r: sum(u.nbytes for u in r.links)  # noqa: E731
    assert total(rounds.dp[0]) == pytest.approx(total(exact.dp[0]), rel=1e-9)


def test_rail_affinity_sends_gpu_k_through_nic_k():
    ecmp = build(ClusterSpec(server=H100_NODE, racks=2, servers_per_rack=2, fabric="rail", nic_affinity="ecmp"))
    rail = build(ClusterSpec(server=H100_NODE, racks=2, servers_per_rack=2, fabric="rail", nic_affinity="rail"))
    for k in range(8):
        for flow in range(6):
            nodes = {link.dst for link in rail.route(f"s0/gpu{k}", f"s3/gpu{k}", flow)}
            assert f"s0/nic{k}" in nodes and f"s3/gpu{k}" in nodes
            assert not {f"s0/nic{j}" for j in range(8) if j != k} & nodes
    # without affinity a GPU's flows leave by every NIC under its PCIe switch (two of them)
    used = {link.dst for flow in range(32) for link in ecmp.route("s0/gpu0", "s3/gpu0", flow)}
    assert {"s0/nic0", "s0/nic1"} <= used


def test_split_pipeline_sends_carry_one_tp_th_each_and_gather_on_the_next_stage():
    topology = preset("h100-rail", racks=1, servers_per_rack=4)
    layout = Layout(dp=1, tp=8, pp=4, global_batch=8)
    placement = place(topology, layout)
    whole = simulate_traffic(SMALL, layout, topology, placement)
    split = simulate_traffic(SMALL, layout, topology, placement, split_pipeline=True)
    activation = SMALL.sequence * SMALL.hidden * SMALL.bytes_per_value
    nic_bytes = lambda r: sorted(u.nbytes for u in r.links if "/nic" in u.link.src and "rail" in u.link.dst)  # noqa: E731
    assert nic_bytes(whole.pp) == [activation] * 24  # 3 stage boundaries x 8 tp ranks, one NIC each
    assert nic_bytes(split.pp) == [activation / 8] * 24
    assert whole.pp_gather is None and split.pp_gather is not None
    assert len(split.pp_gather.rank_finish_s) == 3 * 8  # every receiving stage's tp group all-gathers
    assert split.pp.time_s < whole.pp.time_s
    step = simulate_step(SMALL, layout, topology, placement, StepConfig(split_pipeline=True))
    assert step.pp_s == pytest.approx(split.pp.time_s + split.pp_gather.time_s)


def test_cluster_spec_rejects_unknown_fabric_and_affinity():
    with pytest.raises(ValueError, match="fabric"):
        ClusterSpec(fabric="torus")
    with pytest.raises(ValueError, match="nic_affinity"):
        ClusterSpec(nic_affinity="nearest")
