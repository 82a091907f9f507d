"""A step recorded as one graph (:mod:`dtrain.parallel.step_graph`) on one process, with the stand-in for the
CUDA graph of :mod:`tests.jobs.graphs` (no GPU here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtrain.parallel import step_graph
from tests.jobs import graphs


@pytest.fixture
def stand_in():
    """The stand-in graph of :mod:`tests.jobs.graphs`, replaying the step that ``owner[0]`` recorded."""
    owner: list[step_graph.GraphedStep] = []
    with graphs.stand_in(lambda: owner[0].recorded) as seen:
        yield owner, seen


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = list(model.parameters())

    def step(x, y, *, recording):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return model, params, step


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def test_the_third_call_records_and_later_calls_replay_with_the_eager_losses_and_gradients(stand_in):
    model, params, step = _setup()
    ref, ref_params, ref_step = _setup()
    owner, seen = stand_in
    graphed = step_graph.GraphedStep(step, params, torch.device("cpu"))
    owner.append(graphed)
    for i in range(6):
        for q in (*params, *ref_params):
            q.grad = None
        x, y = _batch(i)
        got, want = graphed(x, y), ref_step(x, y, recording=False)
        assert torch.equal(got, want), i
        for a, b in zip(params, ref_params, strict=True):
            assert torch.equal(a.grad, b.grad), i
        with torch.no_grad():
            for q in (*params, *ref_params):
                q -= 0.1 * q.grad
        if i == 3:  # the gradients kept from the step before: the replay's is added to them, as eagerly
            graphed(x, y)
            ref_step(x, y, recording=False)
            for j, (a, b) in enumerate(zip(params, ref_params, strict=True)):
                assert torch.equal(a.grad, b.grad) and a.grad is not graphed.recorded.grads[j], i
    assert seen.records == 1 and seen.replays == 5 and graphed.eager_run == 2 and graphed.replays == 5


def test_another_shape_is_refused_until_forget_and_then_recorded_again(stand_in):
    _, params, step = _setup()
    owner, seen = stand_in
    graphed = step_graph.GraphedStep(step, params, torch.device("cpu"), label="demo", hint="forget() first")
    owner.append(graphed)
    for i in range(3):
        graphed(*_batch(i))
    x, y = _batch(9)
    with pytest.raises(ValueError, match=r"^demo: the step was recorded for a batch of \(\(6, 4\), torch.float32\), "
                       r"got \(\(3, 4\), torch.float32\); forget\(\) first$"):  # fmt: skip
        graphed(x[:3], y[:3])
    graphed.forget()
    for _ in range(3):
        graphed(x[:3], y[:3])
    assert seen.records == 2 and graphed.recorded.inputs[0].shape == (3, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_eager_steps_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="eager_steps must be a positive int"):
        step_graph.GraphedStep(lambda *a, recording: None, [], torch.device("cpu"), eager_steps=bad)
