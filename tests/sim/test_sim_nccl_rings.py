"""NCCL's rail-aligned rings of a data-parallel group that spans servers (dtrain.sim.traffic.nccl_rings)."""

from __future__ import annotations

import pytest

from dtrain.cluster.catalogue import LINKS
from dtrain.cluster.presets import preset
from dtrain.comm.ir.algorithms import build
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.classes import replay_jobs
from dtrain.sim.collective import Job
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import place
from dtrain.sim.traffic import nccl_rings, simulate_traffic


def _rail_pair() -> tuple:
    # two DGX H100 servers on one rail-optimised unit: NIC k of each on leaf rail k, the leaves under 16 spines
    topo = preset("h100-rail", racks=1, servers_per_rack=2)
    return topo, [d.name for d in topo.devices()][:16]


def test_dp16_all_reduce_runs_eight_rails_at_the_nics_rate() -> None:
    topo, placement = _rail_pair()
    rings = nccl_rings(list(range(16)), placement, topo)
    assert len(rings) == 8  # one ring (channel) a GPU of the group on each server
    nbytes = 1 << 30
    schedule = build(Collective.ALL_REDUCE, "ring", 16)
    jobs = [Job(schedule, nbytes // 8, tuple(placement[r] for r in order), relay=tuple(relay))
            for order, relay in rings]  # fmt: skip
    result = replay_jobs(jobs, topo, itemsize=2)
    up = {u.link.src for u in result.links if "/nic" in u.link.src and "/rail" in u.link.dst and u.nbytes}
    assert up == {f"s{s}/nic{k}" for s in range(2) for k in range(8)}  # all 16 NICs send
    assert not any("spine" in u.link.name for u in result.links)  # every hop between servers stays on its rail
    # each ring carries 1/8 of the buffer; a ring all-reduce sends 2 (n - 1) / n of its buffer from every rank,
    # and each ring crosses a server boundary once, over one 50 GB/s NDR NIC: 2 x 15/16 x 1 GiB / (8 x 50 GB/s)
    math_s = 2 * 15 / 16 * nbytes / (8 * LINKS["ib-ndr"].bytes_per_s)
    assert math_s <= result.time_s <= 1.1 * math_s  # the rest: 30 steps' path latency
    single = replay_jobs([Job(schedule, nbytes, tuple(placement))], topo, itemsize=2)
    assert single.time_s > 8 * result.time_s  # one ring in rank order: GPU 7 -> GPU 0 crosses a spine


def test_one_gpu_a_server_keeps_the_ring_in_rank_order() -> None:
    topo = preset("h100-rail", racks=1, servers_per_rack=2)
    layout = Layout(dp=2, tp=8, pp=1, micro_batch=1, global_batch=2)
    placement = place(topo, layout)
    group = [0, 8]  # tp rank 0 of each replica: GPU 0 of each server, one rail
    assert nccl_rings(group, placement, topo) == [([0, 8], [None, None])]
    model = MODELS["gpt2-xl"]
    ring = simulate_traffic(model, layout, topo, placement, dp_algorithm="ring")
    nccl = simulate_traffic(model, layout, topo, placement, dp_algorithm="nccl-ring")
    assert [r.time_s for r in nccl.dp] == pytest.approx([r.time_s for r in ring.dp], rel=1e-12)


def test_distributed_optimizer_reduce_scatters_stage_1_gradients() -> None:
    from dtrain.sim.traffic import dp_phase_bytes

    model = MODELS["gpt2-xl"]
    layout = Layout(dp=4, tp=1, pp=1, micro_batch=1, global_batch=4, zero_stage=1)
    plain = dp_phase_bytes(model, layout, 4)
    sharded = dp_phase_bytes(model, layout, 4, distributed_optimizer=True)
    assert [c for c, _, _ in plain] == [Collective.ALL_REDUCE, Collective.ALL_GATHER]
    assert [c for c, _, _ in sharded] == [Collective.REDUCE_SCATTER, Collective.ALL_GATHER]
    assert [b for _, b, _ in sharded] == [b for _, b, _ in plain]  # the same buffers: 32-bit gradients, weights
    no_zero = Layout(dp=4, tp=1, pp=1, micro_batch=1, global_batch=4)
    assert dp_phase_bytes(model, no_zero, 4, distributed_optimizer=True) == dp_phase_bytes(model, no_zero, 4)
