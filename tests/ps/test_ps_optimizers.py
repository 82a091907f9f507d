"""The servers' row optimizers match torch.optim step for step, and touch only the rows they are given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.ps.config import JobConfig
from dtrain.ps.keys import KeyRange, dense_slots, partition, split_by_range
from dtrain.ps.optimizers import make_optimizer


@pytest.mark.parametrize(
    ("name", "kwargs", "torch_opt"),
    [
        ("sgd", {"lr": 0.1}, lambda p: torch.optim.SGD(p, lr=0.1)),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
        ("adam", {"lr": 0.01}, lambda p: torch.optim.Adam(p, lr=0.01)),
    ],
)  # fmt: skip
def test_dense_steps_match_torch_optim(name, kwargs, torch_opt):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((5, 3)).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(weights.copy()))
    opt = torch_opt([param])
    ours = make_optimizer(JobConfig(num_keys=5, width=3, optimizer=name, **kwargs), 5, 3)
    rows = np.arange(5)
    for _ in range(5):
        grad = rng.standard_normal((5, 3)).astype(np.float32)
        param.grad = torch.from_numpy(grad.copy())
        opt.step()
        ours.step(weights, rows, grad)
    np.testing.assert_allclose(weights, param.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_rows_without_a_gradient_do_not_move(name):
    weights = np.ones((4, 2), np.float32)
    opt = make_optimizer(JobConfig(num_keys=4, width=2, optimizer=name, momentum=0.5), 4, 2)
    opt.step(weights, np.array([1, 3]), np.ones((2, 2), np.float32))
    assert (weights[[0, 2]] == 1).all() and (weights[[1, 3]] < 1).all()


@settings(max_examples=50, deadline=None)
@given(num_keys=st.integers(1, 200), parts=st.integers(1, 9), seed=st.integers(0, 1000))
def test_key_ranges_cover_every_key_once_and_split_finds_its_owner(num_keys, parts, seed):
    if parts > num_keys:
        with pytest.raises(ValueError, match="non-empty ranges"):
            partition(num_keys, parts)
        return
    ranges = partition(num_keys, parts)
    assert ranges[0].lo == 0 and ranges[-1].hi == num_keys
    assert all(a.hi == b.lo for a, b in zip(ranges, ranges[1:], strict=False))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    keys = np.random.default_rng(seed).integers(0, num_keys, size=50)
    groups = split_by_range(keys, ranges)
    assert sorted(np.concatenate(groups).tolist()) == list(range(50))
    for r, pos in zip(ranges, groups, strict=True):
        assert r.holds(keys[pos])


def test_dense_slots_pad_the_last_row_and_round_trip():
    slots = dense_slots([("w", (3, 5)), ("b", (5,))], width=4)
    assert [(s.first, s.rows) for s in slots] == [(0, 4), (4, 2)]
    values = np.arange(15, dtype=np.float32)
    rows = slots[0].to_rows(values, 4)
    assert rows.shape == (4, 4) and rows[-1].tolist() == [12, 13, 14, 0]
    np.testing.assert_array_equal(slots[0].from_rows(rows), values.reshape(3, 5))
    assert KeyRange(4, 6).holds(np.array([4, 5])) and not KeyRange(4, 6).holds(np.array([6]))


@settings(max_examples=50, deadline=None)
@given(order=st.permutations(list(range(8))), held=st.integers(0, 8))
def test_a_shard_knows_which_pushes_it_holds_whatever_order_they_came_in(order, held):
    # a retried push can arrive after a later one; it must not pass for a duplicate of an id already seen
    from dtrain.ps.shard import ShardState

    config = JobConfig(num_keys=4, width=2, num_servers=1, num_workers=1, mode="async")
    state = ShardState(config, 0, partition(config.num_keys, 1)[0])
    for push_id in order[:held]:
        state.record_push(0, push_id)
    assert [state.holds_push(0, i) for i in range(8)] == [i in order[:held] for i in range(8)]


def test_a_folded_late_push_is_acknowledged_only_once_its_round_is_at_the_chain_tail():
    # acknowledged at folding time, it would live only in the head's memory and die with it
    from dtrain.ps.consistency import Push
    from dtrain.ps.replication import Replica

    config = JobConfig(num_keys=4, width=2, num_servers=2, num_workers=2, mode="quorum", quorum=1, late="fold",
                       replicas=2, replication="chain")  # fmt: skip
    sent, acks = [], []
    head = Replica(
        config, 0, partition(config.num_keys, 1)[0], 0, lambda *m: sent.append(m), lambda r, h: acks.append((r, h))
    )
    head.set_chain([0, 1])
    head.init(np.zeros((4, 2), np.float32), Push(0, -1, -1, None, None, ("init",)))
    head.chain_ack(head.state.seq)

    def push(worker, push_id, clock):
        return Push(
            worker, push_id, clock, np.array([1], np.int64), np.ones((1, 2), np.float32), (f"w{worker}", push_id)
        )

    head.push(push(0, 0, 0))  # closes round 0 on its own (quorum 1)
    head.push(push(1, 0, 0))  # late for round 0: folded into round 1
    assert ("w1", 0) not in [r for r, _ in acks]
    head.push(push(0, 1, 1))  # closes round 1, with the folded push
    assert ("w1", 0) not in [r for r, _ in acks]  # applied at the head, not yet at the tail
    head.chain_ack(head.state.seq)  # the tail has it
    assert (("w1", 0), {"status": "folded"}) in acks
