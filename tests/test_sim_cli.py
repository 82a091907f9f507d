"""dtrain simulate collective|train and dtrain plan: the command line on presets, JSON and tables."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.cli.main import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_collective_reports_time_and_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "simulate", "collective", "--topology", "h100-node", "--bytes", "1G")
    assert data["ranks"] == 8 and data["bytes"] == 2**30
    # ring all-reduce moves 2 (p-1)/p of the buffer through each GPU's NVLink 4 (450 GB/s a direction) and
    # reduces (p-1)/p of it, reading two operands and writing one at the H100's 3.35 TB/s
    wire_s, reduce_s = 2 * 7 / 8 * 2**30 / 450e9, 7 / 8 * 2**30 * 3 / 3.35e12
    assert data["time_s"] == pytest.approx(wire_s + reduce_s, rel=0.02)
    assert data["bottleneck"].endswith("nvswitch")


def test_hierarchical_beats_ring_across_oversubscribed_racks(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["simulate", "collective", "--topology", "4-rack", "--bytes", "64M", "--ranks", "32"]
    ring = run_json(capsys, *common, "--algorithm", "ring", "--placement", "oblivious")
    hierarchical = run_json(capsys, *common, "--algorithm", "hierarchical")
    assert hierarchical["time_s"] < ring["time_s"]


def test_simulate_train_prints_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "2", "--tp", "4", "--global-batch", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "one training step" in out and "tp_comm_s" in out and "links over the step" in out


def test_simulate_train_counts_a_straggler(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--zero", "1"]
    base = run_json(capsys, *argv)
    slow = run_json(capsys, *argv, "--slow-rank", "5:2")
    assert slow["step_s"] - base["step_s"] == pytest.approx(base["compute_s"], rel=1e-6)


def test_plan_lists_the_fastest_layouts_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--topology", "h100-node", "--global-batch", "16", "--top", "3")
    steps = [p["step_s"] for p in data["plans"]]
    assert len(steps) == 3 and steps == sorted(steps)
    assert all(p["fits"] for p in data["plans"]) and data["too_big"] > 0


def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "train", "--topology", "h100-node", "--dp", "3", "--global-batch", "8"]) == 2
    captured = capsys.readouterr()
    assert "not a multiple of dp x micro_batch" in captured.out + captured.err
    assert main(["simulate", "collective", "--topology", "no-such-preset", "--bytes", "1M"]) == 2


def test_the_simulator_imports_no_torch() -> None:
    code = "import sys, dtrain.sim, dtrain.sim.planner, dtrain.sim.fit; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_algorithm_all_compares_every_algorithm_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "simulate", "collective", "--topology", "h100-node", "--bytes", "64M", "--algorithm", "all")
    names = [r["algorithm"] for r in data["algorithms"]]
    assert {"ring", "tree", "halving_doubling", "direct", "star"} <= set(names)
    assert [r["time_s"] for r in data["algorithms"]] == sorted(r["time_s"] for r in data["algorithms"])


def test_a_calibration_file_sets_the_software_costs(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    calibration = tmp_path / "calibration.json"
    link = {"alpha_s": 1e-3, "beta_s_per_byte": 1e-12, "gamma_s_per_byte": 0.0}
    calibration.write_text(json.dumps({"intra": link, "inter": None}))
    common = ["simulate", "collective", "--topology", "h100-node", "--bytes", "8K", "--algorithm", "ring"]
    free = run_json(capsys, *common)
    slow = run_json(capsys, *common, "--calibration", str(calibration))
    assert slow["time_s"] - free["time_s"] == pytest.approx(14 * 1e-3, rel=0.01)  # 2 (p - 1) rounds of alpha
