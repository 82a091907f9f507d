"""docs/results.md is what benchmarks/report.py writes from benchmarks/results/: no figure is typed by hand."""

from __future__ import annotations

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
