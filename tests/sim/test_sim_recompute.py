"""Activation recomputation in the simulator and planner: Korthikanti et al. 2022's activation bytes (table 2),
the recomputation's FLOPs and tensor-parallel all-reduces in the step time, and plans for models that fit only
with recomputation."""

from __future__ import annotations

import json

import pytest

from dtrain.cli import sim as sim_cli
from dtrain.cli.main import main
from dtrain.sim.model import (
    RECOMPUTE,
    Layout,
    ModelSpec,
    activation_bytes_per_layer,
    flops_per_microbatch,
    memory_per_device,
    recompute_flops_per_microbatch,
)
from dtrain.sim.placement import place
from dtrain.sim.planner import SCHEDULES, candidate_layouts, plan
from dtrain.sim.step import StepConfig, simulate_step
from tests.sim.test_sim_step import MODEL, two_servers

S, B, H, A = 512, 2, 1024, 16  # MODEL's sequence, hidden and heads; two sequences a micro-batch


def _layout(**kwargs) -> Layout:
    return Layout(micro_batch=B, global_batch=B * kwargs.get("dp", 1), **kwargs)


@pytest.mark.parametrize(
    ("recompute", "sp", "want"),
    [
        ("none", False, S * B * H * (10 + 24 / 2 + 5 * A * S / (H * 2))),  # equation 2
        ("none", True, S * B * H / 2 * (34 + 5 * A * S / H)),  # equation 4
        ("selective", False, S * B * H * (10 + 24 / 2)),
        ("selective", True, S * B * H * 34 / 2),
        ("full", False, 2 * S * B * H),
        ("full", True, 2 * S * B * H / 2),
    ],
)
def test_activation_bytes_per_layer_follow_korthikanti_table_2(recompute, sp, want) -> None:
    layout = _layout(tp=2, recompute=recompute, sequence_parallel=sp)
    assert activation_bytes_per_layer(MODEL, layout) == pytest.approx(want)


def test_recomputation_keeps_less_and_holds_one_layer_while_it_recomputes() -> None:
    none, selective, full = (memory_per_device(MODEL, _layout(pp=2, recompute=r)) for r in RECOMPUTE)
    layer = S * B * H * (34 + 5 * A * S / H)
    core = S * B * H * 5 * A * S / H
    in_flight, layers = 1, 4  # one micro-batch a replica, 4 layers a stage
    assert none.activations == pytest.approx(layer * layers * in_flight)
    assert selective.activations == pytest.approx((layer - core) * layers * in_flight + core)
    assert full.activations == pytest.approx(2 * S * B * H * layers * in_flight + layer)
    assert full.activations < selective.activations < none.activations
    assert full.weights == none.weights and full.optimizer == none.optimizer


def test_recomputation_flops_are_one_more_forward_or_the_attention_core() -> None:
    tokens = S * B
    assert recompute_flops_per_microbatch(MODEL, _layout()) == 0
    full = recompute_flops_per_microbatch(MODEL, _layout(recompute="full"))
    assert full == pytest.approx(flops_per_microbatch(MODEL, _layout()) / 3)  # the forward: a third of a step
    selective = recompute_flops_per_microbatch(MODEL, _layout(tp=2, recompute="selective"))
    assert selective == pytest.approx(4 * MODEL.layers * H * S * tokens / 2)


def test_the_step_pays_for_recomputation_in_compute_and_tensor_parallel_traffic() -> None:
    topo = two_servers()
    config = StepConfig(efficiency=0.5)

    def step(recompute: str):
        layout = _layout(tp=4, recompute=recompute)
        return simulate_step(MODEL, layout, topo, place(topo, layout, "aware"), config)

    none, selective, full = step("none"), step("selective"), step("full")
    extra = 4 * MODEL.layers * H * S * S * B / 4 / 0.5 / 1e15  # the attention core's forward, on one device
    assert selective.compute_s - none.compute_s == pytest.approx(extra)
    assert full.compute_s == pytest.approx(none.compute_s * 4 / 3)  # forward 1, backward 2, forward again 1
    assert selective.tp_s == pytest.approx(none.tp_s)
    assert full.tp_s == pytest.approx(none.tp_s * 6 / 4)  # the forward's two all-reduces a layer again
    assert none.step_s < selective.step_s < full.step_s
    assert full.memory.total < selective.memory.total < none.memory.total


# 8192 tokens of width 4096: each layer keeps 12 GB without recomputation, so no layout without tensor parallelism
# fits an 80 GiB device; selective recomputation keeps 1.1 GB a layer
LONG = ModelSpec(name="long", parameters=1e9, layers=8, hidden=4096, heads=32, sequence=8192)


def test_a_model_that_fits_only_with_recomputation_gets_a_plan() -> None:
    common = {"global_batch": 8, "micro_batches": (1,), "zero_stages": (0,), "max_tp": 1}
    layouts = candidate_layouts(LONG, 8, 8, micro_batches=(1,), zero_stages=(0,), max_tp=1, schedules=SCHEDULES)
    plans, dropped = plan(LONG, two_servers(), recompute=("none",), **common)
    assert plans == [] and dropped == len(layouts)
    plans, dropped = plan(LONG, two_servers(), **common)
    assert plans and dropped == 0
    assert {p.layout.recompute for p in plans} == {"selective"}  # the cheapest that fits
    assert all(p.result.fits and p.layout.describe().endswith("recompute-selective") for p in plans)
    full_only, _ = plan(LONG, two_servers(), recompute=("none", "full"), **common)
    assert {p.layout.recompute for p in full_only} == {"full"}
    assert min(p.result.step_s for p in full_only) > min(p.result.step_s for p in plans)


def test_a_layout_that_fits_keeps_every_activation() -> None:
    plans, _ = plan(MODEL, two_servers(), global_batch=8, micro_batches=(1,), zero_stages=(0,))
    assert plans and {p.layout.recompute for p in plans} == {"none"}


def test_bad_recompute_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full, got 'some'"):
        Layout(recompute="some")
    with pytest.raises(ValueError, match="recompute modes \\['half'\\]: accepted: none, selective, full"):
        plan(MODEL, two_servers(), global_batch=8, recompute=("half",))


def _json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_command_line_simulates_and_plans_recomputation(capsys) -> None:
    assert sim_cli.RECOMPUTE == RECOMPUTE
    argv = ["simulate", "train", "--topology", "h100-node", "--tp", "8", "--global-batch", "8", "--seq", "8192"]
    none = _json(capsys, *argv)
    full = _json(capsys, *argv, "--recompute", "full", "--sequence-parallel")
    assert full["layout"]["recompute"] == "full" and full["layout"]["sequence_parallel"] is True
    assert full["memory_gb"] < none["memory_gb"] and full["step_s"] > none["step_s"]
    plans = ["plan", "--topology", "h100-node", "--global-batch", "8", "--micro-batches", "1", "--seq", "16384"]
    only_none = _json(capsys, *plans, "--max-tp", "1", "--recompute", "none")
    searched = _json(capsys, *plans, "--max-tp", "1")
    assert only_none["plans"] == [] and searched["plans"]
    assert all("recompute-" in p["layout"] for p in searched["plans"])
    with pytest.raises(SystemExit) as info:
        main([*plans, "--recompute", "none,half"])
    assert info.value.code == 2
    assert "expected comma-separated modes of none, selective, full" in capsys.readouterr().err
