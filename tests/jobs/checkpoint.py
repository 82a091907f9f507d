"""Jobs for tests/train/test_checkpoint.py: checkpoints of a :class:`~dtrain.parallel.hybrid.HybridParallel`
written at one layout and loaded at another (:mod:`dtrain.train.checkpoint`, :mod:`dtrain.parallel.state`).

Every process of the pool runs each job (grids are collective); a tiny Llama (2 blocks, a tied embedding, a
vocabulary of 509 that tensor parallelism pads to 510) trains with AdamW in float32 on one global batch per
step. Each rank also trains the unsplit model itself, the uninterrupted reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.models import build, preset
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.parallelize import causal_lm_loss
from dtrain.testing.pool import group_of
from dtrain.train.checkpoint import (
    Checkpointer,
    complete_steps,
    export_checkpoint,
    latest_complete_step,
    load_model_state,
    restore_training_state,
    training_state,
)
from dtrain.train.optim import adamw

BATCH, SEQ = 8, 16
LR = 1e-2
CONFIG = preset("llama", "tiny", vocab_size=509, num_hidden_layers=2)
RTOL, ATOL = 1e-4, 1e-4  # AdamW moves an element by up to lr a step: 1% of one step

_GRIDS: dict[tuple, RankGrid | None] = {}


def _grid(layout: tuple[int, int, int, int]) -> RankGrid | None:
    """The grid of ``(dp, pp, tp, zero)`` on global ranks 0..dp*pp*tp-1 (built once per pool, collectively)."""
    dims = layout[:3]
    if dims not in _GRIDS:
        dp, pp, tp = dims
        _GRIDS[dims] = RankGrid.build(ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp), range(dp * pp * tp))
    return _GRIDS[dims]


def _factory(named):
    return adamw(named, lr=LR, weight_decay=0.1, betas=(0.9, 0.95))


def _model(seed: int):
    torch.manual_seed(seed)
    return build(CONFIG)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model trained ``steps`` steps: its losses and its final state dict (canonical names)."""
    model = _model(0)
    opt = _factory(list(model.named_parameters()))
    loss_fn = causal_lm_loss(None)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items() if k != "3.lm_head.weight"}


def _hybrid(layout: tuple[int, int, int, int], grid: RankGrid, seed: int) -> HybridParallel:
    return HybridParallel(_model(seed), grid, _factory, num_microbatches=2, zero_stage=layout[3], schedule="1f1b")


def _train(hybrid: HybridParallel, first: int, last: int) -> list[float]:
    loss_fn = causal_lm_loss(hybrid.grid.tp_group)
    return [hybrid.train_step(*_batch(step), loss_fn).item() for step in range(first, last)]


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return max(((got - want).abs() - (ATOL + RTOL * want.abs())).max().item(), 0.0)


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


def reshard(before: tuple, after: tuple, directory: str, saved_at: int, steps: int) -> dict | None:
    """Train ``saved_at`` steps at layout ``before`` (dp, pp, tp, zero), save, load at ``after`` into a model
    built from another seed, train on to ``steps``. Rank 0 of ``after`` compares its losses and the final
    whole model with the uninterrupted run; other ranks return None."""
    grid_a, grid_b = _grid(before), _grid(after)
    result = None
    ref_losses, ref_state = reference(steps) if dist.get_rank() == 0 else (None, None)
    if grid_a is not None:
        group = group_of(_world(before))
        hybrid = _hybrid(before, grid_a, seed=0)
        losses_a = _train(hybrid, 0, saved_at)
        ckpt = Checkpointer(directory, process_group=group)
        ckpt.save(saved_at, training_state(hybrid, step=saved_at, process_group=group), {"layout": list(before)})
    dist.barrier()
    if grid_b is not None:
        group = group_of(_world(after))
        hybrid = _hybrid(after, grid_b, seed=1)
        state = training_state(hybrid, process_group=group, for_load=True)
        Checkpointer(directory, process_group=group).load(saved_at, state)
        first = restore_training_state(state)
        losses_b = _train(hybrid, first, steps)
        full = hybrid.full_state_dict()
        if grid_b.rank == 0:
            losses = torch.tensor(losses_b)
            result = {
                "first": first,
                "losses": _excess(losses, torch.tensor(ref_losses[saved_at:])),
                "params": max(_excess(full[k], ref_state[k]) for k in ref_state),
                "names": sorted(full) == sorted(ref_state),
                "moved": max((full[k] - _model(0).state_dict()[k]).abs().max().item() for k in ref_state),
            }
    if dist.get_rank() == 0 and grid_a is not None:
        result = result or {}
        result["losses_before"] = _excess(torch.tensor(losses_a), torch.tensor(ref_losses[:saved_at]))
    dist.barrier()
    return result


def _killed(step: int, meta: dict) -> None:
    raise RuntimeError("killed after writing its pieces")


def crash_mid_save(directory: str) -> dict | None:
    """dp2 ZeRO-1: save step 2, train on; the save of step 4 dies after every rank wrote its pieces, before the
    checkpoint is completed (a half-written file is left too); the step-2 checkpoint still loads (at dp1 x pp2)
    and equals the model at step 2."""
    layout, other = (2, 1, 1, 1), (1, 2, 1, 0)
    grid, grid_b = _grid(layout), _grid(other)
    result = None
    if grid is not None:
        group = group_of(2)
        hybrid = _hybrid(layout, grid, seed=0)
        ckpt = Checkpointer(directory, process_group=group)
        _train(hybrid, 0, 2)
        ckpt.save(2, training_state(hybrid, step=2, process_group=group), {})
        at_two = hybrid.full_state_dict()
        _train(hybrid, 2, 4)
        state = training_state(hybrid, step=4, process_group=group)
        ckpt._complete = _killed
        error = ""
        try:
            ckpt.save(4, state, {})
        except RuntimeError as exc:
            error = str(exc)
        if dist.get_rank() == 0:
            from pathlib import Path

            for part in (Path(directory) / "checkpoints" / ".step-00000004.tmp").glob("*.distcp"):
                part.write_bytes(part.read_bytes()[:10])
        result = {"error": error, "complete": complete_steps(directory)}
        if dist.get_rank() == 0:
            from pathlib import Path

            result["leftover"] = sorted(p.name for p in (Path(directory) / "checkpoints").iterdir())
    dist.barrier()
    if grid_b is not None:
        hybrid = _hybrid(other, grid_b, seed=1)
        group = group_of(2)
        state = training_state(hybrid, process_group=group, for_load=True)
        step = latest_complete_step(directory)
        Checkpointer(directory, process_group=group).load(step, state)
        full = hybrid.full_state_dict()
        if dist.get_rank() == 0:
            result["loaded_step"] = restore_training_state(state)
            result["params"] = max((full[k] - at_two[k]).abs().max().item() for k in at_two)
    dist.barrier()
    return result


def async_keep_export(directory: str, export_to: str) -> dict | None:
    """tp2 ZeRO-less: asynchronous saves of steps 1, 2, 3 with keep=2, training between them; the kept
    checkpoints hold the model as it was when each save began; the last one exports to Hugging Face files."""
    layout = (1, 1, 2, 0)
    grid = _grid(layout)
    result = None
    if grid is not None:
        group = group_of(2)
        hybrid = _hybrid(layout, grid, seed=0)
        ckpt = Checkpointer(directory, process_group=group, async_save=True, keep=2)
        wanted = {}
        for step in range(3):
            _train(hybrid, step, step + 1)
            wanted[step + 1] = hybrid.full_state_dict()
            ckpt.save(step + 1, training_state(hybrid, step=step + 1, process_group=group), {"model": _config()})
        _train(hybrid, 3, 4)  # changes the parameters while the last save may still be writing
        pending = complete_steps(directory)
        ckpt.wait()
        if dist.get_rank() == 0:
            from dtrain.models import hf
            from dtrain.train.checkpoint import checkpoint_dir

            errors = {}
            for step in complete_steps(directory):
                got = load_model_state(checkpoint_dir(directory, step))
                errors[step] = max((got[k] - wanted[step][k]).abs().max().item() for k in wanted[step])
            export_checkpoint(checkpoint_dir(directory, 3), export_to)
            exported = hf.load_pretrained(export_to).state_dict()
            result = {
                "before_wait": pending,
                "complete": complete_steps(directory),
                "errors": errors,
                "export": max((exported[k] - wanted[3][k]).abs().max().item() for k in wanted[3]),
            }
    dist.barrier()
    return result


def _config() -> dict:
    from dtrain.models import hf

    return hf.config_to_dict(CONFIG)
