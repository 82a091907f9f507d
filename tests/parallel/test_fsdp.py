"""ZeRO-3 (fully sharded data parallel) through ``HybridParallel(zero_stage=3)``: equal to one process in every
layout, sharding that is real, and the trainer of ``dtrain train --zero 3`` equal to one process on the same
global batch.

Jobs in tests/jobs/fsdp.py: a tiny Llama (tied embeddings), 3 AdamW steps with two param groups, clipping and
2 accumulation chunks, float32 within rtol 1e-5, atol 1e-6 of one process on the global batch; bf16 compute over
float32 shards and fp16 autocast, at ten times the rate, with losses within 3e-3 / 3e-4 of one process under the
same autocast (an untrained run's lie outside) and parameters within 2 lr a step.
"""

from __future__ import annotations

import pytest
import torch

from dtrain.cli.main import build_parser
from dtrain.train import loop
from dtrain.train.config import from_arguments
from tests.jobs import fsdp as jobs
from tests.jobs import parallel as parallel_jobs

POOL_WORLD = 8

LAYOUTS = {  # name -> (grid ranks, layout)
    "dp2": (2, {"dp": 2, "algorithm": "native"}),
    "dp4": (4, {"dp": 4, "algorithm": "auto"}),
    "tp2xdp2": (4, {"dp": 2, "tp": 2, "algorithm": "native"}),
    "pp2xdp2": (4, {"dp": 2, "pp": 2, "num_microbatches": 2, "algorithm": "native"}),
    "shard2xreplicate2": (4, {"dp": 4, "shard_size": 2, "algorithm": "native"}),
    "dp2-bf16": (2, {"dp": 2, "bf16": True, "algorithm": "native"}),  # near one process under bf16 autocast
    "pp2xdp2-interleaved": (
        4,
        {
            "dp": 2,
            "pp": 2,
            "num_microbatches": 2,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "algorithm": "native",
        },
    ),
    "dp2-fp16": (2, {"dp": 2, "fp16": True, "algorithm": "native"}),  # loss-scaled, near fp16 autocast
    "dp2-compiled": (2, {"dp": 2, "compile": True, "algorithm": "native"}),  # torch.compile'd blocks
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero3_trains_like_one_process(pool, layout):
    world, spec = LAYOUTS[layout]
    results = pool.run(jobs.train, {**spec, "accumulation": 2})  # every process: groups are made collectively
    assert results[world:] == [None] * (POOL_WORLD - world)
    dp = spec["dp"]
    for rank, got in enumerate(results[:world]):
        assert (got["loss"], got["norm"], got["shards"]) == (0.0, 0.0, 0.0), (rank, got)
        assert got["problems"] == [] and got["launches"] > 0 and got["trains"], (rank, got)
        if spec.get("fp16"):  # scaled by the dynamic loss scale, no step skipped
            assert got["loss_scale"] > 1 and got["skipped"] == 0, (rank, got)
        assert got["param_dtype"] == {"torch.bfloat16" if spec.get("bf16") else "torch.float32"}
        # this rank holds its 1/shard share of its stage's (tp-local) parameters, not all of them
        shard = spec.get("shard_size", dp)
        assert got["local_numel"] // shard <= got["held"] <= got["local_numel"] // shard + 16, (rank, got)
    assert results[0]["exported"] == 0.0


def test_memory_report_shows_parameters_gradients_and_state_sharded(pool):
    dp = 4
    got = pool.run(jobs.memory, dp, 6, ranks=dp)
    for r in got:
        report, model_nbytes = r["report"], r["model_nbytes"]
        assert report.stage == 3 and report.world_size == dp
        assert report.data_parallel.parameter_nbytes == model_nbytes
        # float32 shards of 1/dp each (padding: fewer than dp elements a unit)
        for zero, full in [
            (report.zero.parameter_nbytes, report.data_parallel.parameter_nbytes),
            (report.zero.gradient_nbytes, report.data_parallel.gradient_nbytes),
        ]:
            assert full / dp <= zero <= full / dp + 4 * dp * len(r["units"])
        assert report.zero.optimizer_state_nbytes < report.data_parallel.optimizer_state_nbytes / dp * 1.01
        # at most a few units' full parameters were ever gathered at once: the current one, a prefetched one, and
        # in backward the one whose gradient is still being reduced; far from the whole model
        assert report.largest_unit_nbytes >= max(r["units"])
        assert max(r["units"]) <= report.gathered_peak_nbytes <= 3 * report.largest_unit_nbytes
        assert report.gathered_peak_nbytes < 0.6 * model_nbytes
        assert r["resident_after_step"] == 0  # between steps no full parameter is allocated
        assert r["parameter_storage_nbytes"] == 4  # and the parameters read one placeholder element


def test_dtrain_train_zero3_trains_like_one_process(pool, tmp_path):
    """``dtrain train --zero 3``'s trainer (the tiny Llama on the default data, AdamW, clipping, a cosine schedule)
    on dp 2 against one process training on the same global batch: the same losses, gradient norms, validation
    loss and model, float32 within the tolerances of the other equivalence tests. AdamW's epsilon is theirs too
    (tests/jobs/parallel.py): a smaller one turns the rounding of a gradient near zero, which differs with the
    summation order, into steps of the learning rate's size."""
    flags = ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--warmup-steps", "1"]
    flags += ["--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--eps", str(parallel_jobs.EPS)]
    got = {}
    for name, world, layout in (("one", 1, []), ("zero3", 2, ["--dp", "2", "--zero", "3"])):
        args = build_parser().parse_args(["train", "--out", str(tmp_path / name), *flags, *layout])
        config = from_arguments(args)
        plan = loop.check_run(config, world)
        assert (plan.world_size, config.parallel.dp, config.parallel.zero) == (world, world, 3 if world > 1 else 0)
        results = pool.run(jobs.trainer, config, plan, 2)  # every process: groups are made collectively
        assert results[world:] == [None] * (POOL_WORLD - world)
        got[name] = results[:world]
    (one,) = got["one"]
    for sharded in got["zero3"]:  # every dp rank reports the loss of the whole global batch
        for a, b in zip(one["records"], sharded["records"], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert sharded["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    first, second = one["model"], got["zero3"][0]["model"]  # the whole model, gathered onto rank 0
    assert first.keys() == second.keys() and got["zero3"][1]["model"] is None
    for key, value in first.items():
        torch.testing.assert_close(second[key], value, rtol=parallel_jobs.RTOL, atol=parallel_jobs.ATOL)
