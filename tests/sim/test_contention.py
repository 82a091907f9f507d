"""Communication beside compute: ``dtrain bench overlap``'s slowdowns, how the compute model prices them
(:meth:`DeviceCompute.beside_s`) and where a simulated step pays them (``StepConfig.contention``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dtrain.cluster.presets import preset
from dtrain.sim.compute import DEVICE_COMPUTE, Beside, device_compute, load_curves
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, chunked_reduction_s, exposed_bucket_s, overlapped_reduction_s, simulate_step
from tests.jobs import overlap as overlap_jobs

MODEL = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512)
BESIDE = Beside((("network", "bf16", 1.25, 1.0), ("network", "fp8", 1.1, 1.0), ("nvlink", "bf16", 1.2, 1.5)))


def test_a_collective_beside_products_costs_its_time_stretched_times_the_rate_the_products_lose() -> None:
    h100 = device_compute(989.4e12, 3350e9, curves={"h100-sxm": {"beside": BESIDE}})
    assert h100.beside_s(2.0, "network") == pytest.approx(2.0 * 1.0 * (1 - 1 / 1.25))
    assert h100.beside_s(2.0, "network", fp8=True) == pytest.approx(2.0 * (1 - 1 / 1.1))
    assert h100.beside_s(2.0, "nvlink", fp8=True) == pytest.approx(2.0 * 1.5 * (1 - 1 / 1.2))  # bf16's: no fp8 row
    assert h100.beside_s(2.0, "host") == 0.0 and h100.beside_s(0.0, "network") == 0.0
    assert DEVICE_COMPUTE["a100-sxm"].beside_s(2.0, "network") == 0.0  # not measured: free


def test_h100_takes_h200s_measurement_and_its_own_wins() -> None:
    assert device_compute(989.4e12, 3350e9, curves={"h200-sxm": {"beside": BESIDE}}).beside is BESIDE
    own = Beside((("network", "bf16", 1.5, 1.0),))
    both = {"h200-sxm": {"beside": BESIDE}, "h100-sxm": {"beside": own}}
    assert device_compute(989.4e12, 3350e9, curves=both).beside is own
    assert device_compute(312e12, 2039e9, curves={"h200-sxm": {"beside": BESIDE}}).beside is None  # A100


def test_the_curve_file_carries_slowdowns_by_path_and_precision(tmp_path) -> None:
    path = tmp_path / "curves.json"
    entry = {
        "network": {"bf16": {"product": 1.25, "collective": 1.0}},
        "nvlink": {"fp8": {"product": 1.2, "collective": 1.3}},
    }
    path.write_text(json.dumps({"devices": {"h200-sxm": {"beside": entry}}}))
    beside = load_curves(path)["h200-sxm"]["beside"]
    assert beside.get("network", "fp8") == (1.25, 1.0) and beside.get("nvlink", "fp8") == (1.2, 1.3)
    assert beside.get("nvlink", "bf16") is None
    entry["network"]["bf16"]["product"] = 0.5  # a product faster beside a collective is a broken measurement
    path.write_text(json.dumps({"devices": {"h200-sxm": {"beside": entry}}}))
    with pytest.raises(ValueError, match="slowdowns"):
        load_curves(path)
    shipped = load_curves()  # the package's file: measured over NVLink and NCCL's network path
    assert {p for p, *_ in shipped["h200-sxm"]["beside"].factors} == {"nvlink", "network"}


def test_reductions_report_what_runs_under_each_stages_compute() -> None:
    layout = Layout(dp=4, pp=2, global_batch=8, zero_stage=1, schedule="interleaved-1f1b", chunks=2)
    dp = [SimpleNamespace(time_s=4.0), SimpleNamespace(time_s=1.0)]  # reduce-scatter, all-gather: 2.0, 0.5 a chunk
    edges = [([0.0, 2.0], [(1, 10.0), (1, 11.0), (0, 12.0), (0, 13.0)]),
             ([1.0, 3.0], [(1, 9.0), (1, 10.5), (0, 11.5), (0, 12.5)])]  # fmt: skip
    # stage 0 reduces chunk 1 over 11-13 (its last backward ends at 13), chunk 0 over 13-15 (idle); stage 1
    # chunk 1 over 11.5-13.5 (busy until 12.5), chunk 0 after
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True)
    under: list[float] = []
    chunked_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], edges, 13.0, under)
    assert under == pytest.approx([2.0, 1.0])
    layout = Layout(dp=4, pp=2, global_batch=8, zero_stage=1)
    dp = [SimpleNamespace(time_s=1.3), SimpleNamespace(time_s=0.5)]
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    under = []
    overlapped_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [(0.0, 10.0), (0.3, 9.5)],
                           10.0, under)  # fmt: skip
    first = 0.5e9 * 2
    left, wait = exposed_bucket_s(1.3, 2.0, first, 80e6), exposed_bucket_s(0.5, 1.0, first, 80e6)
    # stage 0: its buckets under its last backward, its gather under its first forward; stage 1: its one bucket
    # after its last backward (idle), its gather after its first forward starts at 0.3 s
    assert under == pytest.approx([1.3 - left + 0.5 - wait, 0.5 - 0.3])


def test_a_step_pays_for_the_data_parallel_reduction_it_hides_and_only_with_contention() -> None:
    topology = preset("h100-rail", racks=1, servers_per_rack=2)  # 16 H100s: dp 2 across the two servers
    layout = Layout(dp=2, tp=8, global_batch=8, zero_stage=1)
    placement = place(topology, layout)
    on = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    off = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, contention=False)
    paid, free = (simulate_step(MODEL, layout, topology, placement, c) for c in (on, off))
    assert free.contention_s == 0.0 and paid.contention_s > 0
    assert paid.step_s == pytest.approx(paid.pipeline_s + paid.dp_exposed_s + paid.contention_s + paid.optimizer_s)
    hidden = paid.dp_s - paid.dp_exposed_s  # all of it under the one stage's compute, nothing exposed left over
    beside = device_compute(989.4e12, 3350e9).beside_s(hidden, "network")
    assert paid.contention_s == pytest.approx(beside, rel=0.05)
    # the tensor-parallel collectives under the weight gradients lengthen the compute too (NVLink's factors)
    assert paid.pipeline_s > free.pipeline_s
    flat = StepConfig(efficiency=0.5, distributed_optimizer=True, overlap_grad_reduce=True)
    assert simulate_step(MODEL, layout, topology, placement, flat).contention_s == 0.0


def test_bench_overlap_times_products_beside_collectives_on_gloo(pool) -> None:
    from dtrain.bench.overlap import factors

    ranks = pool.run(overlap_jobs.bench_overlap, 2, ranks=2)
    records = ranks[0]
    assert ranks[1] == [] and {(r["product"], r["collective"]) for r in records} == {
        ("bf16", "all-reduce"),
        ("bf16", "all-gather"),
    }
    for r in records:
        assert r["path"] == "host" and r["world"] == 2 and r["backend"] == "gloo"
        assert r["product_s"] > 0 and r["collective_s"] > 0
        assert r["product_slowdown"] > 0 and r["collective_slowdown"] > 0
    assert set(factors(records)) == {"host"} and set(factors(records)["host"]) == {"bf16"}


def test_bench_overlap_refuses_bad_flags_before_any_rank_starts() -> None:
    from dtrain.bench.overlap import OverlapConfig

    with pytest.raises(ValueError, match="--collectives: broadcast"):
        OverlapConfig(collectives=("broadcast",))
    with pytest.raises(ValueError, match="--nproc must be >= 2"):
        OverlapConfig(nproc=1)
    with pytest.raises(ValueError, match="--hidden 100 must divide by --tp 8"):
        OverlapConfig(hidden=100, tp=8)
