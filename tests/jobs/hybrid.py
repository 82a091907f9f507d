"""Jobs for tests/parallel/test_hybrid.py: :class:`~dtrain.parallel.hybrid.HybridParallel` (what ``dtrain train``
runs) against the unsplit model on one process.

Every rank of the pool builds the same four MLP blocks from a seed and trains an untouched copy itself as the
reference: the whole global batch through the whole model, plain autograd, the same optimizer. The hybrid run
must give the same losses, and each rank's parameters must equal its slice (tensor parallel) of its stage's
blocks (pipeline) of the reference, whichever replica (data parallel) it is in.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import comm
from dtrain.comm.ir import algorithms as registry
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel, tensor_parallel_blocks
from tests.jobs import graphs

WIDTH, HIDDEN, BLOCKS = 16, 32, 4  # the last block's 16 outputs are the logits of 16 classes
GLOBAL_BATCH = 16
STEPS = 5
RTOL, ATOL = 1e-5, 1e-6

LAYOUTS = {  # name -> (dp, pp, tp); the grid lives on global ranks 0..dp*pp*tp-1
    "dp2": (2, 1, 1),
    "dp2xpp2": (2, 2, 1),
    "dp2xtp2": (2, 1, 2),
    "tp2xpp2": (1, 2, 2),
    "dp2xpp2xtp2": (2, 2, 2),
    "dp2xpp2xtp2, tp-dp-pp": (2, 2, 2, "tp-dp-pp"),  # Megatron-LM's rank order: a stage's replicas neighbours
}

_GRIDS: dict[str, RankGrid | None] = {}  # building groups is slow and collective: once per layout per pool


def _grid(layout: str) -> RankGrid | None:
    if layout not in _GRIDS:
        dp, pp, tp, *order = LAYOUTS[layout]
        dims = ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, order=order[0] if order else "tp-pp-dp")
        _GRIDS[layout] = RankGrid.build(dims, range(dims.world_size))
    return _GRIDS[layout]


def _blocks(seed: int, frozen: tuple[int, ...] = ()) -> nn.Sequential:
    """The four MLP blocks; those in ``frozen`` with ``requires_grad=False``."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(BLOCKS))
    )
    for i in frozen:
        model[i].requires_grad_(False)
    return model


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTH, generator=g)  # (B, WIDTH)
    y = torch.randint(0, WIDTH, (GLOBAL_BATCH,), generator=g)  # (B,) class labels
    return x, y


def _sgd(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The optimizer factory: SGD with momentum over this rank's named parameters."""
    return torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)


def _reference(steps: int, autocast: bool = False, frozen: tuple[int, ...] = ()) -> tuple[list[float], nn.Sequential]:
    """One device training the unsplit blocks on the global batch (``autocast``: under CPU bf16 autocast;
    ``frozen``: those blocks left untrained)."""
    model = _blocks(seed=0, frozen=frozen)
    opt = _sgd([(n, q) for n, q in model.named_parameters() if q.requires_grad])
    losses = []
    for step in range(steps):
        x, y = _global_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def _expected_shards(block: nn.Sequential, tp: int, tp_rank: int) -> list[torch.Tensor]:
    """A reference block's parameters as ParallelMLP rank ``tp_rank`` holds them (fc_in.{weight,bias},
    fc_out.{weight,bias}): the first linear split by output rows, the second by input columns, its bias whole."""
    fc_in, fc_out = block[0], block[2]
    return [
        fc_in.weight.chunk(tp, 0)[tp_rank],
        fc_in.bias.chunk(tp, 0)[tp_rank],
        fc_out.weight.chunk(tp, 1)[tp_rank],
        fc_out.bias,
    ]


def _excess(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> float:
    """How far ``got`` lies beyond rtol, atol (default 1e-5, 1e-6) of ``want`` (0 within it; inf on a shape
    mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    return max(((got - want).abs() - (atol + rtol * want.abs())).max().item(), 0.0)


def equivalence(
    layout: str, schedule: str, num_microbatches: int, algorithm: str = "auto", overlap_optimizer: bool = False
) -> dict | None:
    """Train ``STEPS`` steps on ``layout``; this rank's worst loss and parameter errors, or None off the grid.

    ``algorithm`` is the gradient all-reduce's; for one that needs the node size, the dp group is one node.
    ``overlap_optimizer``: the optimizer stepped inside backward.
    """
    grid = _grid(layout)
    if grid is None:
        return None
    if registry.needs_local_size(algorithm):
        comm.set_local_size(grid.dims.dp, grid.dp_group)
    ref_losses, reference = _reference(STEPS)
    hybrid = HybridParallel(
        _blocks(seed=0),
        grid,
        _sgd,
        tensor_parallel=functools.partial(tensor_parallel_blocks, algorithm="auto"),
        num_microbatches=num_microbatches,
        schedule=schedule,
        algorithm=algorithm,
        overlap_optimizer=overlap_optimizer,
    )
    losses = [hybrid.train_step(*_global_batch(step), F.cross_entropy).item() for step in range(STEPS)]
    clipping = ""
    if overlap_optimizer:
        try:
            hybrid.train_step(*_global_batch(STEPS), F.cross_entropy, max_grad_norm=1.0)
        except ValueError as err:
            clipping = str(err)
    tp = grid.dims.tp
    want = [w for i in hybrid.layer_indices for w in _expected_shards(reference[i], tp, grid.tp_rank)]
    got = list(hybrid.parameters())
    return {
        "coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank),
        "blocks": hybrid.layer_indices,
        "loss": _excess(torch.tensor(losses), torch.tensor(ref_losses)),
        "params": max(_excess(g.detach(), w.detach()) for g, w in zip(got, want, strict=True)),
        "param_count": len(got),
        "moved": max((g.detach() - w.detach()).abs().max().item() for g, w in zip(got, _initial(hybrid), strict=True)),
        "clipping": clipping,
    }


def frozen_blocks(layout: str, frozen: tuple[int, ...], steps: int = 2) -> dict | None:
    """Train ``steps`` steps on ``layout`` (tensor parallel through :func:`tensor_parallel_blocks`) with the blocks
    in ``frozen`` untrainable: this rank's worst parameter error against one device, and how far its shards of the
    frozen blocks moved; None off the grid."""
    grid = _grid(layout)
    if grid is None:
        return None
    _, reference = _reference(steps, frozen=frozen)
    hybrid = HybridParallel(_blocks(seed=0, frozen=frozen), grid, _sgd, tensor_parallel=tensor_parallel_blocks)
    for step in range(steps):
        hybrid.train_step(*_global_batch(step), F.cross_entropy)
    tp = grid.dims.tp
    want = [w for i in hybrid.layer_indices for w in _expected_shards(reference[i], tp, grid.tp_rank)]
    got = list(hybrid.parameters())
    start = _initial(hybrid)
    return {
        "params": max(_excess(g.detach(), w.detach()) for g, w in zip(got, want, strict=True)),
        "trainable": sum(q.requires_grad for q in got),
        "frozen_moved": max(
            ((g.detach() - w).abs().max().item() for g, w in zip(got, start, strict=True) if not g.requires_grad),
            default=None,  # no frozen shard
        ),
    }


def _initial(hybrid: HybridParallel) -> list[torch.Tensor]:
    """This rank's shards of the untrained blocks: training must have moved them, or the comparison proves little."""
    start = _blocks(seed=0)
    grid = hybrid.grid
    return [w for i in hybrid.layer_indices for w in _expected_shards(start[i], grid.dims.tp, grid.tp_rank)]


def step_graphed(
    accumulation: int, autocast: bool = False, zero_stage: int = 0, steps: int = 6, overlap: bool = False
) -> dict | None:
    """``dp2`` with ``step_graph`` and a stand-in for the CUDA graph (no GPU here;
    :func:`tests.jobs.graphs.stand_in`): two eager steps, then the step (forward, loss, backward and
    DataParallel's bucket all-reduces) recorded once and replayed. Against the unsplit model (float32) or, under
    bf16 autocast, the same layout run eagerly under the same autocast: the worst loss and parameter errors, the
    recordings and replays, what the recorded forwards ran under, and what a batch of another shape and another
    loss function say. ``zero_stage`` 1: the gradients are averaged by the ZeRO optimizer's step after the
    replay, not inside it. ``overlap``: the optimizer steps inside the recorded backward (``overlap_optimizer``),
    the stand-in's recording leaving the parameters and the optimizer's state as they were, as a capture does."""
    from dtrain.parallel import step_graph

    grid = _grid("dp2")
    if grid is None:
        return None
    seen, hybrid = [], None
    dtype = torch.bfloat16 if autocast else None

    def build() -> HybridParallel:
        return HybridParallel(
            _blocks(seed=0),
            grid,
            _sgd,
            accumulation=accumulation,
            autocast_dtype=dtype,
            zero_stage=zero_stage,
            overlap_optimizer=overlap,
        )

    def undo():  # what a capture, which runs nothing, leaves: the parameters and the optimizer's state
        weights = [q.detach().clone() for q in hybrid.params]
        state = copy.deepcopy(hybrid.optimizer.state_dict())

        def put_back() -> None:
            with torch.no_grad():
                for q, w in zip(hybrid.params, weights, strict=True):
                    q.copy_(w)
            hybrid.optimizer.load_state_dict(state)

        return put_back

    with graphs.stand_in(lambda: hybrid.graphed.recorded, undo if overlap else None) as standing:
        hybrid = build()
        # the constructor refuses step_graph off a GPU: the same recording it would make, on the CPU
        hybrid.graphed = step_graph.GraphedStep(
            hybrid._forward_backward, hybrid.params, torch.device("cpu"), label="step_graph", hint="forget"
        )
        hybrid.module.register_forward_pre_hook(standing.autocast_seen(seen))
        one_device = None
        if autocast:
            eager = build()
            want = [eager.train_step(*_global_batch(step), F.cross_entropy).item() for step in range(steps)]
            reference = list(eager.parameters())
            # the eager layout itself against one device under the same autocast, within bf16's rounding
            alone, model = _reference(steps, autocast=True)
            one_device = max(
                _excess(torch.tensor(want), torch.tensor(alone), 1e-3, 1e-4),
                *(
                    _excess(e.detach(), w.detach(), 1e-3, 1e-4)
                    for e, w in zip(reference, model.parameters(), strict=True)
                ),
            )
        else:
            want, model = _reference(steps)
            reference = list(model.parameters())
        losses = [hybrid.train_step(*_global_batch(step), F.cross_entropy).item() for step in range(steps)]
        said = []
        x, y = _global_batch(steps)
        for bad in ((x[:4], y[:4], F.cross_entropy), (x, y, lambda out, t: F.cross_entropy(out, t))):
            try:
                hybrid.train_step(*bad)
                said.append("no error")
            except ValueError as err:
                said.append(str(err))
    return {
        "loss": _excess(torch.tensor(losses), torch.tensor(want)),
        "one_device": one_device,
        "params": max(_excess(g.detach(), w.detach()) for g, w in zip(hybrid.parameters(), reference, strict=True)),
        "moved": max(
            (g.detach() - w.detach()).abs().max().item()
            for g, w in zip(hybrid.parameters(), _initial(hybrid), strict=True)
        ),
        "records": standing.records,
        "replays": standing.replays,
        "recorded_under": sorted(set(seen)),
        "said": said,
    }
