"""docs/results.md is what benchmarks/report.py writes from benchmarks/results/, and the tables of
docs/simulator-validation.md what benchmarks/sim/validate.py prints from its files: no figure is typed by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_results_page_is_regenerated_from_the_data():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check", "--no-figures"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_validation_pages_tables_are_those_of_the_data():
    results = ROOT / "benchmarks" / "results"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sim" / "validate.py"), "published", "--tables",
         "--out", str(results / "sim_validation-cpu2.jsonl"),
         "--plan-out", str(results / "sim_validation_plan-cpu16.jsonl"),
         "--doc", str(ROOT / "docs" / "simulator-validation.md"), "--check"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
