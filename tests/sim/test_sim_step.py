"""dtrain.sim.step, model, pipeline and placement: a training step against hand-worked figures."""

from __future__ import annotations

import pytest

from dtrain.cluster.topology import Topology
from dtrain.comm.cost.model import CostParams, LinkCost, predict
from dtrain.sim.model import Layout, ModelSpec, flops_per_microbatch, memory_per_device
from dtrain.sim.pipeline import pipeline_makespan
from dtrain.sim.placement import grid_rank, place
from dtrain.sim.step import StepConfig, exposed_bucket_s, simulate_step
from tests.sim.test_sim_topologies import GB, device, star

MODEL = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512)
PEAK = 1e15  # the test devices' peak FLOP/s


def two_servers(nvlink: float = 100 * GB, network: float = 1 * GB) -> Topology:
    """Two servers of four devices: a fast switch inside each, one slow link between them."""
    topo = Topology("two-servers")
    for s in range(2):
        topo.add_node(f"s{s}/sw", kind="switch", server=f"s{s}")
        for g in range(4):
            topo.add_device(device(f"s{s}/g{g}", f"s{s}"))
            topo.add_link(f"s{s}/g{g}", f"s{s}/sw", bytes_per_s=nvlink, latency_s=0.0, kind="nvlink")
    topo.add_link("s0/sw", "s1/sw", bytes_per_s=network, latency_s=0.0, kind="ethernet")
    return topo


def test_flops_are_six_per_parameter_and_token_plus_attention() -> None:
    layout = Layout(micro_batch=2, global_batch=2)
    tokens = 2 * 512
    assert flops_per_microbatch(MODEL, layout) == pytest.approx((6e9 + 12 * 8 * 1024 * 512) * tokens)


def test_memory_is_sixteen_bytes_a_parameter_and_zero_cuts_it() -> None:
    plain = memory_per_device(MODEL, Layout(dp=4, global_batch=4))
    assert plain.weights + plain.gradients + plain.optimizer == pytest.approx(16e9)
    zero1 = memory_per_device(MODEL, Layout(dp=4, global_batch=4, zero_stage=1))
    zero3 = memory_per_device(MODEL, Layout(dp=4, global_batch=4, zero_stage=3))
    assert zero1.optimizer == pytest.approx(3e9) and zero1.gradients == pytest.approx(2e9)
    assert zero3.weights + zero3.gradients + zero3.optimizer == pytest.approx(4e9)


def test_activations_follow_korthikanti_per_layer_and_in_flight_micro_batches() -> None:
    s, b, h, a = 512, 1, 1024, 16
    per_layer = s * b * h * (34 + 5 * a * s / h)  # tp = 1
    one_f_one_b = memory_per_device(MODEL, Layout(pp=2, micro_batch=1, global_batch=8))
    gpipe = memory_per_device(MODEL, Layout(pp=2, micro_batch=1, global_batch=8, schedule="gpipe"))
    assert one_f_one_b.activations == pytest.approx(per_layer * 4 * 2)  # 4 layers a stage, 2 in flight
    assert gpipe.activations == pytest.approx(per_layer * 4 * 8)  # all 8 micro-batches


def test_a_larger_microbatch_group_holds_more_chunks_and_hides_the_turn_back_to_the_first_stage() -> None:
    per_chunk = {}
    for group in (0, 8, 16):
        layout = Layout(pp=4, global_batch=16, schedule="interleaved-1f1b", chunks=2, microbatch_group=group)
        per_chunk[group] = memory_per_device(MODEL, layout).activations
        assert (" group" in layout.describe()) == bool(group)
    # the first stage holds 2 (p - 1) + (v - 1) g + 1 chunks: 11, 15, 23
    assert per_chunk[8] / per_chunk[0] == pytest.approx(15 / 11) and per_chunk[16] / per_chunk[0] == pytest.approx(
        23 / 11
    )
    steps = {}
    for group in (0, 8):
        layout = Layout(pp=4, global_batch=16, schedule="interleaved-1f1b", chunks=2, microbatch_group=group)
        steps[group] = simulate_step(MODEL, layout, two_servers(network=0.05 * GB), place(two_servers(), layout))
    assert steps[8].step_s < steps[0].step_s
    for bad, message in (
        (dict(microbatch_group=6), "in a multiple of pp=4"),
        (dict(microbatch_group=32), "groups of microbatch_group=32; 16 micro-batches a replica is not a multiple"),
        (dict(schedule="1f1b", chunks=1, microbatch_group=4), "schedule is 1f1b"),
    ):
        fields = dict(pp=4, global_batch=16, schedule="interleaved-1f1b", chunks=2) | bad
        with pytest.raises(ValueError, match=message):
            Layout(**fields)


def test_layout_rejects_a_batch_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="global_batch 10 is not a multiple of dp x micro_batch"):
        Layout(dp=4, global_batch=10)


def test_layout_rejects_layers_that_do_not_split_into_stages() -> None:
    with pytest.raises(ValueError, match="8 layers do not split into pp=3"):
        Layout(pp=3, global_batch=3).check(MODEL)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 4), (4, 8), (4, 1)])
def test_equal_stages_take_m_plus_p_minus_one_slots(schedule: str, stages: int, microbatches: int) -> None:
    span = pipeline_makespan([1.0] * stages, [2.0] * stages, 0.0, microbatches, schedule)
    assert span == pytest.approx((microbatches + stages - 1) * 3.0)


def test_gpipe_messages_lengthen_only_the_fill_and_drain() -> None:
    # the boundary is crossed once on the way in (first forward) and once on the way out (last backward)
    assert pipeline_makespan([1.0, 1.0], [2.0, 2.0], 0.5, 4, "gpipe") == pytest.approx(5 * 3.0 + 2 * 0.5)


def test_1f1b_waits_for_each_gradient_round_trip() -> None:
    # worked by hand: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3; each B waits for stage 1's B plus 0.5, and stage
    # 1's F waits for stage 0's F plus 0.5, so B0 starts at 5, B1 at 8, B2 at 12, B3 at 15 and ends at 17
    assert pipeline_makespan([1.0, 1.0], [2.0, 2.0], 0.5, 4, "1f1b") == pytest.approx(17.0)


def test_a_single_device_step_is_its_compute_and_optimizer() -> None:
    topo = star(1)
    layout = Layout(micro_batch=2, global_batch=8)
    result = simulate_step(MODEL, layout, topo, place(topo, layout), StepConfig(efficiency=0.5))
    compute = 4 * flops_per_microbatch(MODEL, layout) / (0.5 * PEAK)
    assert result.compute_s == pytest.approx(compute)
    assert result.step_s == pytest.approx(compute + result.optimizer_s)
    assert result.tp_s == result.dp_s == 0.0


def test_megatron_lm_kernels_price_each_micro_batch_as_the_compute_model_does() -> None:
    from dtrain.sim.compute import device_compute, stage_compute

    topo = star(1)
    model = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512, vocab=32000)
    layout = Layout(micro_batch=2, global_batch=8, recompute="full")
    fused = simulate_step(model, layout, topo, place(topo, layout), StepConfig())
    megatron = simulate_step(model, layout, topo, place(topo, layout), StepConfig(kernels="megatron-lm"))
    dev = topo.device(place(topo, layout)[0])
    compute = device_compute(dev.peak_flops, dev.memory_bytes_per_s)
    each = (stage_compute(model, layout, 0, compute, "megatron-lm").total_s
            - stage_compute(model, layout, 0, compute).total_s)  # fmt: skip
    assert megatron.compute_s - fused.compute_s == pytest.approx(4 * each)
    with pytest.raises(ValueError, match="kernels 'cudnn' is not one of fused, megatron-lm"):
        StepConfig(kernels="cudnn")


def test_data_parallel_adds_the_ring_all_reduce_of_the_gradients() -> None:
    topo = star(4, bytes_per_s=10 * GB, memory_bytes_per_s=1e12)
    layout = Layout(dp=4, global_batch=4)
    result = simulate_step(MODEL, layout, topo, place(topo, layout), StepConfig(overlap_dp=False))
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1 / (10 * GB), gamma_s_per_byte=3 / 1e12)
    expected = predict("all_reduce", "ring", int(2e9), 4, CostParams(intra=link))
    assert result.dp_s == pytest.approx(expected, rel=1e-3)
    assert result.step_s == pytest.approx(result.compute_s + expected + result.optimizer_s, rel=1e-6)


def test_32_bit_gradients_double_the_reduction_not_the_weight_gather() -> None:
    # DeepSpeed's BF16_Optimizer all-reduces its 32-bit gradients, then ZeRO-1 all-gathers the 16-bit weights
    from dtrain.sim.step import data_parallel_lower_bound

    topo = star(4, bytes_per_s=10 * GB, memory_bytes_per_s=1e12)
    layout = Layout(dp=4, global_batch=4, zero_stage=1)
    placement = place(topo, layout)
    half = simulate_step(MODEL, layout, topo, placement, StepConfig(overlap_dp=False))
    full = simulate_step(MODEL, layout, topo, placement, StepConfig(overlap_dp=False, gradient_bytes=4))
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1 / (10 * GB), gamma_s_per_byte=3 / 1e12)
    params = CostParams(intra=link)
    gather = predict("all_gather", "ring", int(2e9), 4, params)
    assert half.dp_s == pytest.approx(predict("all_reduce", "ring", int(2e9), 4, params) + gather, rel=1e-3)
    assert full.dp_s == pytest.approx(predict("all_reduce", "ring", int(4e9), 4, params) + gather, rel=1e-3)
    config = StepConfig(gradient_bytes=4)
    assert data_parallel_lower_bound(MODEL, layout, topo, placement, config) <= full.dp_s
    with pytest.raises(ValueError, match="gradient_bytes"):
        StepConfig(gradient_bytes=3)


@pytest.mark.parametrize("overlap", [True, False])
def test_sequence_parallel_backward_waits_for_two_all_gathers_a_layer(overlap: bool) -> None:
    # Korthikanti et al. 2022, 4.2.2: the backward of each reduce-scatter is an all-gather on the critical path;
    # the all-gather's reduce-scatter runs under the weight gradient, the input's second all-gather under the input
    # gradient (each half the all-reduce's time, tp_s): with a tp_s small enough to hide, only the two show
    from dtrain.sim.step import stage_seconds

    tp_s = 1e-7
    config = StepConfig(overlap_tp_backward=overlap)
    for sp in (True, False):
        layout = Layout(tp=2, global_batch=2, recompute="selective", sequence_parallel=sp)
        args = (MODEL, layout, 0, 312e12, 2039e9, config)
        grown = stage_seconds(*args, tp_s)[1] - stage_seconds(*args, 0.0)[1]
        per_layer = {(True, True): tp_s, (False, True): 0.0, (True, False): 3 * tp_s, (False, False): 2 * tp_s}
        assert grown == pytest.approx(MODEL.layers * per_layer[sp, overlap], rel=1e-6), (sp, overlap)


@pytest.mark.parametrize(("all_reduce_s", "exposed_s"), [(4.0, 1.0), (16.0, 10.0)])
def test_bucketed_all_reduce_hides_behind_backward_but_its_last_bucket(all_reduce_s: float, exposed_s: float) -> None:
    # 4 buckets ready at 2, 4, 6, 8 s of an 8 s backward, each taking a quarter of the all-reduce, in order
    assert exposed_bucket_s(all_reduce_s, 8.0, 100e6, 25 * 10**6) == pytest.approx(exposed_s)


def test_data_parallel_overlaps_backward_without_a_pipeline_only() -> None:
    topo = star(4, bytes_per_s=10 * GB)
    flat = simulate_step(MODEL, Layout(dp=4, global_batch=8), topo, place(topo, Layout(dp=4, global_batch=8)))
    assert flat.dp_exposed_s < flat.dp_s
    assert flat.step_s == pytest.approx(flat.compute_s + flat.dp_exposed_s + flat.optimizer_s)
    two_stage = Layout(dp=2, pp=2, global_batch=8)
    piped = simulate_step(MODEL, two_stage, topo, place(topo, two_stage))
    assert piped.dp_exposed_s == piped.dp_s


def test_a_straggler_slows_the_whole_synchronous_step() -> None:
    topo = star(2)
    layout = Layout(dp=2, global_batch=2)
    base = simulate_step(MODEL, layout, topo, place(topo, layout), StepConfig(overlap_dp=False))
    slow = simulate_step(MODEL, layout, topo, place(topo, layout), StepConfig(overlap_dp=False, slowdown={1: 1.5}))
    assert slow.step_s - base.step_s == pytest.approx(0.5 * base.compute_s)


def test_lognormal_stragglers_make_the_tail_slower_than_the_median() -> None:
    topo = star(4)
    layout = Layout(dp=4, global_batch=4)
    result = simulate_step(MODEL, layout, topo, place(topo, layout), StepConfig(straggler_sigma=0.2, samples=32))
    base = simulate_step(MODEL, layout, topo, place(topo, layout))
    assert base.step_s < result.step_s < result.step_p95_s  # the max of 4 draws has a median above 1


def test_tensor_parallel_inside_a_server_beats_it_across_servers() -> None:
    topo = two_servers()
    layout = Layout(dp=2, tp=4, global_batch=2)
    aware = simulate_step(MODEL, layout, topo, place(topo, layout, "aware"))
    oblivious = simulate_step(MODEL, layout, topo, place(topo, layout, "oblivious"))
    assert aware.tp_s < oblivious.tp_s / 10
    assert oblivious.bottleneck is not None and oblivious.bottleneck.link.kind == "ethernet"


def test_oblivious_placement_deals_ranks_round_robin_over_servers() -> None:
    topo = two_servers()
    layout = Layout(dp=8, global_batch=8)
    assert place(topo, layout, "oblivious")[:4] == ["s0/g0", "s1/g0", "s0/g1", "s1/g1"]
    assert place(topo, layout, "aware")[:4] == ["s0/g0", "s0/g1", "s0/g2", "s0/g3"]


def test_megatron_placement_puts_a_stages_replicas_on_a_server() -> None:
    # tensor, then data, then pipeline: dp2 pp2 tp2 on two servers of four holds stage 0's two replicas on s0
    topo = two_servers()
    layout = Layout(dp=2, pp=2, tp=2, global_batch=4)
    megatron, aware = place(topo, layout, "megatron"), place(topo, layout, "aware")
    assert sorted(megatron) == sorted(aware) == [d.name for d in topo.devices()]
    for d in range(2):
        for p in range(2):
            for t in range(2):
                assert megatron[grid_rank(layout, d, p, t)] == f"s{p}/g{2 * d + t}"
                assert aware[grid_rank(layout, d, p, t)] == f"s{d}/g{2 * p + t}"
    # without a pipeline or without data parallelism the two orders agree
    for flat in (Layout(dp=4, tp=2, global_batch=4), Layout(pp=4, tp=2, global_batch=4)):
        assert place(topo, flat, "megatron") == place(topo, flat, "aware")
    # the gradients' all-reduce stays inside a server, the pipeline's messages cross the slow link
    shallow = Layout(dp=2, pp=2, tp=2, global_batch=4)
    apart = simulate_step(MODEL, shallow, topo, megatron, StepConfig(overlap_dp=False))
    together = simulate_step(MODEL, shallow, topo, aware, StepConfig(overlap_dp=False))
    assert apart.dp_s < together.dp_s / 10 and apart.pp_s > together.pp_s


def test_a_layout_larger_than_the_cluster_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 16 devices"):
        place(star(4), Layout(dp=16, global_batch=16))


def test_tp_comm_overlap_hides_all_but_the_last_reduce_scatter_piece() -> None:
    # Transformer Engine's userbuffers (Megatron-Core --tp-comm-overlap): with products priced in proportion to
    # their rows and collectives shorter than a piece's product, each layer's forward shows only the last of the
    # 4 pieces of its two reduce-scatters (half an all-reduce each), and its backward none of the all-gathers
    # before the row-parallel input gradients; without it all four forward collectives show
    from dtrain.sim.step import UB_PIPELINE_SPLITS, stage_seconds

    tp_s = 1e-7
    layout = Layout(tp=4, global_batch=2, sequence_parallel=True)
    grown = {}
    for overlap in (False, True):
        config = StepConfig(efficiency=0.5, tp_comm_overlap=overlap)
        args = (MODEL, layout, 0, PEAK, 2e12, config)
        grown[overlap] = [a - b for a, b in zip(stage_seconds(*args, tp_s), stage_seconds(*args, 0.0), strict=True)]
    assert grown[False][0] == pytest.approx(MODEL.layers * 2 * tp_s)
    assert grown[True][0] == pytest.approx(MODEL.layers * 2 * (tp_s / 2) / UB_PIPELINE_SPLITS)
    assert grown[True][1] == pytest.approx(grown[False][1] - MODEL.layers * tp_s)
    plain = Layout(tp=4, global_batch=2)  # no sequence parallelism: nothing to overlap, the flag is ignored
    args = (MODEL, plain, 0, PEAK, 2e12)
    assert stage_seconds(*args, StepConfig(tp_comm_overlap=True), tp_s) == stage_seconds(*args, StepConfig(), tp_s)


def test_a_product_kept_off_some_multiprocessors_runs_its_pieces_that_much_longer() -> None:
    # a --tp-comm-overlap-cfg entry with set_sm_margin: 1 leaves the product the device's multiprocessors less the
    # communication kernel's num_sm: the attention-output product's forward pieces take sms / (sms - 27) as long
    from dtrain.sim.compute import device_compute
    from dtrain.sim.step import UB_NAMES, _flat_overlapped, stage_seconds

    tp_s = 1e-7
    layout = Layout(tp=4, global_batch=2, sequence_parallel=True)
    margin = StepConfig(efficiency=0.5, tp_comm_overlap=True, ub_sm_margin=(("proj_fprop", 27),))
    args = (MODEL, layout, 0, PEAK, 2e12)
    forward = (
        stage_seconds(*args, margin, tp_s)[0]
        - stage_seconds(*args, StepConfig(efficiency=0.5, tp_comm_overlap=True), tp_s)[0]
    )
    sms = device_compute(PEAK, 2e12).sms
    whole = _flat_overlapped(MODEL, layout, 0.5 * PEAK)[UB_NAMES.index("proj_fprop")][0]
    assert forward == pytest.approx(MODEL.layers * whole * (sms / (sms - 27) - 1), rel=1e-6)
    with pytest.raises(ValueError, match="ub_sm_margin: qkv_wgrad"):
        StepConfig(ub_sm_margin=(("qkv_wgrad", 4),))  # a bulk overlap: its product keeps every multiprocessor


@pytest.mark.parametrize(
    ("method", "collective_s", "added_s"),
    [("ring", 3.0, 0.0), ("ring", 9.0, 9.0 + 2.0 - 8.0), ("pipeline", 4.0, 1.0), ("pipeline", 16.0, 16.0 - 8.0 + 2.0)],
)
def test_overlapped_product_shows_what_its_pieces_cannot_hide(method: str, collective_s: float, added_s: float) -> None:
    # an 8 s product in 4 pieces of 2 s: a ring's 3 exchanges (collective_s / 3 each) run under the pieces before
    # them; a pipeline's 4 reduce-scatters (collective_s / 4) each after its piece, the last one after every piece
    from dtrain.sim.step import tp_overlap_s

    assert tp_overlap_s(8.0, 2.0, 2.0, 4, collective_s, method) == pytest.approx(added_s)
    with pytest.raises(ValueError, match="method"):
        tp_overlap_s(8.0, 2.0, 2.0, 4, collective_s, "bulk")


def test_tp_comm_overlap_shortens_a_sequence_parallel_step() -> None:
    topo = two_servers()
    layout = Layout(tp=4, dp=2, global_batch=4, sequence_parallel=True)
    placement = place(topo, layout)
    plain = simulate_step(MODEL, layout, topo, placement)
    overlapped = simulate_step(MODEL, layout, topo, placement, StepConfig(tp_comm_overlap=True))
    assert overlapped.step_s < plain.step_s
    assert overlapped.tp_s == plain.tp_s  # every call counted, overlapped or not


def test_a_synchronous_amax_reduction_ends_each_chunks_forward_and_backward():
    from dtrain.cluster.presets import preset
    from dtrain.sim.nccl import small_all_reduce_s

    topo = preset("h100-rail", racks=1, servers_per_rack=4)
    model = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512, vocab=32000)
    layout = Layout(dp=4, tp=2, pp=4, micro_batch=1, global_batch=16, schedule="interleaved-1f1b", chunks=2,
                    sequence_parallel=True, attention="flash", fp8=True)  # fmt: skip
    placement = place(topo, layout)
    none = simulate_step(model, layout, topo, placement, StepConfig())
    synchronous = simulate_step(model, layout, topo, placement, StepConfig(amax_reduction="synchronous"))
    stage = [grid_rank(layout, d, 0, t) for d in range(layout.dp) for t in range(layout.tp)]
    servers = len({topo.device(placement[r]).server for r in stage})
    each = small_all_reduce_s(layout.dp * layout.tp, servers)
    m, v = layout.microbatches, layout.chunks
    assert none.amax_s == 0.0 and synchronous.amax_s == pytest.approx(2 * m * v * each)
    # every action of the pipeline's critical stage is longer by one reduction, and the step by at least that
    assert synchronous.step_s - none.step_s >= 2 * m * v * each * (1 - 1e-9)
    # 16-bit layers have no amaxes: the setting changes nothing
    bf16 = Layout(dp=4, tp=2, pp=4, micro_batch=1, global_batch=16, sequence_parallel=True, attention="flash")
    assert simulate_step(model, bf16, topo, placement, StepConfig(amax_reduction="synchronous")).step_s == (
        simulate_step(model, bf16, topo, placement, StepConfig()).step_s
    )
    with pytest.raises(ValueError, match="amax_reduction 'async' is not one of none, synchronous"):
        StepConfig(amax_reduction="async")
