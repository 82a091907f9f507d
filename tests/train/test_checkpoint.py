"""Checkpoints that reshard (:mod:`dtrain.train.checkpoint`, :mod:`dtrain.parallel.state`): train at one layout,
save, load at another, train on; losses and parameters equal the uninterrupted run's (float32). A save that
fails midway leaves the previous checkpoint loadable; asynchronous saves, keep-last-k and the Hugging Face
export; ``dtrain train --resume`` at another layout.
"""

from __future__ import annotations

import pytest
import torch

from dtrain.parallel.state import flat_range_boxes
from dtrain.train.checkpoint import checkpoint_dir, complete_steps, latest_complete_step
from tests.jobs import checkpoint as jobs

POOL_WORLD = 8

# (dp, pp, tp, zero) before -to- after
PAIRS = {
    "dp2-to-pp2": ((2, 1, 1, 0), (1, 2, 1, 0)),
    "tp2-to-dp2-zero1": ((1, 1, 2, 0), (2, 1, 1, 1)),
    "dp2-zero2-to-tp2xpp2": ((2, 1, 1, 2), (1, 2, 2, 0)),
    "dp2xtp2-zero3-to-pp2": ((2, 1, 2, 3), (1, 2, 1, 0)),
    "tp2-to-dp2-zero3": ((1, 1, 2, 0), (2, 1, 1, 3)),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_checkpoint_loads_at_another_layout_and_training_continues_as_if_uninterrupted(pool, tmp_path, pair):
    before, after = PAIRS[pair]
    results = pool.run(jobs.reshard, before, after, str(tmp_path), 2, 4)
    got = results[0]
    assert got["first"] == 2 and got["names"], got
    assert got["losses_before"] == 0.0 and got["losses"] == 0.0 and got["params"] == 0.0, got
    assert got["moved"] > 1e-3, got  # training moved the parameters far beyond the tolerance
    assert results[1:] == [None] * (POOL_WORLD - 1)


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_loadable(pool, tmp_path):
    results = pool.run(jobs.crash_mid_save, str(tmp_path))
    for got in results[:2]:
        assert got["error"] == "killed after writing its pieces", got
        assert got["complete"] == [2], got
    assert results[0]["leftover"] == [".step-00000004.tmp", "step-00000002"]
    assert results[0]["loaded_step"] == 2 and results[0]["params"] == 0.0


def test_asynchronous_saves_keep_the_last_k_and_export_to_hugging_face(pool, tmp_path):
    results = pool.run(jobs.async_keep_export, str(tmp_path / "run"), str(tmp_path / "hf"))
    got = results[0]
    assert got["complete"] == [3, 2], got
    assert got["errors"] == {3: 0.0, 2: 0.0} and got["export"] == 0.0, got
    assert 3 not in got["before_wait"]  # the last save is completed by wait(), not before


@pytest.mark.parametrize(
    ("shape", "start", "stop", "expected"),
    [
        ((4, 5), 0, 20, [(0, (0, 0), (4, 5))]),
        ((4, 5), 3, 17, [(3, (0, 3), (1, 2)), (5, (1, 0), (2, 5)), (15, (3, 0), (1, 2))]),
        ((4, 5), 6, 9, [(6, (1, 1), (1, 3))]),
        ((4, 5), 5, 15, [(5, (1, 0), (2, 5))]),
        ((7,), 2, 5, [(2, (2,), (3,))]),
        ((2, 2, 3), 4, 12, [(4, (0, 1, 1), (1, 1, 2)), (6, (1, 0, 0), (1, 2, 3))]),
        ((4, 5), 7, 7, []),
    ],
)
def test_a_flat_range_is_a_few_rectangles_in_flat_order(shape, start, stop, expected):
    boxes = flat_range_boxes(shape, start, stop)
    assert boxes == expected
    covered = [(flat, sizes) for flat, _, sizes in boxes]
    flat = start
    for begin, sizes in covered:  # contiguous, in order, covering [start, stop)
        assert begin == flat
        count = 1
        for s in sizes:
            count *= s
        flat += count
    assert flat == stop


def test_temporary_and_unfinished_directories_are_not_checkpoints(tmp_path):
    for step, files in [(1, [".metadata", "meta.json"]), (2, [".metadata"]), (3, ["meta.json"])]:
        directory = checkpoint_dir(tmp_path, step)
        directory.mkdir(parents=True)
        for name in files:
            (directory / name).write_text("{}")
    (tmp_path / "checkpoints" / ".step-00000004.tmp").mkdir()
    (tmp_path / "checkpoints" / ".step-00000004.tmp" / ".metadata").write_text("")
    assert complete_steps(tmp_path) == [1] and latest_complete_step(tmp_path) == 1
    assert latest_complete_step(tmp_path / "elsewhere") is None


def test_the_optimizer_state_a_load_fills_is_made_by_the_class_step_where_the_instance_step_is_replaced():
    """init_optimizer_state (before a load fills the state) runs the optimizer class's own step, on zero gradients
    at learning rate 0: DataParallel.overlap_optimizer replaces the instance's step with one that refuses to run
    without a backward, and the parameters must not move."""
    from types import SimpleNamespace

    from dtrain.parallel.state import init_optimizer_state

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1)

    def refuse(closure=None):
        raise RuntimeError("optimizer.step(): no synchronised backward ran since the last step")

    opt.step = refuse
    init_optimizer_state(SimpleNamespace(optimizer=opt))
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(opt.state[p])
    assert float(opt.state[p]["step"]) == 0 and opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None
