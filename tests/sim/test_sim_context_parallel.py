"""Context parallelism in the simulator and planner: a sequence cut over ``cp`` ranks, its compute, memory, ring
exchange, placement and search, against hand-worked figures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dtrain.cli.main import main
from dtrain.sim.compute import device_compute, layer_ops, price
from dtrain.sim.model import Layout, ModelSpec, context_view, flops_per_microbatch, memory_per_device
from dtrain.sim.placement import grid_rank, place
from dtrain.sim.planner import candidate_layouts, sweep
from dtrain.sim.step import StepConfig, context_parallel_s, simulate_step, stage_seconds
from tests.sim.test_sim_step import GB, PEAK, two_servers

#: 8 layers of width 1024, 16 heads of 64 (4 key-value heads), sequences of 4096 tokens
MODEL = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, kv_heads=4, sequence=4096)
MEMORY_RATE = 2e12  # the test devices' memory bytes a second


def _layout(**kwargs) -> Layout:
    return Layout(attention="flash", **kwargs)


def test_a_layout_counts_its_context_parallel_ranks_and_refuses_what_cannot_run() -> None:
    layout = _layout(dp=2, cp=4, tp=2, pp=2, global_batch=8)
    assert layout.world_size == 32 and layout.microbatches == 4
    assert layout.describe().startswith("dp2 cp4 tp2 pp2 ")
    assert "cp" not in _layout(dp=2, global_batch=2).describe()
    with pytest.raises(ValueError, match="needs attention 'flash'"):
        Layout(cp=2)
    with pytest.raises(ValueError, match="does not cut into 2 x cp = 16 equal pieces"):
        _layout(cp=8).check(replace(MODEL, sequence=4100))
    with pytest.raises(ValueError, match="Layout.cp must be a positive int"):
        _layout(cp=0)


def test_the_view_is_a_replica_of_dp_x_cp_on_a_shard_of_each_sequence() -> None:
    layout = _layout(dp=2, cp=4, tp=2, global_batch=8, micro_batch=2)
    model, view = context_view(MODEL, layout)
    assert (model.sequence, model.context_shards, model.keys) == (1024, 4, 4096)
    assert (view.dp, view.cp, view.global_batch, view.world_size) == (8, 1, 32, layout.world_size)
    assert view.microbatches == layout.microbatches == 2
    assert context_view(*context_view(MODEL, layout)) == (model, view)  # a view is its own view
    plain = _layout(dp=2, global_batch=8)
    assert context_view(MODEL, plain) == (MODEL, plain)


def test_a_rank_runs_a_cp_th_of_the_products_and_of_the_attention_in_cp_kernels() -> None:
    whole = layer_ops(MODEL, _layout(tp=2))
    shard = layer_ops(MODEL, _layout(cp=4, tp=2, global_batch=1))
    products = [op for op in whole if op.kind == "matmul"]
    cut = [op for op in shard if op.kind == "matmul"]
    assert sum(op.total_flops for op in cut) == pytest.approx(sum(op.total_flops for op in products) / 4)
    attention = [op for op in whole if op.kind == "attention"]
    ring = [op for op in shard if op.kind == "attention"]
    assert len(attention) == 2 and len(ring) == 8  # forward and backward, each as 4 kernels on the ring
    for phase in "FB":
        one = sum(op.flops for op in attention if op.phase == phase)
        assert sum(op.flops for op in ring if op.phase == phase) == pytest.approx(one / 4)
    # over the cp ranks a micro-batch does the same work as on one
    assert flops_per_microbatch(MODEL, _layout(cp=4, global_batch=1)) * 4 == pytest.approx(
        flops_per_microbatch(MODEL, _layout())
    )


@pytest.mark.parametrize("sp", [False, True])
def test_a_rank_keeps_a_cp_th_of_the_activations_and_zero_shards_over_dp_x_cp(sp: bool) -> None:
    one = memory_per_device(MODEL, _layout(dp=2, tp=2, global_batch=2, zero_stage=1, sequence_parallel=sp))
    four = memory_per_device(MODEL, _layout(dp=2, cp=4, tp=2, global_batch=2, zero_stage=1, sequence_parallel=sp))
    eight = memory_per_device(MODEL, _layout(dp=8, tp=2, global_batch=8, zero_stage=1, sequence_parallel=sp))
    assert four.activations == pytest.approx(one.activations / 4)
    assert four.weights == one.weights and four.gradients == one.gradients
    assert four.optimizer == pytest.approx(eight.optimizer)  # the optimizer's state cut over dp x cp = 8


def test_megatron_places_a_context_parallel_group_on_consecutive_devices() -> None:
    topo = two_servers()
    layout = _layout(cp=2, tp=2, pp=2, global_batch=1)
    _, view = context_view(MODEL, layout)
    devices = place(topo, layout, "megatron")
    names = [d.name for d in topo.devices()]
    for p in range(2):
        for t in range(2):
            ring = [devices[grid_rank(view, c, p, t)] for c in range(2)]
            assert ring == [names[(p * 2 + c) * 2 + t] for c in range(2)]  # tensor, context, data, pipeline
            assert len({topo.device(d).server for d in ring}) == 1


def test_the_ring_pass_moves_each_ranks_keys_and_values_round_the_group() -> None:
    topo = two_servers(network=1 * GB)
    layout = _layout(cp=2, tp=4, global_batch=1)
    # aware order: the two context-parallel ranks of each tensor-parallel rank sit on the two servers, so the
    # four groups' keys and values cross the one 1 GB/s link each way at once
    shard = 2 * 2048 * 4 * 64 / 4 * 2  # keys and values of 2048 tokens, 4 key-value heads of 64 over tp 4, 16-bit
    assert context_parallel_s(MODEL, layout, topo, place(topo, layout, "aware")) == pytest.approx(
        4 * shard / GB, rel=0.02
    )
    inside = _layout(cp=2, tp=2, global_batch=1)  # four ranks on the first server's 100 GB/s NVLink
    assert context_parallel_s(MODEL, inside, topo, place(topo, inside, "aware")) < shard / GB / 10
    assert context_parallel_s(MODEL, _layout(tp=4), topo, place(topo, _layout(tp=4), "aware")) == 0.0


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_layer_waits_for_what_each_ring_step_takes_beyond_its_attention_kernel(recompute: str) -> None:
    layout = _layout(cp=4, tp=1, global_batch=1, recompute=recompute)
    model, view = context_view(MODEL, layout)
    device = device_compute(PEAK, MEMORY_RATE)
    kernels = {phase: [price(op, device) for op in layer_ops(model, view) if op.kind == "attention"
                       and op.phase == phase] for phase in "FB"}  # fmt: skip
    assert len(kernels["F"]) == len(kernels["B"]) == 4  # the rank's own, then the three others' as they come
    config = StepConfig()
    base = stage_seconds(model, view, 0, PEAK, MEMORY_RATE, config, 0.0)
    first = kernels["F"][0]
    for cp_s in (0.5 * first, 6 * first, 12 * kernels["B"][0]):
        step = cp_s / 3  # a pass is cp - 1 = 3 steps, step i beside kernel i
        forward = sum(max(0.0, step - k) for k in kernels["F"][:3])
        backward = sum(max(0.0, 2 * step - k) for k in kernels["B"][:3]) + (forward if recompute == "full" else 0.0)
        with_ring = stage_seconds(model, view, 0, PEAK, MEMORY_RATE, config, 0.0, cp_s)
        assert with_ring[0] - base[0] == pytest.approx(8 * forward)
        assert with_ring[1] - base[1] == pytest.approx(8 * backward)
        assert forward > 0 or cp_s < first
    assert stage_seconds(model, view, 0, PEAK, MEMORY_RATE, config, 0.0, 0.5 * first) == pytest.approx(base)


def test_a_step_with_a_ring_across_the_network_waits_for_it() -> None:
    topo = two_servers(network=0.1 * GB)
    layout = _layout(cp=2, global_batch=4, micro_batch=1)
    near = simulate_step(MODEL, layout, topo, place(topo, layout, "aware"))
    names = [d.name for d in topo.devices()]
    far = simulate_step(MODEL, layout, topo, [names[0], names[4]])
    assert near.cp_s > 0 and far.cp_s > 10 * near.cp_s
    assert far.step_s > near.step_s
    assert near.tokens_per_s == pytest.approx(4 * 4096 / near.step_s)  # the whole sequences, not the shards


def test_the_planner_searches_context_parallel_degrees_where_asked() -> None:
    layouts = candidate_layouts(MODEL, 8, 8, micro_batches=(1,), attention="flash", context_parallel=(1, 2, 4))
    seen = {(lay.dp, lay.cp, lay.tp, lay.pp) for lay in layouts}
    assert (2, 4, 1, 1) in seen and (1, 2, 4, 1) in seen and (8, 1, 1, 1) in seen
    assert all(lay.world_size == 8 for lay in layouts)
    assert not any(lay.cp > 1 for lay in candidate_layouts(MODEL, 8, 8, attention="flash"))
    with pytest.raises(ValueError, match="attention 'flash'"):
        candidate_layouts(MODEL, 8, 8, context_parallel=(2,))
    # sequences of a million tokens, no tensor parallelism: a layer keeps 34 s h bytes (36.5 GB), and only eight
    # context-parallel ranks cut it enough to fit a device (a pipeline's first stage holds a layer a stage)
    long = replace(MODEL, sequence=2**20)
    kwargs = {"global_batch": 8, "micro_batches": (1,), "zero_stages": (1,), "attention": "flash",
              "recompute": ["none"], "max_tp": 1}  # fmt: skip
    alone = sweep(long, two_servers(), **kwargs)
    assert not alone.plans
    found = sweep(long, two_servers(), context_parallel=(1, 2, 4, 8), **kwargs)
    assert found.plans and all(p.layout.cp > 1 for p in found.plans)
    best = found.plans[0]
    assert best.result.step_s == pytest.approx(
        simulate_step(long, best.layout, two_servers(), place(two_servers(), best.layout, best.placement)).step_s
    )


def test_the_command_line_takes_context_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--model", "llama-7b", "--seq", "32768", "--dp", "2",
            "--cp", "4", "--global-batch", "4", "--placement", "megatron", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["cp"] == 4 and data["layout"]["attention"] == "flash" and data["cp_ring_s"] > 0
    plan = ["plan", "--topology", "h100-node", "--model", "llama-7b", "--seq", "32768", "--global-batch", "8",
            "--cp", "1,2", "--zero", "1", "--micro-batches", "1", "--json"]  # fmt: skip
    assert main(plan) == 0
    assert any(" cp2 " in row["layout"] for row in json.loads(capsys.readouterr().out)["plans"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "train", "--topology", "h100-node", "--seq", "1000", "--cp", "8", "--global-batch", "1"],
         "--cp 8: a sequence of 1000 tokens does not cut into 2 x cp = 16 equal pieces"),
        (["simulate", "train", "--topology", "h100-node", "--cp", "2", "--global-batch", "1", "--kernels", "dtrain"],
         "--kernels dtrain: dtrain.models runs neither"),
        (["plan", "--topology", "h100-node", "--global-batch", "8", "--cp", "0"], "--cp: context-parallel degrees"),
        (["plan", "--topology", "h100-node", "--global-batch", "8", "--cp", "2", "--kernels", "dtrain"],
         "--cp: not with --kernels dtrain"),
    ],
)  # fmt: skip
def test_bad_context_parallel_flags_are_one_line_naming_the_flag(capsys, argv, message) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err and "Traceback" not in captured.out + captured.err
