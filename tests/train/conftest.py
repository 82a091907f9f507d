"""A ``dtrain train`` run that tests of several files read, started once: two ranks at dp 2 for four steps.

tests/train/test_train.py checks its metrics and its plan score and holds it against one rank on the global batch;
tests/train/test_elastic.py takes it as the uninterrupted run that a run with a killed rank or a lost node must
equal, and resumes from its checkpoint of step 2 at another layout. The plan's flags only record a prediction
beside the measurement and ``--max-restarts`` only matters when a rank fails, so neither changes a number the
elastic tests compare.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DP2_STEPS = 4
# float32, a short sequence, constant learning rate after one warmup step: fast, and exact across layouts
DP2_MODEL = [
    *("--steps", str(DP2_STEPS), "--checkpoint-every", "2", "--seq-len", "32", "--batch-size", "8"),
    *("--precision", "float32", "--warmup-steps", "1", "--no-tensorboard", "--no-export"),
]
DP2_PLANNED = ["--plan-step-s", "0.25", "--plan-memory-gib", "2", "--plan-layout", "dp2 tp1 pp1"]
DP2_PLANNED += ["--plan-topology", "t"]
DP2_FLAGS = ["--nproc", "2", "--dp", "2", *DP2_MODEL, "--max-restarts", "2", *DP2_PLANNED]


def launch_env(**env: str) -> dict[str, str]:
    """This process's environment without a rank's variables or a kill point, with the repository importable."""
    from dtrain.launch import KILL_ENV

    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", KILL_ENV)}
    return base | {"PYTHONPATH": str(REPO)} | env


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory) -> tuple[Path, str]:
    """The run's output directory (checkpoints at steps 2 and 4, metrics, plan score) and its stdout."""
    out = tmp_path_factory.mktemp("dp2")
    command = [sys.executable, "-m", "dtrain", "train", "--out", str(out), *DP2_FLAGS]
    done = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout
