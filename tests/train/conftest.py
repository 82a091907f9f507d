"""A ``dtrain train`` run that tests of several files read, started once: two ranks at dp 2 for four steps.

tests/train/test_train.py checks its metrics and its plan score and holds it against one rank on the global batch;
tests/train/test_elastic.py takes it as the uninterrupted run that a run with a killed rank or a lost node must
equal, and resumes from its checkpoint of step 2 at another layout. The plan's flags only record a prediction
beside the measurement and ``--max-restarts`` only matters when a rank fails, so neither changes a number the
elastic tests compare. It runs by this process's command line (:func:`dtrain.testing.command.train_in_process`:
the launcher and ranks of ``python -m dtrain train``, without a new interpreter); the runs with a killed rank or a
lost node are subprocesses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.testing.command import train_in_process

DP2_STEPS = 4
# float32, a short sequence, constant learning rate after one warmup step: fast, and exact across layouts
DP2_MODEL = [
    *("--steps", str(DP2_STEPS), "--checkpoint-every", "2", "--seq-len", "32", "--batch-size", "8"),
    *("--precision", "float32", "--warmup-steps", "1", "--no-tensorboard", "--no-export"),
]
DP2_PLANNED = ["--plan-step-s", "0.25", "--plan-memory-gib", "2", "--plan-layout", "dp2 tp1 pp1"]
DP2_PLANNED += ["--plan-topology", "t"]
DP2_FLAGS = ["--nproc", "2", "--dp", "2", *DP2_MODEL, "--max-restarts", "2", *DP2_PLANNED]


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory) -> tuple[Path, str]:
    """The run's output directory (checkpoints at steps 2 and 4, metrics, plan score) and the launching process's
    stdout."""
    out = tmp_path_factory.mktemp("dp2")
    return out, train_in_process(out, *DP2_FLAGS)
