"""The simulator against published iteration times (benchmarks/sim/published.toml): a real check of its error.

The test simulates the rows that take about a second each (collectives of more than 1,000 messages in lock-step
rounds, within 0.5% of the exact replay on every row); ``python benchmarks/sim/validate.py published`` runs
every row, the held-out set included, with the exact replay."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "sim" / "validation"))

import published  # noqa: E402

from dtrain.sim.nccl import small_all_reduce_s  # noqa: E402
from dtrain.sim.placement import grid_rank, place  # noqa: E402

KORTHIKANTI = [f"korthikanti22-{size}-{how}" for size in ("22b", "175b", "530b") for how in ("full", "selective-sp")]
NARAYANAN = [f"narayanan21-{size}" for size in ("1.7b", "3.6b", "7.5b", "18.4b", "39.1b")]


@functools.cache
def _rows() -> dict[str, dict]:
    return {row["name"]: row for row in published.load()}


@functools.cache
def _result(name: str) -> dict:
    row = _rows()[name]
    return published.simulate(row, published.config_of(row, flow_limit=1000))


def _errors(names: list[str]) -> list[float]:
    return [abs(_result(n)["error"]) for n in names]


def test_throughput_rows_convert_with_the_papers_flop_count() -> None:
    rows = _rows()
    # MT-NLG publishes both: 60.1, 50.2 and 44.4 s are 126, 121 and 113 TFLOP/s per GPU under equation 3
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        row = rows[f"smith22-mtnlg-530b-{nodes}n"]
        achieved = published.iteration_flops(row) / (nodes * 8 * row["iteration_s"]) / 1e12
        assert achieved == pytest.approx(tflops, rel=0.005)
    # Narayanan et al. 2021, table 1's aggregate column: 502.0 PFLOP/s for 1T, 4.4 for 1.7B
    for name, aggregate in (("narayanan21-1008b", 502.0), ("narayanan21-1.7b", 4.4)):
        row = rows[name]
        assert published.iteration_flops(row) / row["iteration_s"] / 1e15 == pytest.approx(aggregate, rel=0.01)
    assert {row["set"] for row in rows.values()} == set(published.SETS)


def test_korthikanti_rows_are_predicted_within_the_targets() -> None:
    errors = _errors(KORTHIKANTI)
    assert statistics.median(errors) <= published.MEDIAN_TARGET, dict(zip(KORTHIKANTI, errors, strict=True))
    assert max(errors) <= published.WORST_TARGET, dict(zip(KORTHIKANTI, errors, strict=True))
    assert all(_result(n)["fits"] for n in KORTHIKANTI), "every published layout fits an 80 GB A100"
    # selective recomputation with sequence parallelism is faster than full recomputation, as published
    for size in ("22b", "175b", "530b"):
        selective = _result(f"korthikanti22-{size}-selective-sp")["predicted_s"]
        assert selective < _result(f"korthikanti22-{size}-full")["predicted_s"]


def test_narayanan_rows_are_low_and_within_the_worst_target() -> None:
    results = [_result(n) for n in NARAYANAN]
    assert all(r["error"] < 0 for r in results), "the model leaves work out: every prediction is low"
    assert max(_errors(NARAYANAN)) <= published.WORST_TARGET, {r["name"]: round(r["error"], 3) for r in results}
    assert all(r["fits"] for r in results)


@pytest.mark.xfail(
    strict=True,
    reason="Megatron-LM of 2021 ran 12-19% slower than the model predicts on these rows "
    "(docs/simulator-validation.md); strict: passing means the model meets the median target here",
)
def test_narayanan_rows_meet_the_median_target() -> None:
    assert statistics.median(_errors(NARAYANAN)) <= published.MEDIAN_TARGET


def test_megatron_step_costs_each_add_time() -> None:
    # Megatron-LM's synchronous pipeline exchanges, its tied embedding's all-reduce and its mixed-precision
    # optimizer step (published.config_of) each only add to the step

    from dtrain.sim.compute import ADAM_BYTES_PER_PARAMETER, MEGATRON_FP16_OPTIMIZER_BYTES

    row = _rows()["korthikanti22-175b-full"]
    config = published.config_of(row, flow_limit=1000)
    full = _result("korthikanti22-175b-full")
    for change in ({"synchronous_p2p": False}, {"tied_embedding_allreduce": False},
                   {"optimizer_bytes": ADAM_BYTES_PER_PARAMETER}):  # fmt: skip
        lighter = published.simulate(row, dataclasses.replace(config, **change))
        assert lighter["predicted_s"] < full["predicted_s"], change
    assert full["dp_exposed_s"] > 0, "dp 1, yet the first and last stages all-reduce the embedding's gradient"
    assert lighter["optimizer_s"] * MEGATRON_FP16_OPTIMIZER_BYTES == pytest.approx(
        full["optimizer_s"] * ADAM_BYTES_PER_PARAMETER, rel=0.01
    )


def test_bloom_counts_its_embeddings_as_layers_of_the_pipeline() -> None:
    # DeepSpeed's "type:transformer|embedding" split of BLOOM-176B: [embed | 5], 6 x 10, [5 | embed]
    from dtrain.sim.model import Layout, memory_per_device, stage_layers, stage_parameters
    from dtrain.sim.planner import candidate_layouts

    row = _rows()["lescao22-bloom-176b"]
    model, layout = published.model_of(row), published.layout_of(row)
    assert [stage_layers(model, layout, s) for s in range(layout.pp)] == [5] + [6] * 10 + [5]
    total = sum(stage_parameters(model, layout, s) for s in range(layout.pp))
    assert total == pytest.approx(model.parameters + model.vocab * model.hidden)  # the output layer's copy
    assert memory_per_device(model, layout).total < 80e9
    with pytest.raises(ValueError, match="do not split"):
        Layout(dp=1, tp=4, pp=16, global_batch=16, embedding_layers=1).check(model)  # 72 over 16
    with pytest.raises(ValueError, match="one model chunk"):
        Layout(pp=12, global_batch=12, schedule="interleaved-1f1b", chunks=2, embedding_layers=1)
    # the planner tries the split where the layers alone do not divide
    found = candidate_layouts(model, 384, 2048, micro_batches=(2,), zero_stages=(1,), max_tp=4)
    assert any(c.pp == 12 and c.tp == 4 and c.embedding_layers == 1 for c in found)
    assert all(c.embedding_layers == 0 for c in found if model.layers % c.pp == 0)
    result = published.simulate(row)
    assert result["fits"] and result["error"] < 0, result
    # DeepSpeed's BF16_Optimizer reduces 32-bit gradients; Megatron-LM's --fp16 runs 16-bit ones
    assert published.config_of(row).gradient_bytes == 4
    assert published.config_of(_rows()["narayanan21-39.1b"]).gradient_bytes == 2
    # Megatron-LM's layer of 2021-2022 on the Narayanan and Korthikanti rows, the compute model's elsewhere
    assert published.config_of(_rows()["narayanan21-1.7b"]).kernels == "megatron-lm"
    assert published.config_of(_rows()["korthikanti22-22b-full"]).kernels == "megatron-lm"
    assert published.config_of(row).kernels == "fused"


def test_h100_rows_load_and_simulate() -> None:
    # Megatron-Core r0.8.0's H100 table (Megatron-LM README): GPUs x TFLOP/s is the table's aggregate PFLOP/s,
    # and the sizes are those of a GPT whose output layer has its own matrix

    rows = _rows()
    for name, aggregate, size in (("mcore24-h100-1.7b", 19.6, 1.7e9), ("mcore24-h100-462b", 2825.6, 462e9)):
        row = rows[name]
        assert published.iteration_flops(row) / row["iteration_s"] / 1e15 == pytest.approx(aggregate, rel=0.005)
        assert published.model_of(row).parameters == pytest.approx(size, rel=0.03)
    row = rows["mcore24-h100-1.7b"]
    from dtrain.sim.model import stage_parameters

    model, layout = published.model_of(row), published.layout_of(row)
    assert stage_parameters(model, layout, 0) == pytest.approx(model.parameters)  # both matrices on one stage
    assert not published.config_of(row).tied_embedding_allreduce
    assert published.config_of(row).distributed_optimizer  # Megatron-Core's reduce-scatter of the gradients
    # the README's --tp-comm-overlap (Transformer Engine's userbuffers) on every H100 row with tensor parallelism
    for other in rows.values():
        transformer_engine = other["name"].startswith(("mcore24-", "mlperf", "nemo24-"))
        used = transformer_engine and other["tp"] > 1
        assert published.config_of(other).tp_comm_overlap == used, other["name"]
        # the README's overlapped pipeline exchanges (Megatron-Core's overlap_p2p_comm), kept only with interleaving:
        # interleaved where a stage's layers leave one chunk count (a prime count of layers, one layer a chunk)
        mcore = other["name"].startswith("mcore24-")
        assert published.config_of(other).overlap_p2p_comm == transformer_engine, other["name"]
        assert published.config_of(other).grad_accumulation_fusion == transformer_engine, other["name"]
        if mcore and other["pp"] > 1:
            per_stage = other["layers"] // other["pp"]
            choices = [c for c in range(2, per_stage + 1) if per_stage % c == 0]
            interleaved = published.layout_of(other).schedule == "interleaved-1f1b"
            assert interleaved == (len(choices) == 1), other["name"]
            assert not interleaved or published.layout_of(other).chunks == per_stage, other["name"]
    config = published.config_of(row, flow_limit=1000)
    result = published.simulate(row, config)
    assert result["fits"] and result["compute_s"] < result["published_s"], result
    # the distributed optimizer's reduce-scatter and all-gather run under compute only with the overlaps
    exposed = published.simulate(row, dataclasses.replace(config, overlap_grad_reduce=False,
                                                          overlap_param_gather=False))  # fmt: skip
    assert result["dp_exposed_s"] < exposed["dp_exposed_s"]


MLPERF_41 = ["mlperf41-nvidia-256", "mlperf41-nvidia-512"]


def test_mlperf_rows_are_the_logged_layouts_in_fp8() -> None:
    rows = [row for row in _rows().values() if row["name"].startswith("mlperf")]
    assert len(rows) == 16 and {row["set"] for row in rows} == {"validation"}
    for row in rows:
        layout = published.layout_of(row)
        assert layout.fp8 and layout.sequence_parallel and layout.schedule == "interleaved-1f1b", row["name"]
        assert layout.world_size in {256, 512, 768, 1536, 3584, 4096, 6144, 8192, 10240, 10752, 11616}
        assert (row["layers"], row["hidden"], row["heads"], row["sequence"]) == (96, 12288, 96, 2048)
        # FP8 weights (FP8_PARAMS) from v4.0 on
        assert layout.fp8_params == row["name"].startswith(("mlperf40", "mlperf41")), row["name"]
    # 2 layers a chunk and micro-batches of 2 (v4.1): within the targets, and the layouts that ran fit
    results = [_result(n) for n in MLPERF_41]
    assert all(r["fits"] for r in results), results
    assert max(_errors(MLPERF_41)) <= published.MEDIAN_TARGET, results


def test_mlperf_v30_rows_wait_for_their_amax_reduction_after_every_action() -> None:
    """v3.0's Transformer Engine all-reduces the FP8 amaxes over a stage's tensor- and data-parallel ranks on the
    compute stream after each chunk's forward and backward; v3.1 on, asynchronously over the tensor-parallel ranks
    alone (benchmarks/sim/published.toml)."""
    rows = [row for row in _rows().values() if row["name"].startswith("mlperf")]
    for row in rows:
        expected = "synchronous" if row["name"].startswith("mlperf30") else "none"
        assert published.config_of(row).amax_reduction == expected, row["name"]
    row = _rows()["mlperf30-coreweave-3584"]  # 448 GPUs a stage, 2 x 24 x 12 actions a step
    priced = _result(row["name"])
    layout = published.layout_of(row)
    topology = published.cluster_of(row)
    placement = place(topology, layout, published.PLACEMENT)
    stage = {placement[grid_rank(layout, d, 0, t)] for d in range(layout.dp) for t in range(layout.tp)}
    servers = len({topology.device(name).server for name in stage})
    assert servers == 56, "two replicas of a stage a server: 112 replicas x tp 4 on 56 servers"
    assert priced["amax_s"] == pytest.approx(2 * 24 * 12 * small_all_reduce_s(448, servers))
    left_out = published.simulate(row, dataclasses.replace(published.config_of(row, 1000), amax_reduction="none"))
    assert priced["predicted_s"] - left_out["predicted_s"] > 0 and priced["error"] > left_out["error"]
    assert priced["error"] < 0, "the prediction stays low: the reduction closes part of the gap"


def test_mlperf_v30_rows_run_flashattention_1_dearer_than_flashattention_2() -> None:
    """MLPerf v3.0 ran flash-attn 1.0.5 (the rows' ``attention_kernel`` "fa1"): one sequence a chunk of one layer,
    its attention a large part of each action. Priced as FlashAttention-2 (v3.1's kernel) or cuDNN's the same row
    runs faster and misses the published time by more."""
    rows = _rows()
    assert {n for n, r in rows.items() if r.get("attention_kernel") == "fa1"} == {
        n for n in rows if n.startswith("mlperf30-")
    }
    row = rows["mlperf30-coreweave-3584"]
    ran = _result(row["name"])
    assert abs(ran["error"]) <= published.WORST_TARGET
    others = {
        kernel: published.simulate(row, dataclasses.replace(published.config_of(row, 1000), attention_kernel=kernel))
        for kernel in ("fa2", "cudnn")
    }
    assert ran["predicted_s"] > others["fa2"]["predicted_s"] > others["cudnn"]["predicted_s"]
    assert abs(others["fa2"]["error"]) > abs(ran["error"]) and others["fa2"]["error"] < 0


def test_rows_run_in_megatron_lms_rank_order() -> None:
    """Megatron-LM and DeepSpeed put pipeline stages outermost: with tp 4 on 8-GPU servers a server holds two
    replicas of one stage, so each stage's data-parallel ring reduces half its bytes over NVLink and sends half as
    many through the server's NICs as in dtrain train's order, where a server holds two stages of one replica."""
    row = _rows()["mlperf41-nvidia-512"]
    layout, topology = published.layout_of(row), published.cluster_of(row)
    placement = place(topology, layout, published.PLACEMENT)
    first = topology.device(placement[0]).server
    on_first = {(d, p) for d in range(layout.dp) for p in range(layout.pp) for t in range(layout.tp)
                if topology.device(placement[grid_rank(layout, d, p, t)]).server == first}  # fmt: skip
    assert on_first == {(0, 0), (1, 0)}, "two replicas of the first stage"
    assert published.PLACEMENT == "megatron"
    ours = _result(row["name"])
    theirs_in_ours = published.simulate(row, published.config_of(row, 1000), "aware")
    assert ours["dp_exposed_s"] < theirs_in_ours["dp_exposed_s"]
    assert ours["contention_s"] == pytest.approx(theirs_in_ours["contention_s"] / 2, rel=0.1)


def test_fp8_weights_halve_the_gather_and_drop_the_16_bit_copy() -> None:

    from dtrain.sim.model import memory_per_device
    from dtrain.sim.traffic import dp_phase_bytes

    row = _rows()["mlperf41-nvidia-512"]
    model, layout = published.model_of(row), published.layout_of(row)
    plain = dataclasses.replace(layout, fp8_params=False)
    gathers = [(n, item) for lay in (layout, plain) for c, n, item in dp_phase_bytes(model, lay, 2, True)
               if c.name == "ALL_GATHER"]  # fmt: skip
    assert gathers[0][1] == 1 and gathers[1][1] == 2 and gathers[0][0] * 2 == pytest.approx(gathers[1][0])
    assert memory_per_device(model, plain).weights == pytest.approx(2 * memory_per_device(model, layout).weights)
    with pytest.raises(ValueError, match="needs fp8"):
        dataclasses.replace(layout, fp8=False)


def test_plan_checks_run_in_worker_processes_alike() -> None:
    rows = [_rows()[n] for n in ("korthikanti22-22b-full", "korthikanti22-22b-selective-sp")]
    alone = list(published._plan_checks(rows, 120, 1000, published.PLACEMENT, 1))
    pooled = list(published._plan_checks(rows, 120, 1000, published.PLACEMENT, 2))
    lines = (ROOT / "benchmarks" / "results" / "sim_validation_plan-cpu16.jsonl").read_text().splitlines()
    recorded = {r["name"]: r for r in map(json.loads, lines)}
    for a, b in zip(alone, pooled, strict=True):
        a.pop("search_s"), b.pop("search_s")
        assert a == b and a["placement"] == "megatron"
        assert {k: v for k, v in recorded[a["name"]].items() if k != "search_s"} == pytest.approx(a)


def test_nemo_long_sequence_rows_run_context_parallelism_under_nemos_flop_count() -> None:
    rows = {name: row for name, row in _rows().items() if name.startswith("nemo24-")}
    assert len(rows) == 9
    for row in rows.values():
        layout = published.layout_of(row)
        assert layout.world_size == row["sequence"] // 1024  # as many GPUs as thousands of tokens
        assert (layout.cp > 1) == (row["sequence"] >= 32768) and layout.attention == "flash" and layout.fp8
    model = published.model_of(rows["nemo24-llama2-7b-4k"])
    assert model.parameters == pytest.approx(6.74e9, rel=0.005)  # Llama 2 7B
    # NeMo's llama2 formula (nemo/utils/flops_formulas.py), the attention over the whole square
    row = rows["nemo24-llama2-7b-1024k"]
    b, s, layers, h, f, v = row["global_batch"], row["sequence"], 32, 4096, 11008, 32000
    nemo = b * s * layers * h * h * (12 + 12 + 18 * f / h + 12 * s / h + 6 * v / (layers * h))
    assert published.iteration_flops(row) == pytest.approx(nemo)
    assert row["iteration_s"] == pytest.approx(nemo / (1024 * 536e12))
    result = _result("nemo24-llama2-7b-32k")
    assert result["cp_ring_s"] > 0 and result["fits"] and result["layout"].startswith("dp8 cp2 tp2 pp1")
