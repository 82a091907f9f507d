"""The optimizer state a checkpoint's save or load makes where none exists (dtrain.parallel.state): it leaves the
state of the parameters already stepped as it was, and the state it makes steps as no state does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtrain.parallel.state import init_optimizer_state


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    ],
    ids=["adamw", "sgd"],
)
def test_a_parameter_not_stepped_yet_gets_a_fresh_state_and_the_others_keep_theirs(make):
    """A parameter no step has had a gradient for has no state; making its state for a checkpoint neither steps the
    others' state (AdamW's moments and step count, SGD's momentum) nor starts its own anywhere but where no state
    starts: training after the save goes on as without it."""

    def run(save: bool) -> list[torch.Tensor]:
        used, spare = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((2,), 2.0))
        opt = make([used, spare])
        for step in range(3):
            used.grad = torch.full((3,), 0.5 + step)
            spare.grad = torch.full((2,), 0.25) if step == 2 else None  # spare has no gradient in steps 0 and 1
            opt.step()
            if step == 0 and save:
                before = {k: v.clone() for k, v in opt.state[used].items()}
                init_optimizer_state(SimpleNamespace(optimizer=opt))
                for key, value in before.items():
                    assert torch.equal(opt.state[used][key], value), key
                assert spare in opt.state and torch.equal(spare.detach(), torch.full((2,), 2.0))
        return [used.detach(), spare.detach()]

    for got, want in zip(run(save=True), run(save=False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
