"""Zero-bubble pipeline schedules (Qi et al. 2024): the weight-gradient store, ZB-H1 and ZB-V as data (valid, the
paper's bubble, 1F1B's activation budget), and training like one process on real Gloo processes, alone and
with data and tensor parallelism on the decoders of :mod:`dtrain.models`."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dtrain.cli.main import main
from dtrain.parallel import pipeline_schedules
from dtrain.parallel.pipeline_parallel import forward_flops_weight, partition_layers
from dtrain.parallel.pipeline_parallel_communications import messages
from dtrain.parallel.pipeline_schedules import (
    draw_schedule,
    one_f_one_b,
    simulate,
    simulated_bubble,
    stage_of_virtual,
    theoretical_bubble,
    validate_schedule,
    zb_h1,
    zb_v,
    zb_v_costs,
    zb_v_weights,
)
from dtrain.parallel.weight_gradients import WeightGradStore
from dtrain.sim.pipeline import pipeline_bubble, pipeline_makespan
from tests.jobs import parallel as parallel_jobs
from tests.jobs import pipeline as pipeline_jobs


def test_store_defers_linear_weight_gradients_until_flushed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    reference = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    reference.load_state_dict(net.state_dict())
    store = WeightGradStore()
    assert store.attach(net) == 2
    x = torch.randn(5, 2, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    with store.deferring("mb0"):
        net(x).square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)  # B: the input gradient, at once
    assert net[0].weight.grad is None and net[2].bias.grad is None and store.pending("mb0") == 2
    assert torch.allclose(net[1].weight.grad, reference[1].weight.grad)  # a norm's gradient comes in B
    store.flush("mb0")  # W
    assert store.pending() == 0
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    net.zero_grad(set_to_none=True)
    net(x).sum().backward()  # outside deferring: plain autograd
    assert net[0].weight.grad is not None and store.pending() == 0


def test_store_keeps_autocast_dtypes():
    net = nn.Linear(4, 3)
    WeightGradStore().attach(net)
    store = net.weight_grad_store
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = net(x)
    assert y.dtype == torch.bfloat16
    with store.deferring(0):
        y.float().sum().backward()
    store.flush(0)
    assert x.grad.dtype == torch.float32 and net.weight.grad.dtype == torch.float32


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 5), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_is_valid_holds_at_most_p_and_has_the_papers_bubble(p, m):
    schedules = [zb_h1(p, m, s) for s in range(p)]
    assert [validate_schedule(a, m) for a in schedules] == [min(p, m + s) for s in range(p)]
    for f, b, w in ((1, 1, 1), (1, 1.5, 0.5), (2, 2, 1)):
        times = simulate(schedules, forward_cost=f, backward_cost=b, weight_cost=w)
        assert simulated_bubble(times) == pytest.approx(
            theoretical_bubble(p, m, schedule="zb-h1", forward_cost=f, backward_cost=b, weight_cost=w)
        )
    one_f = simulated_bubble(simulate([one_f_one_b(p, m, s) for s in range(p)], forward_cost=1, backward_cost=2))
    assert theoretical_bubble(p, m, schedule="zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1))
    assert theoretical_bubble(p, m, schedule="zb-h1") < one_f


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zb_v_is_valid_within_1f1bs_activations_and_beats_zb_h1(p, m):
    schedules = [zb_v(p, m, s) for s in range(p)]
    peaks = [validate_schedule(a, m, virtual_stages=2) for a in schedules]
    assert max(peaks) <= 2 * p  # chunks are half a stage: 2p of them are 1F1B's p stage-sized micro-batches
    bubble = simulated_bubble(simulate(schedules, forward_cost=1, backward_cost=1, weight_cost=1, placement="v"))
    assert bubble == pytest.approx(theoretical_bubble(p, m, schedule="zb-v"))
    if m >= p:
        assert bubble < theoretical_bubble(p, m, schedule="zb-h1")
    sent = messages(schedules, "v")
    assert all(src != dst for src, dst in sent)  # the turn of the V stays on the last stage
    keys = [k for ks in sent.values() for k in ks]
    assert len(keys) == len(set(keys)) == 2 * m * (2 * p - 2)  # every hop but the turn, once each way


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (3, 4), (4, 8), (4, 16), (6, 12), (8, 8)])
def test_zb_v_is_built_for_its_costs_and_never_loses_to_the_equal_cost_order(p, m):
    equal = [zb_v(p, m, s) for s in range(p)]
    for f, b, w in ((1, 1, 1), (45, 58, 24.5), (1, 2, 1), (1, 0.8, 0.3), (1, 1.6, 0.1), (2, 3, 2.5)):
        built = [zb_v(p, m, s, costs=(f, b, w)) for s in range(p)]
        assert max(validate_schedule(a, m, virtual_stages=2) for a in built) <= 2 * p
        rf, rb, rw = zb_v_costs((f, b, w))  # the costs as the order is built for them: a tenth's precision
        ends = [
            max(end for stage in simulate(x, forward_cost=rf, backward_cost=rb, weight_cost=rw, placement="v")
                for _, end in stage)
            for x in (built, equal)
        ]  # fmt: skip
        assert ends[0] <= ends[1] + 1e-9
        assert simulated_bubble(
            simulate(built, forward_cost=f / 2, backward_cost=b / 2, weight_cost=w / 2, placement="v")
        ) == pytest.approx(theoretical_bubble(p, m, schedule="zb-v", forward_cost=f, backward_cost=b, weight_cost=w))
    # a transformer's costs (T_B above T_F, T_W below both): the order built for them idles less than the paper's
    f, b, w = 45, 58, 24.5
    built = [zb_v(4, 16, s, costs=(f, b, w)) for s in range(4)]
    idle = [simulated_bubble(simulate(x, forward_cost=f, backward_cost=b, weight_cost=w, placement="v"))
            for x in (built, [zb_v(4, 16, s) for s in range(4)])]  # fmt: skip
    assert idle[0] < 0.6 * idle[1]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_zb_v_built_for_its_chunks_weights_ends_sooner_within_a_pair_more(p, m):
    # the V's first stage holds the embedding's chunk (a block) and the output layer's (4.3 blocks)
    weights = [1.0] + [2.0] * (2 * p - 2) + [4.32]
    costs = (1, 1.1, 0.9)
    rounded = zb_v_weights(weights, p)
    assert rounded[0] < 1 < rounded[-1] and zb_v_weights([3] * (2 * p), p) is None
    ends, peaks = [], []
    for built_for in (None, weights):
        order = [zb_v(p, m, s, costs=costs, weights=built_for) for s in range(p)]
        peaks.append(max(validate_schedule(a, m, virtual_stages=2) for a in order))
        times = simulate(order, forward_cost=1, backward_cost=1.1, weight_cost=0.9, placement="v", weights=rounded)
        ends.append(max(end for stage in times for _, end in stage))
    assert ends[1] < 0.97 * ends[0]  # 4-12% sooner on these
    assert peaks[0] == 2 * p and peaks[1] <= 2 * p + 1


@pytest.mark.parametrize("weights", [[1, 2, 3], [1, -1, 1, 1], [0, 0, 0, 0], [1, float("inf"), 1, 1]])
def test_zb_v_refuses_weights_it_cannot_build_for(weights):
    with pytest.raises(ValueError, match="zb-v weights must be 4 finite numbers"):
        zb_v(2, 4, 0, weights=weights)


@pytest.mark.parametrize("costs", [(0, 1, 1), (1, -1, 1), (1, 1, -0.5), (1, 1), (1, float("nan"), 1), (1, True, 1)])
def test_zb_v_refuses_costs_it_cannot_build_for(costs):
    with pytest.raises(ValueError, match="zb-v costs must be three finite numbers"):
        zb_v(2, 4, 0, costs=costs)


def test_zb_v_is_drawn_with_chunk_letters():
    chart = draw_schedule([zb_v(2, 2, s) for s in range(2)], backward_cost=1, placement="v")
    assert chart.splitlines()[0].startswith("stage 0 | F0a F1a ") and "W1b" in chart


def _assert_zero(results):
    for rank, r in enumerate(results):
        assert all(v == 0.0 for k, v in r.items() if k != "stage"), (rank, r)


@pytest.mark.parametrize(
    ("p", "m", "schedule", "costs", "balance"),
    [
        (2, 2, "zb-h1", None, "layers"),
        (4, 8, "zb-h1", None, "layers"),
        (3, 4, "zb-v", None, "layers"),
        (4, 8, "zb-v", None, "layers"),
        (4, 8, "zb-v", (2, 3, 1), "layers"),
        (2, 4, "zb-v", None, "flops"),
        (4, 8, "zb-v", (2, 3, 1), "flops"),  # the order built for each chunk's FLOPs too
    ],
)
def test_zero_bubble_trains_like_the_unsplit_model(pool, p, m, schedule, costs, balance):
    if costs is not None:  # an order built for a transformer's costs is another order, with the same result
        assert [zb_v(p, m, s, costs=costs) for s in range(p)] != [zb_v(p, m, s) for s in range(p)]
    if balance == "flops":
        model, stage_of = pipeline_jobs._mlp(seed=7), [stage_of_virtual(u, p, "v")[0] for u in range(2 * p)]
        cuts = partition_layers(model, 2 * p, balance="flops", stage_of=stage_of)
        if p == 2:  # the V's stages balanced as stages: another cut from the chunks balanced alone
            assert cuts != partition_layers(model, 2 * p, balance="flops")
        if costs is not None:  # the order built for each chunk's FLOPs, as PipelineParallel builds it: another one
            weights = [sum(forward_flops_weight(model[i]) for i in cut) for cut in cuts]
            weighted = [zb_v(p, m, s, costs=costs, weights=weights) for s in range(p)]
            assert weighted != [zb_v(p, m, s, costs=costs) for s in range(p)]
    _assert_zero(pool.run(pipeline_jobs.zero_bubble, p, m, schedule, 3, costs, balance, ranks=p))


def _stage_loads(costs, sizes, stage_of):
    loads, start = [0] * (max(stage_of) + 1), 0
    for u, size in enumerate(sizes):
        loads[stage_of[u]] += sum(costs[start : start + size])
        start += size
    return loads


@pytest.mark.parametrize(("placement", "v"), [("v", 2), ("loop", 2), ("loop", 3)])
def test_flops_balance_evens_the_stages_that_hold_several_chunks(monkeypatch, placement, v):
    # a Llama-like model of 4 stages: embedding (no FLOPs), 16 equal blocks, a head of 4.3 blocks
    p, costs = 4, [0] + [10] * 16 + [43]
    stage_of = [stage_of_virtual(u, p, placement)[0] for u in range(v * p)]
    alone = pipeline_schedules._balance_by_cost(costs, v * p)  # each chunk balanced by itself
    best = pipeline_schedules._balance_stages(costs, alone, stage_of)
    assert sum(best) == len(costs) and min(best) >= 1
    # the head's stage holds a block in each of its other chunks: 43 + 10 (v - 1) at least
    optimum = 43 + 10 * (v - 1)
    assert max(_stage_loads(costs, best, stage_of)) == optimum < max(_stage_loads(costs, alone, stage_of))
    # the descent used where every cut is too many to try: here as good as trying them all
    monkeypatch.setattr(pipeline_schedules, "EXHAUSTIVE_CUTS", 0)
    descended = pipeline_schedules._balance_stages(costs, alone, stage_of)
    assert max(_stage_loads(costs, descended, stage_of)) == optimum
    if placement == "v":  # the first stage holds the embedding and the head: one block beside the head
        assert best[0] + best[-1] == 3


def test_stage_of_must_name_a_stage_for_every_range():
    with pytest.raises(ValueError, match="stage_of names 3 stages for 4 ranges"):
        partition_layers(nn.Sequential(*[nn.Linear(2, 2)] * 4), 4, balance="flops", stage_of=[0, 1, 1])


LAYOUTS = {
    "pp2-zb-h1": {"pp": 2, "num_microbatches": 2, "schedule": "zb-h1"},
    "pp2-zb-v": {"pp": 2, "num_microbatches": 4, "schedule": "zb-v"},
    "dp2xpp2xtp2-zb-v": {"dp": 2, "pp": 2, "tp": 2, "num_microbatches": 2, "schedule": "zb-v"},
    "tp2xpp2-zb-h1-clip": {"pp": 2, "tp": 2, "num_microbatches": 2, "schedule": "zb-h1", "clip": True},
}


def test_zero_bubble_layouts_train_llama_like_one_process(pool):
    # a tiny Llama with tied embeddings: under ZB-V the embedding and the head are both on the first stage
    per_rank = pool.run(parallel_jobs.layouts, "llama", list(LAYOUTS), LAYOUTS)
    for name, layout in LAYOUTS.items():
        world = layout.get("dp", 1) * layout["pp"] * layout.get("tp", 1)
        for rank, got in enumerate(r[name] for r in per_rank[:world]):
            assert (got["loss"], got["params"], got["norm"]) == (0.0, 0.0, 0.0), (name, rank, got)
            assert got["moved"] > 1e-3 and got["skipped"] == [False] * parallel_jobs.STEPS, (name, rank, got)
            assert got["exported"] == (0.0 if rank == 0 else None), (name, rank, got)


def test_simulator_predicts_the_zero_bubble_schedules_and_what_messages_cost_them():
    p, m, ones = 4, 8, [1.0] * 4
    assert pipeline_bubble(ones, ones, 0.0, m, "zb-h1", weight_s=ones) == pytest.approx(
        theoretical_bubble(p, m, schedule="zb-h1")
    )
    assert pipeline_bubble(ones, ones, 0.0, m, "zb-v", weight_s=ones) == pytest.approx(
        theoretical_bubble(p, m, schedule="zb-v")
    )
    # 1F1B with its whole backward (B + W) against ZB-H1: the same work, a shorter step
    assert pipeline_makespan(ones, [2.0] * 4, 0.0, m, "1f1b") - pipeline_makespan(
        ones, ones, 0.0, m, "zb-h1", weight_s=ones
    ) == pytest.approx(2 * (p - 1))
    # a message costs every hop on the critical path; two chunks a stage halve the compute between hops, so with
    # slow messages the chunked schedules lose their lead (the interleaved measurements' excess)
    fast = {s: pipeline_bubble(ones, ones, 0.0, m, s, weight_s=ones) for s in ("1f1b", "interleaved-1f1b", "zb-v")}
    slow = {s: pipeline_bubble(ones, ones, 0.5, m, s, weight_s=ones) for s in fast}
    assert fast["zb-v"] < fast["interleaved-1f1b"] < fast["1f1b"]
    assert slow["interleaved-1f1b"] - fast["interleaved-1f1b"] > slow["1f1b"] - fast["1f1b"]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb-h2'"):
        pipeline_makespan(ones, ones, 0.0, m, "zb-h2")


def test_bench_pipeline_prints_measured_beside_theory_and_torchs(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    common = ["bench", "pipeline", "--nproc", "2", "--microbatches", "2", "--layers", "4", "--width", "8"]
    common += ["--batch", "4", "--warmup", "1", "--steps", "1", "--schedules", "1f1b,zb-h1,zb-v", "--out", str(out)]
    assert main(common) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("1f1b", 2), ("zb-h1", 2), ("zb-v", 2)]
    for r in rows:
        assert r["bubble_theory"] == pytest.approx(theoretical_bubble(2, 2, schedule=r["schedule"]), abs=1e-4)
        assert r["bubble_measured"] < 1 and r["step_ms"] > 0
        # the slowest stage's share: at most the mean stage's, computed from each rank's own compute
        busy = r["busy_ms_per_stage"]
        assert len(busy) == 2 and min(busy) > 0
        assert r["bubble_slowest_steady"] == pytest.approx(1 - max(busy) / r["step_ms_steady"], abs=2e-3)
        assert r["bubble_slowest_steady"] <= r["bubble_steady"] + 1e-4
    # torch has no single-chunk ZB-H1: beside it, its 1F1B, named
    assert [r["torch_schedule"] for r in rows] == ["Schedule1F1B", "Schedule1F1B", "ScheduleZBVZeroBubble"]
    assert all(r["torch_step_ms"] > 0 for r in rows)
    assert main(["bench", "pipeline", "--schedules", "zb-h2"]) == 2
    assert "--schedules: unknown zb-h2" in capsys.readouterr().err
