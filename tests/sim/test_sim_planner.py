"""dtrain.sim.planner: layouts obey the strategies' rules, plans fit memory and come fastest first."""

from __future__ import annotations

import pytest

from dtrain.sim.model import ModelSpec, memory_per_device
from dtrain.sim.planner import candidate_layouts, plan
from tests.sim.test_sim_step import two_servers

MODEL = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512)


def test_candidate_layouts_follow_the_rules() -> None:
    layouts = candidate_layouts(MODEL, 8, 16, micro_batches=(1, 2), zero_stages=(0, 1))
    assert layouts
    for lay in layouts:
        assert lay.dp * lay.tp * lay.pp == 8
        assert MODEL.heads % lay.tp == 0 and MODEL.layers % lay.pp == 0
        assert 16 % (lay.dp * lay.micro_batch) == 0
        assert not (lay.zero_stage and lay.dp == 1)
    assert {(lay.tp, lay.pp) for lay in layouts} >= {(1, 1), (8, 1), (1, 8), (2, 2), (4, 2)}


def test_max_tp_bounds_tensor_parallelism() -> None:
    assert max(lay.tp for lay in candidate_layouts(MODEL, 8, 16, max_tp=2)) == 2


def test_plans_fit_memory_and_come_fastest_first() -> None:
    big = ModelSpec(parameters=20e9, layers=8, hidden=4096, heads=32, sequence=1024)
    plans, dropped = plan(big, two_servers(), global_batch=8, micro_batches=(1,), zero_stages=(0, 1))
    assert plans and dropped > 0  # 20e9 x 16 bytes fits no single device: some layouts must go
    times = [p.result.step_s for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert memory_per_device(big, p.layout).total <= 0.9 * 80 * 2**30
        assert 0 < p.mfu < 1


def test_with_long_sequences_tensor_parallel_belongs_inside_a_server() -> None:
    # activations (b s h = 16 MB, 4 all-reduces a layer and micro-batch) outweigh the gradients (250 MB a step)
    long = ModelSpec(parameters=0.5e9, layers=8, hidden=2048, heads=16, sequence=4096)
    plans, _ = plan(long, two_servers(), global_batch=8, micro_batches=(1,), zero_stages=(0,))
    by_key = {(p.layout.describe(), p.placement): p.result.step_s for p in plans}
    assert by_key[("dp2 tp4 pp1 mb1x4 sp", "aware")] < by_key[("dp2 tp4 pp1 mb1x4 sp", "oblivious")]


def test_each_plan_is_its_layout_simulated_under_its_placement() -> None:
    # the megatron order depends on the degrees, not only on the ranks' count: each layout gets its own devices
    from dtrain.sim.placement import place
    from dtrain.sim.step import simulate_step

    topo = two_servers()
    plans, _ = plan(MODEL, topo, global_batch=8, micro_batches=(1,), zero_stages=(0,),
                    placements=("aware", "megatron"))  # fmt: skip
    assert {p.placement for p in plans} == {"aware", "megatron"}
    for p in plans:
        alone = simulate_step(MODEL, p.layout, topo, place(topo, p.layout, p.placement))
        assert p.result.step_s == pytest.approx(alone.step_s), (p.layout.describe(), p.placement)
    # where both orders give the same devices (no pipeline, or no data parallelism) the layout is simulated once
    flat = [(p.layout.describe(), p.placement) for p in plans if p.layout.pp == 1 or p.layout.dp == 1]
    assert flat and all(how == "aware" for _, how in flat)


def test_an_impossible_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="global batch 3"):
        plan(MODEL, two_servers(), global_batch=3, micro_batches=(2,))
