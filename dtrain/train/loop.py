"""The training loop of ``dtrain train``: a model from :mod:`dtrain.train.models` trained data, pipeline and/or
tensor parallel over a :class:`~dtrain.parallel.grid.RankGrid`, with AdamW, JSON-lines metrics and checkpoints.

The parallel composition is :class:`~dtrain.parallel.hybrid.HybridParallel`: ``tp > 1`` (GPT only) turns every
layer into its tensor-parallel twin over the tp group (:mod:`dtrain.train.tensor_parallel_gpt`, the logits left
split over the vocabulary for :func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy`);
``pp == 1`` wraps the model in :class:`~dtrain.parallel.data_parallel.DataParallel` over the dp group
(gradients averaged while backward runs); ``pp > 1`` runs :class:`~dtrain.parallel.pipeline_parallel.
PipelineParallel` over the pp group and then averages each stage's gradients over its dp group with one
all-reduce of the flattened gradients. Every rank draws the same global batch from ``(seed, step)`` and takes
its dp shard; the reported loss is the dp average, i.e. the loss of the whole global batch.

Everything a user can get wrong is checked in the launching process before any rank starts
(:func:`check_run`): the layout against the world, the batch and the model, the checkpoint to resume from (its
layout and model), and the output directory. Checkpoints and resume: :mod:`dtrain.train.checkpoint`; pipeline
traces: :mod:`dtrain.train.trace`; the options: :mod:`dtrain.train.config`.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from dtrain import comm
from dtrain.comm.ir import algorithms as comm_registry
from dtrain.launch import rank_device, run_ranks, under_torchrun
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.pipeline_schedules import bubble_fraction, theoretical_bubble
from dtrain.parallel.tensor_parallel import vocab_parallel_cross_entropy
from dtrain.train.checkpoint import (
    checkpoint_path,
    latest_complete_step,
    latest_step,
    load_checkpoint,
    load_layout,
    save_checkpoint,
)
from dtrain.train.config import TrainConfig
from dtrain.train.data import ClassificationBatches, TextBatches
from dtrain.train.models import build_model, model_config, num_layers
from dtrain.train.tensor_parallel_gpt import tensor_parallel_gpt
from dtrain.train.trace import write_chrome_trace, write_gantt

__all__ = [
    "INTERLEAVED_CHUNKS",
    "RunStart",
    "TrainConfig",
    "check_run",
    "run_world",
    "train",
    "train_rank",
    "validate_layout",
]

INTERLEAVED_CHUNKS = 2  # model chunks a pipeline stage holds under --schedule interleaved-1f1b
LAYOUT_KEYS = ("model", "preset", "dp", "pp", "tp", "seed", "batch_size")  # what a checkpoint must match


def validate_layout(config: TrainConfig, world_size: int) -> ParallelDims:
    """Check the layout against the world, the batch and the model before any rank does work."""
    dims = ParallelDims(world_size=world_size, dp=config.dp, pp=config.pp, tp=config.tp)
    if config.tp > 1:
        _validate_tensor_parallel(config)
    if comm_registry.needs_local_size(config.algorithm) and config.dp != world_size:
        raise ValueError(
            f"--algorithm {config.algorithm}: needs the node size, known only for a dp group of every rank; "
            f"use --dp {world_size} (pp = tp = 1) or another algorithm"
        )
    if config.batch_size % config.dp:
        raise ValueError(f"batch size {config.batch_size} is not divisible by dp={config.dp}")
    local = config.batch_size // config.dp
    if config.pp > 1 and local % config.microbatches:
        raise ValueError(
            f"each dp rank's batch of {local} (batch size {config.batch_size} / dp {config.dp}) is not divisible "
            f"by {config.microbatches} micro-batches"
        )
    layers = num_layers(config.model, model_config(config.model, config.preset))
    if config.pp > layers:
        raise ValueError(f"pp={config.pp} stages but model {config.model!r} ({config.preset}) has only {layers} layers")
    if config.pp > 1 and config.schedule == "interleaved-1f1b":
        _validate_interleaved(config, layers)
    return dims


def _validate_interleaved(config: TrainConfig, layers: int) -> None:
    chunks = INTERLEAVED_CHUNKS * config.pp
    if chunks > layers:
        raise ValueError(
            f"interleaved-1f1b cuts the model into {INTERLEAVED_CHUNKS} x pp={config.pp} = {chunks} chunks, but "
            f"model {config.model!r} ({config.preset}) has only {layers} layers; use 1f1b or a smaller pp"
        )
    if config.microbatches % config.pp:
        raise ValueError(
            f"interleaved-1f1b takes micro-batches in groups of pp={config.pp}; {config.microbatches} is not a multiple"
        )


def _validate_tensor_parallel(config: TrainConfig) -> None:
    if config.model != "gpt":
        raise ValueError(f"tp={config.tp}: tensor parallelism supports model 'gpt' only, not {config.model!r}")
    cfg = model_config("gpt", config.preset)
    for name in ("n_head", "n_embd"):
        if getattr(cfg, name) % config.tp:
            raise ValueError(
                f"tp={config.tp}: gpt ({config.preset}) has {name}={getattr(cfg, name)}, which does not divide by "
                f"tp; choose a tp that divides n_head={cfg.n_head} and n_embd={cfg.n_embd}"
            )


def layout(config: TrainConfig) -> dict[str, Any]:
    """The options a checkpoint records and a resumed run must match."""
    return {k: getattr(config, k) for k in LAYOUT_KEYS}


@dataclass(frozen=True)
class RunStart:
    """Where a checked run starts: its world and layout, and the step it continues from."""

    world_size: int
    dims: ParallelDims
    first_step: int
    steps: int

    @property
    def done(self) -> bool:
        """True when a resumed run has nothing left to do (its checkpoint is at ``--steps`` already)."""
        return self.first_step >= self.steps


def run_world(nproc: int) -> int:
    """The number of ranks a run has: torchrun's ``WORLD_SIZE`` under torchrun, else ``nproc`` (checked)."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc: must be a positive int, got {nproc!r}")
    return nproc


def _check_resume(config: TrainConfig, world_size: int) -> int:
    """The step a resumed run continues from; ValueError if the checkpoint is missing or another layout's."""
    where = f"{config.out}/checkpoints"
    step = latest_complete_step(config.out, world_size)
    probe = step if step is not None else latest_step(config.out)  # an incomplete one still tells the layout
    written = load_layout(checkpoint_path(config.out, probe, 0)) if probe is not None else None
    if written is not None and written != layout(config):
        keys = [k for k in LAYOUT_KEYS if written.get(k) != getattr(config, k)]
        was = " ".join(f"{k}={written.get(k)}" for k in keys)
        now = " ".join(f"{k}={getattr(config, k)}" for k in keys)
        raise ValueError(f"--resume: the checkpoint under {where} was written with {was}; this run has {now}")
    if step is None:
        raise ValueError(f"--resume: no complete checkpoint of {world_size} ranks under {where}")
    return step


def _check_out(out: str) -> None:
    """Create ``out`` (and its parents) and check a file can be written there; ValueError naming --out if not."""
    path = Path(out)
    probe = path / f".dtrain-write-check-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--out {out}: cannot create or write the output directory ({reason})") from None


def check_run(config: TrainConfig, nproc: int) -> RunStart:
    """Everything checked in the launching process before any rank starts: the world, the layout, the checkpoint
    to resume from and the output directory (created). ValueError with one line naming the flag otherwise."""
    world = run_world(nproc)
    dims = validate_layout(config, world)
    first = _check_resume(config, world) if config.resume else 0
    start = RunStart(world_size=world, dims=dims, first_step=first, steps=config.steps)
    if not start.done:
        _check_out(config.out)
    return start


def describe(config: TrainConfig, start: RunStart) -> str:
    """One line saying what a run is about to do."""
    if start.done:
        return (
            f"nothing to do: the checkpoint under {config.out}/checkpoints is at step {start.first_step}, "
            f"--steps is {config.steps}"
        )
    steps = config.steps - start.first_step
    resumed = f" from step {start.first_step}" if start.first_step else ""
    pipeline = f", {config.schedule} x {config.microbatches} micro-batches" if config.pp > 1 else ""
    return (
        f"training {config.model} ({config.preset}) on {start.world_size} processes, dp={config.dp} x "
        f"pp={config.pp} x tp={config.tp}{pipeline}: {steps} steps{resumed}, batch {config.batch_size}, "
        f"output in {config.out}"
    )


def train(config: TrainConfig, nproc: int, *, announce: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Check (:func:`check_run`), then run :func:`train_rank` on ``nproc`` local ranks (or this torchrun job);
    rank 0's metrics ([] when a resumed run is already complete). ``announce`` gets one line saying what starts."""
    start = check_run(config, nproc)
    if announce is not None and int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        announce(describe(config, start))
    if start.done:
        return []
    return run_ranks(train_rank, nproc, config)


def _data(config: TrainConfig):
    if config.model == "gpt":
        block = model_config("gpt", config.preset).block_size
        data, tokenizer = TextBatches.from_corpus(batch_size=config.batch_size, block_size=block, seed=config.seed)
        return data, tokenizer, {"vocab_size": tokenizer.vocab_size}
    cfg = model_config("mlp", config.preset)
    data = ClassificationBatches(
        in_features=cfg.in_features, num_classes=cfg.num_classes, batch_size=config.batch_size, seed=config.seed
    )
    return data, None, {}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, *, group, algorithm: str) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, group, algorithm=algorithm)  # (B, T, V/tp) against (B, T)


class _Trainer:
    """One rank's model, optimizer and step; built from a config and the rank grid."""

    def __init__(self, config: TrainConfig, grid: RankGrid) -> None:
        self.config, self.grid = config, grid
        self.data, self.tokenizer, overrides = _data(config)
        torch.manual_seed(config.seed)  # every rank builds the same full model, then keeps its part
        model = build_model(config.model, config=model_config(config.model, config.preset, **overrides))
        self.loss_fn = _loss
        if config.tp > 1:
            # logits stay split over the vocabulary: the head's classes never sit whole on one device
            self.loss_fn = functools.partial(_vocab_parallel_loss, group=grid.tp_group, algorithm=config.algorithm)
        self.hybrid = HybridParallel(
            model,
            grid,
            functools.partial(torch.optim.AdamW, lr=config.lr, weight_decay=config.weight_decay),
            tensor_parallel=functools.partial(tensor_parallel_gpt, algorithm=config.algorithm, gather_logits=False),
            num_microbatches=config.microbatches,
            schedule=config.schedule,
            virtual_stages=INTERLEAVED_CHUNKS if config.schedule == "interleaved-1f1b" else 1,
            algorithm=config.algorithm,
            device=rank_device(),
        )
        self.pipeline, self.module, self.optimizer = self.hybrid.pipeline, self.hybrid.module, self.hybrid.optimizer

    def step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        x, y = self.data.batch(step)  # the global batch; HybridParallel takes this replica's shard
        loss = self.hybrid.train_step(x, y, self.loss_fn)
        timings = self.hybrid.timings
        elapsed = sum(timings.values())
        tokens = x.numel() if cfg.model == "gpt" else x.shape[0]
        return {
            "step": step + 1,
            "loss": loss.item(),
            "tokens_per_s" if cfg.model == "gpt" else "samples_per_s": tokens / elapsed,
            "step_s": elapsed,
            **timings,
        }

    def save(self, step: int) -> None:
        state = {
            "step": step,
            "layout": layout(self.config),
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        save_checkpoint(checkpoint_path(self.config.out, step, dist.get_rank()), state)

    def restore(self) -> int:
        """Load the last checkpoint complete on every rank; the step to continue from."""
        found = latest_complete_step(self.config.out, dist.get_world_size())
        agreed = torch.tensor([-1 if found is None else found], dtype=torch.int64)
        comm.all_reduce(agreed, op="min")
        if agreed.item() < 0:
            raise ValueError(f"--resume: no complete checkpoint under {self.config.out}/checkpoints")
        state = load_checkpoint(checkpoint_path(self.config.out, int(agreed.item()), dist.get_rank()))
        if state["layout"] != layout(self.config):
            raise ValueError(f"--resume: the checkpoint was written by {state['layout']}, not {layout(self.config)}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])


class _Progress:
    """Rank 0's progress bar over a run's steps (nothing on other ranks), shown from before the model is built."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._enabled, self._total = enabled, total
        self._bar = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self._enabled:
            self._bar.start()
            self._task = self._bar.add_task("train: building the model", total=self._total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._bar.stop()

    def describe(self, text: str) -> None:
        if self._enabled:
            self._bar.update(self._task, description=f"train: {text}")

    def step(self, text: str) -> None:
        if self._enabled:
            self._bar.update(self._task, advance=1, description=f"train: {text}")


def _write_pipeline_trace(trainer: _Trainer, record: dict[str, Any]) -> None:
    """Gather the last step's timelines of this pp group; dp rank 0 writes the trace and the Gantt chart."""
    grid, cfg = trainer.grid, trainer.config
    timelines: list[Any] = [None] * cfg.pp
    dist.all_gather_object(timelines, trainer.pipeline.timeline, group=grid.pp_group)
    record["bubble_measured"] = bubble_fraction(timelines)
    record["bubble_theory"] = theoretical_bubble(cfg.pp, cfg.microbatches, trainer.pipeline.virtual_stages)
    if grid.dp_rank == 0 and grid.pp_rank == 0:
        out = Path(cfg.out)
        write_chrome_trace(out / "pipeline-trace.json", timelines, grid.global_ranks("pp"))
        write_gantt(out / "pipeline-gantt.png", timelines, cfg.schedule)


def train_rank(config: TrainConfig) -> list[dict[str, Any]]:
    """Train on this rank (the default process group must be up); the metrics records (rank 0 writes them)."""
    dims = validate_layout(config, dist.get_world_size())
    is_main = dist.get_rank() == 0
    first = (latest_complete_step(config.out, dims.world_size) or 0) if config.resume else 0  # for the bar's total
    with _Progress(config.steps - first, enabled=is_main) as progress:
        grid = RankGrid.build(dims)
        trainer = _Trainer(config, grid)
        if config.resume:
            progress.describe("loading the checkpoint")
            first = trainer.restore()
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        if is_main:
            (out / "config.json").write_text(json.dumps(asdict(config), indent=2))
            if trainer.tokenizer is not None:
                trainer.tokenizer.save(out / "vocab.json")
        progress.describe(f"step {first}/{config.steps}")
        records = []
        with (
            open(out / "metrics.jsonl", "a" if config.resume else "w") if is_main else open(os.devnull, "w") as metrics
        ):
            for step in range(first, config.steps):
                record = trainer.step(step)
                done = step + 1
                if trainer.pipeline is not None and done == config.steps:
                    _write_pipeline_trace(trainer, record)
                if done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0):
                    trainer.save(done)
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                records.append(record)
                progress.step(f"step {done}/{config.steps} loss {record['loss']:.4f}")
    return records
