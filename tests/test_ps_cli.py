"""``dtrain ps`` end to end: roles as processes, a fault injected, metrics as JSON lines; bad flags refused."""

from __future__ import annotations

import json

from dtrain.cli.main import main


def test_dtrain_ps_trains_through_a_server_kill_and_writes_json_lines(tmp_path, capsys):
    status = main(["ps", "--model", "synthetic", "--mode", "async", "--steps", "40", "--servers", "2",
                   "--replicas", "2", "--fault", "1:10", "--compute-s", "0.01", "--dead-after-s", "0.5",
                   "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert status == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps, summary = [x for x in lines if "step" in x], lines[-1]
    assert len(steps) == 2 * 40 and summary["summary"]
    assert [e["dead"] for e in summary["failovers"]] == [[1]]
    assert summary["lost_acknowledged_updates"] == 0 and summary["recovery_s"] > 0
    assert "training went on after" in capsys.readouterr().out


def test_dtrain_ps_refuses_a_straggler_that_does_not_exist(capsys):
    assert main(["ps", "--workers", "2", "--straggler", "5:2", "--no-progress"]) == 2
    assert "workers are 0..1" in capsys.readouterr().out
