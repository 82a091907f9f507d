"""Hybrid parallelism (:class:`~dtrain.parallel.hybrid.HybridParallel`, the composition ``dtrain train`` runs):
every combination of data, pipeline and tensor parallelism trains like one device.

Each layout runs on real Gloo processes of the test pool (grids are built once per layout, by every process of
the pool); every rank on the grid trains 5 SGD-with-momentum steps of a 4-block MLP classifier and compares its
losses and its shard of its stage's parameters with the unsplit model trained on the whole global batch,
float32 within rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.parallel.data_parallel import broadcast_algorithm
from dtrain.parallel.hybrid import HybridParallel, _check_capturable, tensor_parallel_blocks
from tests.jobs import hybrid as jobs

# layout -> (grid ranks, pipeline stages, blocks per stage, tensor-parallel degree)
LAYOUTS = {
    "dp2xpp2": (4, 2, 2, 1),
    "dp2xtp2": (4, 1, 4, 2),
    "tp2xpp2": (4, 2, 2, 2),
    "dp2xpp2xtp2": (8, 2, 2, 2),
    "dp2xpp2xtp2, tp-dp-pp": (8, 2, 2, 2),
}
POOL_WORLD = 8


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_device(pool, layout, schedule):
    results = pool.run(jobs.equivalence, layout, schedule, 2)  # every process: the grid is collective
    world, stages, blocks_per_stage, tp = LAYOUTS[layout]
    assert results[world:] == [None] * (POOL_WORLD - world)
    for rank, got in enumerate(results[:world]):
        assert got["loss"] == 0.0, (rank, got)
        assert got["params"] == 0.0, (rank, got)
        assert got["moved"] > 1e-4, (rank, got)  # the steps moved the parameters far beyond the tolerance
        assert len(got["blocks"]) == blocks_per_stage and got["param_count"] == 4 * blocks_per_stage
    held = {(got["coords"][1], tuple(got["blocks"])) for got in results[:world]}
    assert held == {(s, tuple(range(s * blocks_per_stage, (s + 1) * blocks_per_stage))) for s in range(stages)}
    if layout.endswith("tp-dp-pp"):  # pipeline outermost: the first half of the ranks holds the first stage
        assert [got["coords"] for got in results[:4]] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


def test_more_microbatches_than_stages_change_nothing_in_three_dimensions(pool):
    results = pool.run(jobs.equivalence, "dp2xpp2xtp2", "1f1b", 4)  # 2 rows per micro-batch
    assert [(got["loss"], got["params"]) for got in results] == [(0.0, 0.0)] * POOL_WORLD


ALL_REDUCE_ALGORITHMS = ["auto", "native", *registry.names(Collective.ALL_REDUCE)]


@pytest.mark.parametrize("layout", ["dp2", "dp2xpp2"])
@pytest.mark.parametrize("algorithm", ALL_REDUCE_ALGORITHMS)
def test_every_all_reduce_algorithm_trains_like_one_device(pool, layout, algorithm):
    # pp == 1 goes through DataParallel, pp > 1 through the flat all-reduce; both broadcast the start first
    world = 2 if layout == "dp2" else 4
    results = pool.run(jobs.equivalence, layout, "1f1b", 2, algorithm)
    assert [(got["loss"], got["params"]) for got in results[:world]] == [(0.0, 0.0)] * world


def test_the_parameter_broadcast_takes_a_broadcast_algorithm_for_each_all_reduce_one():
    broadcasts = registry.names(Collective.BROADCAST)
    for name in ALL_REDUCE_ALGORITHMS:
        paired = broadcast_algorithm(name)
        assert paired == (name if name in broadcasts or name in ("auto", "native") else "auto"), name
    assert broadcast_algorithm("butterfly") == "butterfly"  # a name no collective has is left for comm to refuse


def test_tensor_parallelism_needs_the_models_tensor_parallel_form():
    class _Grid:
        class dims:  # noqa: N801
            dp, pp, tp = 1, 1, 2

        tp_group = None

    with pytest.raises(ValueError, match="tp=2 needs tensor_parallel"):
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), _Grid(), lambda named: torch.optim.SGD(named, lr=0.1))


def test_blocks_that_are_not_parallel_mlps_are_refused_before_any_communication():
    with pytest.raises(ValueError, match=r"block 1 is \['Linear', 'ReLU', 'Linear'\]"):
        tensor_parallel_blocks(
            [
                nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)),
            ],
            tp_group=None,
        )
    with pytest.raises(ValueError, match="no blocks given"):
        tensor_parallel_blocks([], tp_group=None)


@pytest.mark.parametrize(
    ("accumulation", "autocast", "zero"), [(1, False, 0), (2, False, 0), (1, True, 0), (2, False, 1)]
)
def test_a_step_recorded_whole_trains_like_one_device(pool, accumulation, autocast, zero):
    """``step_graph`` at dp 2 (pp 1): two eager steps, the third recorded (a stand-in graph on the CPU), then
    replays; every step's loss and the parameters match one device (under bf16 autocast: the eager layout, exactly,
    and that layout one device under the same autocast, within 1e-3 / 1e-4), and the recording's forwards ran with
    autocast's cast cache off. Under ZeRO-1 the recording holds no collective: its optimizer averages the recorded
    gradients after each replay."""
    results = pool.run(jobs.step_graphed, accumulation, autocast, zero)
    assert results[2:] == [None] * (POOL_WORLD - 2)
    for got in results[:2]:
        assert got["loss"] == 0.0 and got["params"] == 0.0 and got["moved"] > 1e-4, got
        assert got["one_device"] == (0.0 if autocast else None), got
        assert got["records"] == 1 and got["replays"] == 4, got
        assert got["recorded_under"] == ([(True, False)] if autocast else [(False, True)]), got
        assert got["said"][0].startswith("step_graph: the step was recorded for a batch of ((8, 16)"), got
        assert got["said"][1].startswith("step_graph: the step was recorded with another loss function"), got


@pytest.mark.parametrize("layout", ["dp2", "dp2xtp2"])
def test_the_optimizer_stepped_inside_backward_trains_like_one_device(pool, layout):
    """overlap_optimizer: every bucket's parameters but the last's stepped while the last bucket is averaged, with
    data parallel alone and beside tensor parallelism; the same losses and parameters as one device. Clipping,
    which needs the whole gradient before the step, is refused."""
    for got in pool.run(jobs.equivalence, layout, "1f1b", 1, overlap_optimizer=True):
        if got is not None:
            assert got["loss"] == 0.0 and got["params"] == 0.0 and got["moved"] > 1e-4, got
            assert got["clipping"].startswith("overlap_optimizer: the optimizer steps inside backward"), got


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_recorded_step_with_the_optimizer_inside_trains_like_one_device(pool, accumulation):
    """step_graph with overlap_optimizer (a stand-in graph on the CPU): the replay steps the optimizer, and
    train_step steps it no more; the losses and parameters of one device."""
    results = pool.run(jobs.step_graphed, accumulation, overlap=True)
    for got in results[:2]:
        assert got["loss"] == 0.0 and got["params"] == 0.0 and got["moved"] > 1e-4, got
        assert got["records"] == 1 and got["replays"] == 4, got


def test_the_optimizer_inside_backward_is_refused_where_it_cannot_step_there():
    sgd = lambda named: torch.optim.SGD([q for _, q in named], lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"overlap_optimizer=True steps DataParallel's optimizer inside backward: it "):
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), _stub_grid(1), sgd, overlap_optimizer=True)  # dp = 1
    with pytest.raises(ValueError, match="build the optimizer with capturable=True"):
        _check_capturable(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(ValueError, match="give it lr as a tensor on the device"):
        _check_capturable(torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=0.1, capturable=True))


def _stub_grid(tp: int):
    class _Grid:
        class dims:  # noqa: N801
            dp, pp = 1, 1

        tp_group = None

    _Grid.dims.tp = tp
    return _Grid()


def test_a_step_graph_is_refused_off_a_gpu_and_beside_tensor_parallelism():
    sgd = lambda named: torch.optim.SGD([q for _, q in named], lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="step_graph=True records CUDA graphs; the step would run on cpu"):
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), _stub_grid(1), sgd, step_graph=True)
    with pytest.raises(ValueError, match=r"step_graph=True does not run with tp > 1 \(its collectives"):
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), _stub_grid(2), sgd, step_graph=True)


def test_a_frozen_block_stays_frozen_in_its_tensor_parallel_shards(pool):
    """tensor_parallel_blocks keeps requires_grad=False on the shards of a frozen block: dp 2 x tp 2 leaves it
    where it started and trains the others as one device does."""
    results = pool.run(jobs.frozen_blocks, "dp2xtp2", (1,))
    assert results[4:] == [None] * (POOL_WORLD - 4)
    for got in results[:4]:
        assert got == {"params": 0.0, "trainable": 12, "frozen_moved": 0.0}, got


@pytest.mark.parametrize(
    ("dims", "keywords", "message"),
    [
        ((1, 1, 1), {"grad_accumulation_fusion": True}, r"grad_accumulation_fusion=True .* needs pp > 1 .*got pp 1"),
        ((2, 2, 1), {"grad_accumulation_fusion": True, "zero_stage": 2}, r"needs pp > 1 and zero_stage 0 or 1"),
        ((1, 2, 1), {"grad_accumulation_fusion": "yes"}, r"grad_accumulation_fusion must be False, True or 'auto'"),
        ((2, 1, 1), {"pipeline_graphs": True}, r"pipeline_graphs=True replays a pipeline's micro-batches; pp is 1"),
    ],
)
def test_pipeline_options_that_would_not_apply_are_refused_before_any_communication(dims, keywords, message):
    """An option HybridParallel would drop (gradient-accumulation fusion without a pipeline or under ZeRO-2 and 3,
    pipeline graphs with pp 1) is one ValueError naming it, raised before any group is used."""

    class _Grid:
        class dims:  # noqa: N801
            dp, pp, tp = dims

    with pytest.raises(ValueError, match=message):
        HybridParallel(
            nn.Sequential(nn.Linear(2, 2)), _Grid(), lambda named: torch.optim.SGD(named, lr=0.1), **keywords
        )


def test_a_pipeline_stage_with_nothing_to_train_is_refused_on_every_rank_before_any_communication():
    """Every rank holds the whole model when the stages are cut, so each refuses a stage whose layers are all frozen
    alike (the stage's optimizer would raise alone, its peers waiting on it for good)."""

    class _Grid:
        class dims:  # noqa: N801
            dp, pp, tp = 1, 2, 1

    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    for layer in model[2:]:
        layer.requires_grad_(False)
    with pytest.raises(ValueError, match=r"pipeline stage\(s\) \[1\] of 2 hold no parameter that requires grad"):
        HybridParallel(model, _Grid(), lambda named: torch.optim.SGD(named, lr=0.1))


def test_the_stage_holding_a_tied_copy_has_something_to_train():
    """A last stage of frozen blocks still trains the head's copy of a tied embedding."""
    from dtrain.parallel.hybrid import _idle_stages

    embedding, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(2, 2), nn.Linear(2, 2), head)
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    assert _idle_stages(model, {0: 0, 1: 0, 2: 1, 3: 1}, 2) == []
    embedding.weight.requires_grad_(False)
    assert _idle_stages(model, {0: 0, 1: 0, 2: 1, 3: 1}, 2) == [0, 1]
