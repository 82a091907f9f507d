"""The pipeline cut ``dtrain train`` makes, priced by the simulator (``Layout.balance``): its blocks a stage, the
output layer on the V's first stage, the step it gives, the planner's search over it."""

from __future__ import annotations

import pytest

from dtrain.cluster.presets import preset
from dtrain.sim.model import Layout, ModelSpec, head_stage, memory_per_device, stage_blocks, stage_parameters
from dtrain.sim.placement import place
from dtrain.sim.planner import candidate_layouts
from dtrain.sim.step import StepConfig, simulate_step

#: Llama 3.2 1B: the head's product is 4.3 blocks' forward FLOPs
LLAMA_1B = ModelSpec(name="llama-1b", parameters=1.236e9, layers=16, hidden=2048, heads=32, sequence=2048,
                     vocab=128256, ffn_hidden=8192, kv_heads=8, gated_mlp=True)  # fmt: skip


def _layout(schedule: str = "1f1b", balance: str | None = None, pp: int = 4) -> Layout:
    chunks = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    return Layout(pp=pp, micro_batch=2, global_batch=16, schedule=schedule, chunks=chunks, balance=balance,
                  attention="flash")  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "balance", "blocks"),
    [
        ("1f1b", None, (4, 4, 4, 4)),  # Megatron-LM's: L / pp, the embedding and head beside
        ("1f1b", "layers", (4, 5, 4, 3)),  # 18 layers in 5 / 5 / 4 / 4: the embedding and head count as layers
        ("1f1b", "flops", (5, 5, 5, 1)),  # the head beside one block
        ("interleaved-1f1b", "flops", (5, 5, 5, 1)),
        ("zb-v", "layers", (3, 5, 4, 4)),  # the V: the first stage runs the first chunk and the last
        ("zb-v", "flops", (1, 5, 5, 5)),
    ],
)
def test_the_cut_gives_each_stage_its_blocks(schedule, balance, blocks):
    layout = _layout(schedule, balance)
    assert stage_blocks(LLAMA_1B, layout) == blocks and sum(blocks) == LLAMA_1B.layers
    assert head_stage(layout) == (0 if schedule == "zb-v" else 3)


def test_flops_balance_prices_a_faster_step_and_the_v_holds_its_tied_head_once():
    topology = preset("h200-4gpu")
    steps = {}
    for balance in ("layers", "flops"):
        layout = _layout("1f1b", balance)
        steps[balance] = simulate_step(LLAMA_1B, layout, topology, place(topology, layout, "aware"), StepConfig())
    assert steps["flops"].step_s < steps["layers"].step_s / 1.1  # the head's stage held 1.44x the mean, now 1.05x
    v = _layout("zb-v", "flops")
    embedding = LLAMA_1B.vocab * LLAMA_1B.hidden
    per_block = (LLAMA_1B.parameters - embedding) / LLAMA_1B.layers
    assert stage_parameters(LLAMA_1B, v, 0) == pytest.approx(embedding + per_block)  # one tied matrix, one block
    assert stage_parameters(LLAMA_1B, v, 3) == pytest.approx(5 * per_block)
    assert memory_per_device(LLAMA_1B, v).total > 0


def test_any_layer_count_cuts_where_dtrain_train_cuts_it():
    odd = Layout(pp=3, micro_batch=2, global_batch=12, balance="flops")
    odd.check(LLAMA_1B)  # 16 blocks on 3 stages: dtrain's cut takes them, Megatron's even split does not
    with pytest.raises(ValueError, match="do not split into pp=3"):
        Layout(pp=3, micro_batch=2, global_batch=12).check(LLAMA_1B)
    with pytest.raises(ValueError, match="one or the other"):
        Layout(pp=2, micro_batch=1, global_batch=2, balance="flops", embedding_layers=1)
    with pytest.raises(ValueError, match="balance must be one of"):
        Layout(pp=2, micro_batch=1, global_batch=2, balance="params")
    found = candidate_layouts(LLAMA_1B, 6, 12, micro_batches=(2,), zero_stages=(0,), balances=("layers", "flops"))
    assert {(x.pp, x.balance) for x in found if x.pp == 3} == {(3, "layers"), (3, "flops")}
    assert all(x.balance is None for x in found if x.pp == 1)
    megatron = candidate_layouts(LLAMA_1B, 6, 12, micro_batches=(2,), zero_stages=(0,))
    assert {x.embedding_layers for x in megatron if x.pp == 3} == {1}  # there DeepSpeed's cut evens 18 layers


def test_each_stage_of_the_cut_is_priced_with_its_own_blocks():
    from dtrain.sim.step import _stage_times

    topology = preset("h200-4gpu")
    layout = _layout("1f1b", "layers")  # 4 / 5 / 4 / 3 blocks
    forward, backward, _ = _stage_times(LLAMA_1B, layout, topology, place(topology, layout, "aware"), [1.0] * 4,
                                        StepConfig(), 0.0)  # fmt: skip
    per_block = (forward[0][1] + backward[0][1]) / 5
    assert forward[0][2] + backward[0][2] == pytest.approx(4 * per_block)  # not stage 1's five


def test_zb_v_prices_each_chunk_at_its_share_and_builds_its_order_for_them():
    from dtrain.sim.model import chunk_shares
    from dtrain.sim.pipeline import pipeline_makespan
    from dtrain.sim.step import _makespan_bound

    v = _layout("zb-v", "flops")  # the first stage: a block's chunk beside the output layer's
    shares = chunk_shares(LLAMA_1B, v)
    assert shares[0][1] > 0.8 and shares[1] == pytest.approx((0.4, 0.6))
    assert chunk_shares(LLAMA_1B, _layout("1f1b", "flops")) is None
    headless = ModelSpec(name="headless", parameters=1e9, layers=16, hidden=2048, heads=32, sequence=2048)
    assert chunk_shares(headless, _layout("zb-v")) is None  # equal blocks, no output layer: halves
    f, b, w = [5.3, 5.0, 5.0, 5.0], [5.8, 5.5, 5.5, 5.5], [4.8, 4.5, 4.5, 4.5]
    halves = pipeline_makespan(f, b, 0.0, 8, "zb-v", weight_s=w, chunk_shares=[(0.5, 0.5)] * 4)
    assert halves == pipeline_makespan(f, b, 0.0, 8, "zb-v", weight_s=w)
    for p2p in (0.0, 0.3):
        shared = pipeline_makespan(f, b, p2p, 8, "zb-v", weight_s=w, chunk_shares=shares)
        assert shared >= 8 * (5.3 + 5.8 + 4.8)  # the busiest stage's work
        assert _makespan_bound(f, b, w, v, shares) <= shared
    with pytest.raises(ValueError, match="chunk_shares: 4 pairs of shares"):
        pipeline_makespan(f, b, 0.0, 8, "zb-v", weight_s=w, chunk_shares=[(0.7, 0.7)] * 4)


def test_layers_that_cost_nothing_spread_evenly_and_bad_stage_ids_are_refused():
    from dtrain.parallel.pipeline_schedules import cut_sizes, one_f_one_b, simulate

    assert cut_sizes(12, 4, [0] * 12, [0, 1, 0, 1]) == cut_sizes(12, 4, [0] * 12) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="each >= 0"):
        cut_sizes(4, 2, [1, 1, 1, 1], [0, -1])
    with pytest.raises(ValueError, match="weights: one a virtual stage, 2 of them, got 1"):
        simulate([one_f_one_b(2, 2, s) for s in range(2)], weights=[1.0])
    with pytest.raises(ValueError, match=r"6 blocks, the embedding and the head \(8 layers\) do not cut"):
        Layout(pp=8, micro_batch=1, global_batch=8, schedule="zb-v", chunks=2, balance="layers").check(
            ModelSpec(parameters=1e8, layers=6, hidden=256, heads=4, sequence=128, vocab=1000)
        )
