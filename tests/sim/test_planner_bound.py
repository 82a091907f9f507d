"""dtrain.sim.planner's branch and bound: the bounds are bounds, and the pruned sweep ranks its top plans as the
exhaustive sweep does."""

from __future__ import annotations

import json

import pytest

from dtrain.cli.main import main
from dtrain.cluster.presets import preset
from dtrain.sim.model import ModelSpec
from dtrain.sim.pipeline import pipeline_makespan
from dtrain.sim.placement import place
from dtrain.sim.planner import sweep
from dtrain.sim.step import (
    data_parallel_lower_bound,
    pipeline_message_lower_bound,
    step_lower_bound,
    tensor_parallel_s,
)

MODEL = ModelSpec(name="m", parameters=30e9, layers=32, hidden=6144, heads=48, sequence=2048)


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2),
                                                  ("interleaved-1f1b", 4)])  # fmt: skip
def test_equal_stages_with_free_messages_take_the_closed_form(schedule: str, chunks: int) -> None:
    # what step_lower_bound prices without a replay: (m + (p - 1) / v)(f + b)
    for p in (1, 2, 3, 8):
        for m in (1, 3, 8, 16, 24):
            if schedule == "interleaved-1f1b" and (m % p or p == 1):
                continue
            for f, b in ((1.0, 2.0), (0.7, 3.1), (2.0, 1.0)):
                span = pipeline_makespan([f] * p, [b] * p, 0.0, m, schedule, virtual_stages=chunks)
                assert span == pytest.approx((m + (p - 1) / chunks) * (f + b), rel=1e-12)


@pytest.fixture(scope="module")
def sweeps():
    topology = preset("h100-rail", racks=2, servers_per_rack=2)  # 32 GPUs, 2 units: some pairs cross spines
    args = dict(global_batch=16, micro_batches=(1,), zero_stages=(0, 1))
    return topology, sweep(MODEL, topology, **args), sweep(MODEL, topology, **args, top=5)


def test_lower_bounds_never_exceed_the_simulated_step(sweeps) -> None:
    topology, exhaustive, _ = sweeps
    assert exhaustive.bounded == 0 and exhaustive.simulated == len(exhaustive.plans) > 20
    loose, closer, cache, crossing = [], [], {}, 0
    for p in exhaustive.plans:
        used = place(topology, p.layout, p.placement)
        compute = step_lower_bound(MODEL, p.layout, topology, used)
        with_tp = step_lower_bound(MODEL, p.layout, topology, used,
                                   tp_s=tensor_parallel_s(MODEL, p.layout, topology, used, cache=cache))  # fmt: skip
        tp_s = tensor_parallel_s(MODEL, p.layout, topology, used, cache=cache)
        exact = step_lower_bound(MODEL, p.layout, topology, used, tp_s=tp_s, exact_pipeline=True)
        assert 0 < compute <= with_tp <= exact <= p.result.step_s, p.layout.describe()
        dp_bound = data_parallel_lower_bound(MODEL, p.layout, topology, used)
        pp_bound = pipeline_message_lower_bound(MODEL, p.layout, topology, used)
        assert dp_bound <= p.result.dp_s and pp_bound <= p.result.pp_s, p.layout.describe()
        crossing += dp_bound > 0 and pp_bound > 0
        loose.append(p.result.step_s / with_tp)
        closer.append(p.result.step_s / exact)
    assert min(loose) < 1.2  # tight where communication hides or is small
    assert max(closer) < max(loose) and crossing > 0  # some groups and stages span servers


def test_the_pruned_sweep_ranks_the_top_plans_as_the_exhaustive_one(sweeps) -> None:
    _, exhaustive, pruned = sweeps
    assert pruned.bounded > 0 and pruned.simulated + pruned.bounded == exhaustive.simulated
    key = [(p.layout.describe(), p.placement, p.result.step_s) for p in exhaustive.plans[:5]]
    assert [(p.layout.describe(), p.placement, p.result.step_s) for p in pruned.plans[:5]] == key


def test_top_must_be_positive() -> None:
    with pytest.raises(ValueError, match="top"):
        sweep(MODEL, preset("h100-node"), global_batch=8, top=0)


def test_dtrain_plan_shows_the_exhaustive_top_plans(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--topology", "h100-node", "--global-batch", "8", "--micro-batches", "1,2", "--top", "5", "--json"]
    shown = []
    for extra in ([], ["--exhaustive"]):
        assert main([*argv, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        shown.append((data, [(p["layout"], p["placement"], p["step_s"]) for p in data["plans"]]))
    (pruned, top), (exhaustive, all_top) = shown
    assert top == all_top and len(top) == 5
    assert pruned["bounded"] > 0 and exhaustive["bounded"] == 0
    assert pruned["simulated"] + pruned["bounded"] == exhaustive["simulated"]


def test_zero_bubble_bounds_never_exceed_the_simulated_step() -> None:
    # ZB-V's order is built for each replica's stage times: its bound holds whatever order a replay runs
    topology = preset("h100-rail", racks=1, servers_per_rack=2)
    args = dict(global_batch=16, micro_batches=(1,), zero_stages=(0,), schedules=(("zb-h1", 1), ("zb-v", 2)))
    found = sweep(MODEL, topology, **args)
    piped = [p for p in found.plans if p.layout.pp > 1]
    assert {p.layout.schedule for p in piped} == {"zb-h1", "zb-v"}
    for p in piped:
        used = place(topology, p.layout, p.placement)
        tp_s = tensor_parallel_s(MODEL, p.layout, topology, used)
        bound = step_lower_bound(MODEL, p.layout, topology, used, tp_s=tp_s)
        assert 0 < bound <= p.result.step_s, p.layout.describe()
