"""One pool of 8 Gloo processes for the whole test run; subgroups of 2, 3 and 4 ranks live inside it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtrain.testing.pool import ProcessPool  # noqa: E402

POOL_WORLD = 8
SUBGROUP_SIZES = (2, 3, 4)


@pytest.fixture(scope="session")
def pool():
    with ProcessPool(POOL_WORLD, sizes=SUBGROUP_SIZES, timeout_s=120) as p:
        yield p
