"""Bad input fails before a byte is sent; a missing peer fails with a named timeout, never a hang."""

from __future__ import annotations

import pytest

from tests.jobs import comm as jobs

BAD_INPUT = {
    "op": "unknown op 'mean'",
    "torch_op": "all_reduce: unknown op ReduceOp.BAND; known: sum, avg, prod, max, min (or ReduceOp.SUM",
    "avg_int": "needs a floating dtype",
    "algorithm": "unknown algorithm 'butterfly'",
    "src": "src=5 is outside",
    "dst": "dst=-1 is outside",
    "all_gather_size": "output has 7 elements, expected 8",
    "dtype_mismatch": "differs from input dtype",
    "reduce_scatter_size": "reduce_scatter: input has 4 elements, expected 6",
    "all_to_all_size": "not a multiple of the group size 2",
    "dtype": "complex64",
    "not_tensor": "must be a torch.Tensor",
    "hierarchical_no_nodes": "needs the node size",
    "scatter_input": "scatter: input has 5 elements, expected 4",
    "all_gather_overlap": "all_gather: output and input overlap in memory",
    "reduce_scatter_overlap": "reduce_scatter: input and output overlap in memory",
    "all_to_all_overlap": "all_to_all: output and input overlap in memory",
    "gather_overlap": "gather: output and input overlap in memory",
    "scatter_overlap": "scatter: input and output overlap in memory",
    "expanded": "all_reduce: tensor has elements that share memory",
    "expanded_output": "all_gather: output has elements that share memory",
    "src_float": "broadcast: src=1.0 is not a rank of the group",
    "dst_text": "gather: dst='0' is not a rank of the group",
}


@pytest.mark.parametrize(("case", "words"), list(BAD_INPUT.items()))
def test_bad_input_raises_value_error_naming_the_problem(pool, case, words):
    # Only rank 0 calls: had anything been sent, the next collective on the group would go wrong.
    (message,) = pool.run(jobs.bad_input, case, ranks=[0])
    assert words in message


def test_a_root_given_as_a_numpy_integer_or_an_integer_tensor_is_that_rank(pool):
    # broadcast from rank 1, reduce into it, gather to it, scatter from it: once with np.int64(1), once with tensor(1)
    rank0 = [[1.0] * 3, [1.0] * 3, [], [0.0, 1.0]]
    rank1 = [[1.0] * 3, [3.0] * 3, [0.0, 0.0, 1.0, 1.0], [2.0, 3.0]]
    assert pool.run(jobs.integer_roots, ranks=2) == [rank0 * 2, rank1 * 2]


def test_torch_reduce_ops_name_the_same_reductions(pool):
    ranks = pool.run(jobs.torch_reduce_ops, ranks=2)
    for results in ranks:
        pairs = list(zip(results[::2], results[1::2], strict=True))
        assert all(given == named for given, named in pairs), pairs
    assert ranks[0][0] == [3.0, 7.0, 5.0, 2.0, 3.0, 5.0]  # ReduceOp.SUM on rank 0


def test_group_still_works_after_bad_input(pool):
    pool.run(jobs.bad_input, "all_gather_size", ranks=[0])
    assert pool.run(jobs.after_bad_input_still_works, ranks=2) == [3.0, 3.0]


@pytest.mark.parametrize(("coll", "algorithm"), [("all_reduce", "ring"), ("broadcast", "tree")])
def test_missing_peer_times_out_naming_collective_round_and_peer(pool, coll, algorithm):
    answer, _ = pool.run(jobs.missing_peer, coll, algorithm, 2.0, ranks=2)
    seconds, message = answer.split("|", 1)
    assert float(seconds) < 10
    assert f"{coll}/{algorithm}" in message
    assert "round 0" in message
    assert "rank 1 (global 1)" in message


def test_barrier_waits_for_the_last_rank(pool):
    # the ranks that came first wait out the late rank's 0.5 s; the late rank waits less than any of them
    waited = pool.run(jobs.run_barrier, 4, 3, 0.5, ranks=4)
    assert min(waited[:3]) > 0.4 and waited[3] < min(waited[:3])
    waited = pool.run(jobs.run_barrier, 2, 1, 0.5, "dissemination@peer", ranks=2)
    assert waited[0] > 0.4 and waited[1] < waited[0]


def test_a_barrier_named_with_a_transport_runs_on_it(pool):
    assert pool.run(jobs.barrier_transport, 2, "dissemination@peer", ranks=2) == ["peer", "peer"]
    assert pool.run(jobs.barrier_transport, 2, "dissemination@p2p", ranks=2) == ["p2p", "p2p"]


def test_a_round_timeout_overrides_a_long_group_timeout(pool):
    answer, _ = pool.run(jobs.missing_peer, "all_reduce", "direct", 120.0, 1.0, ranks=2)
    seconds, message = answer.split("|", 1)
    assert float(seconds) < 10
    assert "all_reduce/direct" in message and "rank 1 (global 1)" in message


def test_a_checked_call_that_differs_on_one_rank_fails_on_every_rank_before_a_byte_is_sent(pool):
    """DTRAIN_COMM_CHECK=1: an all-reduce of 6 elements beside one of 8, or a broadcast beside an all-reduce, is one
    ValueError on both ranks naming both calls, and the group then runs a matching all-reduce correctly; matching
    calls run as without the check."""
    sizes = pool.run(jobs.checked_calls, "sizes", ranks=2)
    want = ("all_reduce: DTRAIN_COMM_CHECK: the group's ranks made different calls: rank 0 (of the group) "
            "all_reduce of 8 elements of float32, rank 1 all_reduce of 6 elements of float32")  # fmt: skip
    assert [r["error"] for r in sizes] == [want, want]
    kinds = pool.run(jobs.checked_calls, "collective", ranks=2)
    assert (
        kinds[0]["error"].startswith("all_reduce: DTRAIN_COMM_CHECK:") and "rank 1 broadcast of 8" in kinds[0]["error"]
    )
    assert kinds[1]["error"].startswith("broadcast: DTRAIN_COMM_CHECK:")
    matching = pool.run(jobs.checked_calls, "matching", ranks=2)
    assert [r["error"] for r in matching] == [None, None]
    assert [r["sum"] for r in matching] == [3.0, 3.0] and matching[0]["gathered"] == [0.0] * 3 + [1.0] * 3
    assert [r["after"] for r in (*sizes, *kinds, *matching)] == [3.0] * 6
