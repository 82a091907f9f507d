"""HybridParallel on the decoders of :mod:`dtrain.models` (a tiny Llama with grouped-query attention and tied
embeddings, a tiny GPT-2): every layout trains like one process on the whole global batch.

Each model runs all its layouts in one pool job (tests/jobs/parallel.py; grids built once per layout): 3 AdamW
steps in float32, losses, every rank's parameter shards, the gathered state dict and the whole model's
gradient norm within rtol 1e-5, atol 1e-6 of the reference; with clipping, the reference clips with
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import inspect

import pytest

from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeroOptimizer
from tests.jobs import parallel as jobs

POOL_WORLD = 8
ZERO = hasattr(ZeroOptimizer, "grad_square_sum") and hasattr(ZeroOptimizer, "scale_grads")
DP_REDUCE_DTYPE = "reduce_dtype" in inspect.signature(DataParallel).parameters

LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "num_microbatches": 2},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "tp2xpp2": {"pp": 2, "tp": 2, "num_microbatches": 2},
    "dp2xpp2-gpipe": {"dp": 2, "pp": 2, "num_microbatches": 2, "schedule": "gpipe"},
    "pp2-interleaved": {"pp": 2, "num_microbatches": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
    "dp2xpp2xtp2": {"dp": 2, "pp": 2, "tp": 2, "num_microbatches": 2},
    "dp2xpp4-flops": {"dp": 2, "pp": 4, "num_microbatches": 2, "balance": "flops"},
    "dp2-accumulation2": {"dp": 2, "accumulation": 2},
    "dp2xpp2xtp2-accumulation2-local": {
        "dp": 2,
        "pp": 2,
        "tp": 2,
        "num_microbatches": 2,
        "accumulation": 2,
        "local": True,
    },
    "dp2xpp2-reduce-float64": {"dp": 2, "pp": 2, "num_microbatches": 2, "reduce_dtype": "float64"},
    "dp2xtp2-clip": {"dp": 2, "tp": 2, "clip": True},
    "tp2xpp2-clip": {"pp": 2, "tp": 2, "num_microbatches": 2, "clip": True},
    "dp2xpp4-clip": {"dp": 2, "pp": 4, "num_microbatches": 2, "clip": True},
    "pp2-autocast-bf16": {"pp": 2, "autocast": True},
    "tp2xpp2-fp16-loss-scale": {"pp": 2, "tp": 2, "num_microbatches": 2, "clip": True, "scaler": True},
    # each stage's weight gradients added into .grad by their GEMMs from the second micro-batch on
    "dp2xpp2xtp2-fused-accumulation2": {
        "dp": 2,
        "pp": 2,
        "tp": 2,
        "num_microbatches": 2,
        "accumulation": 2,
        "grad_accumulation_fusion": True,
    },
    "pp2-interleaved-fused-clip": {
        "pp": 2,
        "num_microbatches": 4,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 2,
        "grad_accumulation_fusion": True,
        "clip": True,
    },
}
ZERO_LAYOUTS = {
    "zero1": {"dp": 2, "zero_stage": 1},
    "zero2": {"dp": 2, "zero_stage": 2},
    "zero2-clip": {"dp": 2, "zero_stage": 2, "clip": True},
    "zero1-dp2xpp2": {"dp": 2, "pp": 2, "num_microbatches": 2, "zero_stage": 1},
    "zero1-dp2xpp2-fused": {"dp": 2, "pp": 2, "num_microbatches": 4, "zero_stage": 1, "grad_accumulation_fusion": True},
}
DP_REDUCE_LAYOUTS = {"dp2-reduce-float64": {"dp": 2, "reduce_dtype": "float64"}}
# every dropout of the model at 0.1 (Llama: attention's), each step's masks drawn as the reference draws them
DROPOUT_LAYOUTS = {
    "dropout-dp2xtp2": {"dp": 2, "tp": 2, "dropout": 0.1},
    "dropout-dp2xpp2xtp2-accumulation2-local": {
        "dp": 2,
        "pp": 2,
        "tp": 2,
        "num_microbatches": 2,
        "accumulation": 2,
        "local": True,
        "dropout": 0.1,
    },
    "dropout-pp2-interleaved": {
        "pp": 2,
        "num_microbatches": 4,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 2,
        "dropout": 0.1,
    },
    # backward recomputes each block under the rows of its micro-batch's forward, not those set when it runs
    "dropout-tp2xpp2-recompute-full": {
        "pp": 2,
        "tp": 2,
        "num_microbatches": 2,
        "recompute": ("full", {}),
        "dropout": 0.1,
    },
    "dropout-dp2-accumulation2-recompute-selective": {
        "dp": 2,
        "accumulation": 2,
        "recompute": ("selective", {}),
        "dropout": 0.1,
    },
    "dropout-zero3-dp2": {"dp": 2, "zero_stage": 3, "dropout": 0.1},
}


def _table() -> dict[str, dict]:
    table = dict(LAYOUTS)
    if ZERO:
        table.update(ZERO_LAYOUTS)
    if DP_REDUCE_DTYPE:
        table.update(DP_REDUCE_LAYOUTS)
    table.update(DROPOUT_LAYOUTS)
    return table


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def trained(request, pool):
    table = _table()
    per_rank = pool.run(jobs.layouts, request.param, list(table), table)
    return {name: [r[name] for r in per_rank] for name in table}


def _world(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)


def _check(results: list, layout: dict) -> None:
    world = _world(layout)
    assert results[world:] == [None] * (POOL_WORLD - world)
    for rank, got in enumerate(results[:world]):
        assert (got["loss"], got["params"], got["norm"]) == (0.0, 0.0, 0.0), (rank, got)
        assert got["moved"] > 1e-3, (rank, got)  # training moved the parameters far beyond the tolerance
        if rank == 0:
            assert got["exported"] == 0.0, got  # full_state_dict equals the reference's state dict
        else:
            assert got["exported"] is None
        if layout.get("clip"):
            assert min(got["norms"]) > jobs.MAX_NORM  # clipping was active in every step
        if layout.get("scaler"):  # the infinite loss of step 1 skipped its optimizer step and backed off the scale
            assert got["skipped"] == [False, True, False] and got["scaler_updates"] == [False, True, False]
        else:
            assert got["skipped"] == [False] * jobs.STEPS
        if layout.get("grad_accumulation_fusion"):
            assert got["fused"] > 0, (rank, got)  # the GEMMs added into .grad, from the second micro-batch on


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(trained, name):
    _check(trained[name], LAYOUTS[name])


@pytest.mark.skipif(not ZERO, reason="ZeroOptimizer has no grad_square_sum/scale_grads")
@pytest.mark.parametrize("name", list(ZERO_LAYOUTS))
def test_zero_layout_trains_like_one_process(trained, name):
    _check(trained[name], ZERO_LAYOUTS[name])


@pytest.mark.parametrize("name", list(DROPOUT_LAYOUTS))
def test_dropout_draws_one_process_masks_on_every_layout(trained, name):
    _check(trained[name], DROPOUT_LAYOUTS[name])


@pytest.mark.skipif(not DP_REDUCE_DTYPE, reason="DataParallel takes no reduce_dtype")
def test_data_parallel_reduces_in_the_given_dtype(trained):
    _check(trained["dp2-reduce-float64"], DP_REDUCE_LAYOUTS["dp2-reduce-float64"])


EVALUATION_LAYOUTS = {
    "dp2xpp2": {"dp": 2, "pp": 2, "num_microbatches": 2},
    "tp2xpp2-interleaved": {"pp": 2, "tp": 2, "num_microbatches": 2, "schedule": "interleaved-1f1b"},
}


DROPOUT_EVALUATION_LAYOUTS = {
    "dp2xtp2-dropout": {"dp": 2, "tp": 2, "dropout": 0.1},
    "dp2xpp2-dropout": {"dp": 2, "pp": 2, "num_microbatches": 2, "dropout": 0.1},
}


def test_evaluation_drops_nothing_and_leaves_training_as_it_was(pool):
    """A GPT-2 whose every dropout is 0.1, evaluated between training steps: each evaluation is one process's in
    eval mode, and the training around them stays one process's (its modules back in training mode)."""
    table = DROPOUT_EVALUATION_LAYOUTS
    per_rank = pool.run(jobs.evaluate_between_steps, "gpt2", list(table), table, 4)
    for name, layout in table.items():
        results = [r[name] for r in per_rank][: _world(layout)]
        for rank, got in enumerate(results):
            assert (got["evals"], got["loss"], got["params"]) == (0.0, 0.0, 0.0), (name, rank, got)
            assert got["moved"] > 1e-3, (name, rank, got)


def test_pipelines_evaluate_batches_of_another_size_between_training_steps(pool):
    """An evaluation of 4 rows before each step of 8 (2 rows a micro-batch, not 1) and after the last: each loss is
    one process's on those rows, and training goes on as one process's, over every stage."""
    per_rank = pool.run(jobs.evaluate_between_steps, "llama", list(EVALUATION_LAYOUTS), EVALUATION_LAYOUTS, 4)
    for name, layout in EVALUATION_LAYOUTS.items():
        world = _world(layout)
        results = [r[name] for r in per_rank]
        assert results[world:] == [None] * (POOL_WORLD - world)
        for rank, got in enumerate(results[:world]):
            assert (got["evals"], got["loss"], got["params"]) == (0.0, 0.0, 0.0), (name, rank, got)
            assert got["moved"] > 1e-3, (name, rank, got)
