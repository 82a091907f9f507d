"""Data parallel, Horovod-style and ZeRO training equal one process training on the whole global batch.

Each job trains a small MLP (484 parameters in 4 buckets of 512 bytes) for 12 steps on 2 or 4 Gloo ranks and,
on every rank, the one-process reference on the global batch; see tests/jobs/data_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.parallel.data_parallel import DataParallel, DistributedOptimizer
from dtrain.parallel.data_parallel_communications import build_buckets
from dtrain.parallel.zero import ZeroOptimizer
from tests.jobs import data_parallel as jobs

RTOL, ATOL = 1e-5, 1e-6


def _assert_matches_reference(results: list[dict]) -> None:
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["params"], r["ref_params"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("world", "optimizer", "algorithm"), [(2, "sgd", "auto"), (4, "adam", "ring"), (4, "sgd", "native")]
)
def test_data_parallel_equals_one_process_on_the_global_batch(pool, world, optimizer, algorithm):
    results = pool.run(jobs.data_parallel, world, optimizer, algorithm, ranks=world)
    _assert_matches_reference(results)
    for r in results:  # "auto" resolves to the backend's own all-reduce here, which goes out asynchronously
        assert (r["in_flight_mid_backward"] > 0) == (algorithm in ("auto", "native"))


@pytest.mark.parametrize(
    ("world", "optimizer", "micro_batches", "overlap"),
    [(2, "sgd", 1, False), (4, "adam", 2, False), (4, "adamw", 1, True)],
)
def test_buckets_moved_through_peer_channels_train_like_one_process(pool, world, optimizer, micro_batches, overlap):
    """exchange="copy-engine": from the second pass each bucket is scattered in pieces, summed where its piece lives
    and gathered back through peer channels (on the CPU, windows in /dev/shm), with accumulation and with the
    optimizer stepped inside backward."""
    results = pool.run(
        jobs.data_parallel,
        world,
        optimizer,
        "ring",
        micro_batches,
        overlap=overlap,
        exchange="copy-engine",
        ranks=world,
    )
    _assert_matches_reference(results)
    for r in results:
        assert r["copy_engine"]
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)  # the same bits on every rank


@pytest.mark.parametrize(("world", "optimizer", "exchange"), [(2, "adamw", "copy-engine"), (4, "adam", "collective")])
def test_a_recorded_step_with_the_optimizer_inside_backward_trains_like_one_process(pool, world, optimizer, exchange):
    """The whole step recorded (a stand-in graph on the CPU) with the optimizer stepped inside backward by
    overlap_optimizer: two eager steps, a recording, replays; the same losses and parameters as one process."""
    results = pool.run(jobs.data_parallel_recorded, world, optimizer, exchange, ranks=world)
    _assert_matches_reference(results)
    for r in results:
        assert r["records"] == 1 and r["replays"] == jobs.STEPS - 2
        assert r["copy_engine"] == (exchange == "copy-engine")


def test_buckets_cut_into_pieces_that_differ_by_at_most_one_element():
    from dtrain.comm.peer.bucket_reduce import pieces

    assert pieces(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert pieces(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    for n in (1, 7, 128, 1001):
        for world in (2, 3, 4, 8):
            got = pieces(n, world)
            assert sum(length for _, length in got) == n and max(g[1] for g in got) - min(g[1] for g in got) <= 1
            assert all(a[0] + a[1] == b[0] for a, b in zip(got[:-1], got[1:], strict=True))


def test_an_unknown_exchange_and_copy_engines_with_a_reduce_dtype_are_refused():
    import torch.distributed as dist

    from dtrain.parallel.data_parallel_communications import GradientReducer

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="exchange must be one of collective, copy-engine, got 'dma'"):
        GradientReducer(model.parameters(), dist.group.WORLD, bucket_bytes=64, algorithm="auto", exchange="dma")
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="averages gradients of one dtype on one device; these are torch.float32 on"):
        GradientReducer(mixed, None, bucket_bytes=8, algorithm="auto", exchange="copy-engine")
    with pytest.raises(ValueError, match="exchange='copy-engine' averages in the gradients' own dtype"):
        GradientReducer(
            model.parameters(),
            None,
            bucket_bytes=64,
            algorithm="auto",
            exchange="copy-engine",
            reduce_dtype=torch.bfloat16,
        )


def test_data_parallel_broadcasts_rank_0_weights_and_overlaps_buckets_with_backward(pool):
    results = pool.run(jobs.data_parallel, 2, "sgd", "ring", steps=2, ranks=2)
    assert not torch.equal(results[0]["before"], results[1]["before"])
    assert torch.equal(results[0]["after"], results[1]["after"])
    assert torch.equal(results[0]["after"], results[0]["before"])
    for r in results:
        assert r["bucket_count"] == 3
        assert r["launches"] == 2 * r["bucket_count"]
        # When the first layer's output gradient exists, the later layers' buckets have already gone out.
        assert 0 < r["launched_mid_backward"] < r["bucket_count"]


def test_no_sync_accumulation_equals_one_step_on_the_union(pool):
    results = pool.run(jobs.data_parallel, 2, "adam", "native", micro_batches=2, ranks=2)
    _assert_matches_reference(results)
    assert results[0]["launches"] == results[0]["bucket_count"] * 12  # one reduction per step, not per pass


@pytest.mark.parametrize(
    ("optimizer", "algorithm", "micro_batches"), [("adamw", "native", 2), ("sgd", "ring", 1), ("adam", "auto", 1)]
)
def test_optimizer_stepped_inside_backward_equals_one_process(pool, optimizer, algorithm, micro_batches):
    results = pool.run(jobs.data_parallel, 2, optimizer, algorithm, micro_batches=micro_batches, overlap=True, ranks=2)
    _assert_matches_reference(results)
    for r in results:
        assert "no synchronised backward ran since the last step" in r["refused"]


def test_overlap_optimizer_refuses_a_step_that_needs_every_gradient(pool):
    model = torch.nn.Linear(2, 2)
    dp = DataParallel.__new__(DataParallel)  # the checks run before anything touches the group
    torch.nn.Module.__init__(dp)
    dp.module, dp._optimizer = model, None
    with pytest.raises(ValueError, match=r"LBFGS is not an optimizer whose step is per parameter; accepted: .*AdamW"):
        dp.overlap_optimizer(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match="a parameter the wrapped module does not have"):
        dp.overlap_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


@pytest.mark.parametrize(("world", "optimizer", "algorithm"), [(2, "adam", "auto"), (4, "sgd", "ring")])
def test_distributed_optimizer_equals_one_process(pool, world, optimizer, algorithm):
    results = pool.run(jobs.distributed_optimizer, world, optimizer, algorithm, ranks=world)
    _assert_matches_reference(results)
    assert all(torch.equal(r["after"], results[0]["after"]) for r in results)


def test_distributed_optimizer_accumulates_backward_passes_per_step(pool):
    _assert_matches_reference(pool.run(jobs.distributed_optimizer, 4, "adam", "native", passes=2, ranks=4))


def test_broadcast_optimizer_state_copies_rank_0(pool):
    results = pool.run(jobs.optimizer_state_broadcast, 2, ranks=2)
    for r in results:
        assert r["lr"] == pytest.approx(0.1)
        torch.testing.assert_close(r["exp_avg"], 0.1 * torch.arange(5.0))  # (1 - beta1) * rank 0's gradient
        assert r["step"] == 1.0


def test_broadcast_optimizer_state_refuses_different_structures_on_every_rank(pool):
    messages = pool.run(jobs.optimizer_state_mismatch, 2, ranks=2)
    assert all("different optimizer state" in m for m in messages)


@pytest.mark.parametrize(
    ("world", "stage", "optimizer", "algorithm"),
    [(2, 1, "adam", "ring"), (4, 1, "sgd", "native"), (2, 2, "sgd", "auto"), (4, 2, "adam", "ring")],
)
def test_zero_equals_one_process(pool, world, stage, optimizer, algorithm):
    results = pool.run(jobs.zero, world, stage, optimizer, algorithm, ranks=world)
    _assert_matches_reference(results)
    assert all(torch.equal(r["after"], results[0]["after"]) for r in results)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_holds_a_quarter_of_the_optimizer_state_on_4_ranks(pool, stage):
    report = pool.run(jobs.zero, 4, stage, "adam", "auto", steps=1, ranks=4)[0]["memory"]
    dp, zero = report.data_parallel, report.zero
    assert dp.optimizer_state_nbytes == 2 * 484 * 4 + 4  # exp_avg and exp_avg_sq per element, one step count
    assert zero.optimizer_state_nbytes == 2 * 121 * 4 + 4  # the same on a 121-element shard
    assert zero.parameter_nbytes == dp.parameter_nbytes == 484 * 4
    assert zero.gradient_nbytes == (484 * 4 if stage == 1 else 121 * 4)
    assert zero.total_nbytes < dp.total_nbytes


def test_split_batch_refuses_an_uneven_split(pool):
    assert all("not a multiple of the group size 2" in m for m in pool.run(jobs.uneven_split, 2, ranks=2))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_buckets_take_parameters_in_reverse_order_and_close_at_the_size():
    model = _mlp()
    buckets = build_buckets(model.parameters(), bucket_bytes=300)
    assert [[tuple(p.shape) for p in b.params] for b in buckets] == [[(4,), (4, 16), (16,)], [(16, 8)]]
    assert [b.nbytes for b in buckets] == [336, 512]  # closed once past the cap; a larger parameter fills its own


@pytest.mark.parametrize(("bucket_bytes", "first"), [(300, None), (300, 100), (2000, 300), (64, 64), (1 << 20, None)])
def test_buckets_are_cut_as_ddp_cuts_them(bucket_bytes, first):
    from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 50))
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    ours = [[index[id(p)] for p in b.params] for b in build_buckets(params, bucket_bytes, first)]
    reverse = list(reversed(params))
    limits = [bucket_bytes] if first is None else [min(first, bucket_bytes), bucket_bytes]
    ddp, _ = _compute_bucket_assignment_by_size(reverse, limits, [False] * len(reverse), [])
    assert ours == [[len(params) - 1 - i for i in bucket] for bucket in ddp]


@pytest.mark.parametrize("bucket_bytes", [0, -1, 1.5])
def test_bucket_bytes_must_be_positive(bucket_bytes):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        DataParallel(_mlp(), None, bucket_bytes=bucket_bytes)


def test_a_module_without_parameters_is_refused():
    with pytest.raises(ValueError, match="has no parameter that requires a gradient"):
        DataParallel(nn.ReLU(), None)


def test_zero_stage_3_is_refused():
    with pytest.raises(ValueError, match="stage must be 1 .* or 2 .*; got 3"):
        ZeroOptimizer(_mlp().parameters(), torch.optim.SGD, None, stage=3, lr=0.1)


def test_distributed_optimizer_needs_a_positive_pass_count():
    model = _mlp()
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1, got 0"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, None, backward_passes_per_step=0)


@pytest.fixture(scope="module")
def rebuilt(pool):
    """Two ranks whose backward orders differ (tests/jobs/data_parallel.py:_OutOfOrder), gradients zeroed in place."""
    return pool.run(jobs.rebuild, 2, False, ranks=2)


def _layers(bucket_layers: list[list[str]]) -> list[str]:
    return list(dict.fromkeys(name for bucket in bucket_layers for name in bucket))


def test_buckets_are_rebuilt_after_the_first_backward_in_rank_0s_ready_order(rebuilt):
    for r in rebuilt:
        assert _layers(r["bucket_layers"][0]) == ["stem", "right", "left", "head"]  # reverse registration
        # Rank 0 builds the right branch last, so its gradients come before the left's; rank 1 follows rank 0.
        assert all(_layers(b) == ["head", "right", "left", "stem"] for b in r["bucket_layers"][1:])
    assert rebuilt[0]["bucket_layers"] == rebuilt[1]["bucket_layers"]


def test_rebuilt_buckets_go_out_while_backward_still_runs(rebuilt):
    for r in rebuilt:
        assert r["launched_mid_backward"][0] == 0  # the stem's bucket came first and held everything back
        assert all(n >= 3 for n in r["launched_mid_backward"][1:])  # head, right and left are out before the stem


def test_rebuilt_buckets_and_gradient_views_keep_training_equal_to_one_process(rebuilt):
    _assert_matches_reference(rebuilt)
    assert all(r["grads_are_bucket_views"] for r in rebuilt)  # zeroed in place, backward accumulates in the bucket


def test_rebuilt_buckets_start_with_a_small_first_bucket_and_end_equal_to_ddp(rebuilt):
    for r in rebuilt:
        sizes = r["bucket_bytes"][0]
        assert sizes[0] <= jobs.FIRST_BUCKET_BYTES < max(sizes)  # DDP's small first bucket, then full ones
        torch.testing.assert_close(r["params"], r["ddp_params"], rtol=0, atol=0)


def test_gradients_set_to_none_are_copied_into_the_rebuilt_buckets(pool):
    results = pool.run(jobs.rebuild, 2, True, ranks=2)
    _assert_matches_reference(results)
    for r in results:
        torch.testing.assert_close(r["params"], r["ddp_params"], rtol=0, atol=0)
