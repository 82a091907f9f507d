"""Calibration for ``algorithm="auto"`` (dtrain.comm.tune): measured rules in a per-machine cache, rank 0's rules
followed by every rank, a corrupt or stale cache skipped with a warning, and the interleaved measurement."""

from __future__ import annotations

import pytest
import torch

from dtrain.comm.cost import rules
from dtrain.comm.cost.rules import Rules
from tests.jobs import tune as jobs


def test_autotune_writes_the_cache_and_every_rank_follows_rank_0s_rules_and_a_corrupt_cache_means_native(
    pool, tmp_path
):
    (tmp_path / "empty").mkdir()
    out = pool.run(jobs.autotune_then_follow, 4, str(tmp_path / "cache"), str(tmp_path / "empty"), 1024, ranks=4)
    expected = out[0]["expected"]
    cached = out[0]["cached"]["all_reduce"]
    assert {a.partition("@")[0] for _, a in cached} <= {"native", "star", "ring"}, cached
    assert all(r["cached"] == out[0]["cached"] and r["expected"] == expected for r in out)
    want = expected
    for part in ("first", "second"):  # measured at the first call; loaded from rank 0's cache at the next start
        assert [r[part]["chosen"] for r in out] == [want] * 4, (part, out)
        assert all(r[part]["right"] for r in out)
    assert any("measured rules for algorithm='auto'" in w for w in out[0]["first"]["warnings"])
    corrupt = [r["corrupt"] for r in out]
    assert [c["chosen"] for c in corrupt] == ["native"] * 4 and all(c["right"] for c in corrupt)
    assert any("not a dtrain rules file" in w for w in corrupt[0]["warnings"]), corrupt[0]


def test_a_stale_cache_is_skipped_with_its_reason(tmp_path):
    path = tmp_path / "rules.json"
    made = Rules(kind="cpu", world_size=4, table={"all_reduce": ((0, "ring@peer"),)}, meta={"hostname": "elsewhere"})
    rules.save_rules(made, path)
    found, problem = rules.load_cached(path, kind="cpu", world_size=4, torch_version="2.13", host="here")
    assert found is None and "stale" in problem and "elsewhere" in problem
    found, problem = rules.load_cached(path, kind="cpu", world_size=4, torch_version="2.13", host="elsewhere")
    assert found == made and problem is None
    assert rules.split("ring@peer") == ("ring", "peer") and rules.split("native") == ("native", None)
    key = rules.cache_path("cpu", 4, "auto", "2.13.0+cpu", host="h1")
    assert key.name == "rules-h1-cpu-w4-auto-torch2.13.0_cpu.json" and key != rules.cache_path("cpu", 2, "auto", "2.13")


def test_mpi_transport_outside_mpirun_is_a_one_line_error(monkeypatch):
    from dtrain import comm
    from dtrain.comm.api import MPI_LAUNCHER_VARIABLES

    monkeypatch.setenv("DTRAIN_COMM_TRANSPORT", "mpi")
    for name in MPI_LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="DTRAIN_COMM_TRANSPORT=mpi: this process was not started by mpirun") as err:
        comm.all_reduce(torch.ones(4))
    assert "\n" not in str(err.value)


def test_a_named_transport_is_checked_before_anything_is_sent():
    from dtrain.comm.arguments import check_algorithm
    from dtrain.comm.ir.schedule import Collective

    with pytest.raises(ValueError, match="only ours may name a transport"):
        check_algorithm(Collective.ALL_REDUCE, "native@peer", 2, None, "all_reduce")
    with pytest.raises(ValueError, match="only ours may name a transport"):
        check_algorithm(Collective.ALL_REDUCE, "ring@nvlink", 2, None, "all_reduce")


def test_bench_comm_times_side_by_side_with_the_same_or_fresh_tensors_and_reports_the_ratio(pool, tmp_path):
    out = tmp_path / "bench.jsonl"
    ranks = pool.run(jobs.bench_side_by_side, 2, str(out), ranks=2)
    assert ranks[1] == [[], []]  # rank 0 reports
    for fresh, records in zip((False, True), ranks[0], strict=True):
        # torch: torch.distributed's own call, beside ours; priced as the call native makes
        assert [r["algorithm"] for r in records] == ["torch", "native", "ring", "ring@peer"]
        assert records[0]["resolved_algorithm"] == "native" and records[0]["vs_torch"] == pytest.approx(1.0)
        for r in records:
            assert r["fresh"] is fresh and r["rounds"] == 3 and len(r["runs_us"]) == 3 and r["time_us"] > 0
            assert r["time_us"] == sorted(r["runs_us"])[1]  # the median round of the slowest rank
            assert r["vs_native"] == pytest.approx(records[1]["time_us"] / r["time_us"])
            assert r["vs_torch"] == pytest.approx(records[0]["time_us"] / r["time_us"])
    assert len(out.read_text().splitlines()) == 4


def test_bench_comm_times_fresh_tensors_beside_the_same_ones_in_one_launch(pool, tmp_path):
    """``--fresh-beside``: each name again as NAME+fresh, on new tensors every call, in the same rounds; a fresh
    record is compared with torch's and native's fresh calls, a same-tensor one with their same-tensor calls."""
    ranks = pool.run(jobs.bench_fresh_beside, 2, str(tmp_path / "bench.jsonl"), ranks=2)
    assert ranks[1] == []
    records = {r["algorithm"]: r for r in ranks[0]}
    assert list(records) == ["torch", "native", "ring", "torch+fresh", "native+fresh", "ring+fresh"]
    for name, r in records.items():
        fresh = name.endswith("+fresh")
        assert r["fresh"] is fresh and r["iters"] == 3 and r["time_us"] > 0
        suffix = "+fresh" if fresh else ""
        assert r["vs_torch"] == pytest.approx(records["torch" + suffix]["time_us"] / r["time_us"])
        assert r["vs_native"] == pytest.approx(records["native" + suffix]["time_us"] / r["time_us"])
    assert records["ring+fresh"]["resolved_algorithm"] == records["ring"]["resolved_algorithm"] == "ring"
    with pytest.raises(ValueError, match="--fresh-beside already times fresh tensors"):
        from dtrain.bench.comm import BenchConfig

        BenchConfig(fresh=True, fresh_beside=True)
