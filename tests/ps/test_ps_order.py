"""Keys in any order, and repeated: pulls return rows in the order of their keys, pushes sum a repeated key's
gradients, both on a shard's state and through a live cluster."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.ps.config import JobConfig
from dtrain.ps.consistency import Push, combine
from dtrain.ps.keys import KeyRange
from dtrain.ps.launch import LocalCluster
from dtrain.ps.optimizers import make_optimizer, rows_index
from dtrain.ps.shard import Entry, ShardState
from dtrain.ps.worker import Worker


@pytest.mark.parametrize(
    ("rows", "expected"),
    [([2, 3, 4], slice(2, 5)), ([7], slice(7, 8)), ([0, 1], slice(0, 2)), ([0, 2, 1, 3], None), ([1, 0], None),
     ([0, 0, 2], None), ([3, 3, 3], None), ([0, 1, 1, 2], None), ([2, 1, 2, 3], None)],
)  # fmt: skip
def test_only_a_contiguous_increasing_run_becomes_a_slice(rows, expected):
    index = rows_index(np.array(rows, np.int64))
    if expected is None:
        assert isinstance(index, np.ndarray) and index.tolist() == rows
    else:
        assert index == expected


def _shard(lo: int = 0, hi: int = 6) -> ShardState:
    config = JobConfig(num_keys=hi, width=1, lr=1.0)
    state = ShardState(config, 0, KeyRange(lo, hi))
    values = 10 * np.arange(lo, hi, dtype=np.float32)[:, None]
    assert state.apply(Entry(1, "init", 0, np.zeros(0, np.int64), values))
    return state


@pytest.mark.parametrize("keys", [[0, 2, 1, 3], [0, 0, 2], [3, 2, 1, 0], [5, 5], [1, 2, 2, 3], [4, 1, 2, 3]])
def test_a_shard_returns_rows_in_the_order_of_the_keys(keys):
    assert _shard().rows(np.array(keys, np.int64))[:, 0].tolist() == [10.0 * k for k in keys]


def test_a_shard_not_starting_at_zero_returns_rows_in_order():
    state = _shard(lo=4, hi=10)
    assert state.rows(np.array([4, 6, 5, 7], np.int64))[:, 0].tolist() == [40.0, 60.0, 50.0, 70.0]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_an_optimizer_step_on_rows_in_any_order_equals_the_sorted_step(name):
    rng = np.random.default_rng(0)
    config = JobConfig(num_keys=6, width=3, optimizer=name, momentum=0.5, lr=0.1)
    start = rng.standard_normal((6, 3)).astype(np.float32)
    rows, grads = np.array([0, 2, 1, 3]), rng.standard_normal((4, 3)).astype(np.float32)
    order = np.argsort(rows)
    a, b = start.copy(), start.copy()
    make_optimizer(config, 6, 3).step(a, rows, grads)
    make_optimizer(config, 6, 3).step(b, rows[order], grads[order])
    np.testing.assert_array_equal(a, b)


def test_a_repeated_key_in_a_push_is_summed_and_the_keys_come_out_sorted():
    keys, grads = np.array([3, 1, 3], np.int64), np.array([[1.0], [2.0], [4.0]], np.float32)
    out_keys, out = combine([Push(0, 0, 0, keys, grads, ())], width=1)
    assert out_keys.tolist() == [1, 3] and out[:, 0].tolist() == [2.0, 5.0]
    two = [Push(w, 0, 0, keys, grads * (w + 1), ()) for w in range(2)]  # the mean over workers of their sums
    out_keys, out = combine(two, width=1)
    assert out_keys.tolist() == [1, 3] and out[:, 0].tolist() == [3.0, 7.5]


# --- through a live cluster: two servers, shard 0 holds keys 0..4, shard 1 keys 5..9 ------------------------------


@pytest.fixture(scope="module")
def worker():
    config = JobConfig(num_keys=10, width=2, num_servers=2, num_workers=1, mode="async", lr=1.0, timeout_s=20.0)
    with LocalCluster(config) as cluster:
        w = Worker(cluster.coordinator, cluster.secret, 0)
        try:
            init = np.repeat(10 * np.arange(10, dtype=np.float32)[:, None], 2, axis=1)
            w.wait(w.init(init))
            yield w
        finally:
            w.close()


@pytest.mark.parametrize("keys", [[0, 2, 1, 3], [0, 0, 2], [9, 0, 5, 0, 9], [7, 6, 5, 4, 3], [8]])
def test_a_pull_returns_rows_in_the_order_of_its_keys(worker, keys):
    rows = worker.wait(worker.pull(np.array(keys)))
    assert rows[:, 0].tolist() == [10.0 * k for k in keys] and rows[:, 1].tolist() == rows[:, 0].tolist()


def test_a_push_with_keys_out_of_order_and_repeated_sums_per_key(worker):
    keys = np.array([3, 1, 8, 3, 6], np.int64)
    before = worker.wait(worker.pull(keys))
    grads = np.array([[1, 1], [2, 2], [3, 3], [4, 4], [5, 5]], np.float32)
    assert worker.wait(worker.push(keys, grads)) == ["applied", "applied"]
    after = worker.wait(worker.pull(np.array([8, 6, 3, 1])))
    expected = before[[2, 4, 0, 1]] - np.array([[3, 3], [5, 5], [5, 5], [2, 2]], np.float32)  # lr 1: key 3 got 1+4
    np.testing.assert_array_equal(after, expected)
