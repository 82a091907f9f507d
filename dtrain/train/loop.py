"""The training loop of ``dtrain train``: a model from :mod:`dtrain.train.models` trained data, pipeline and/or
tensor parallel over a :class:`~dtrain.parallel.grid.RankGrid`, with AdamW, JSON-lines metrics and checkpoints.

Layouts: ``pp == 1`` wraps the model in :class:`~dtrain.parallel.data_parallel.DataParallel` over the dp group
(gradients averaged while backward runs); ``pp > 1`` runs :class:`~dtrain.parallel.pipeline_parallel.
PipelineParallel` over the pp group and then averages each stage's gradients over its dp group with one
all-reduce of the flattened gradients. Every rank draws the same global batch from ``(seed, step)`` and takes
its dp shard; the reported loss is the dp average, i.e. the loss of the whole global batch. ``tp > 1`` (GPT only)
first turns every block into its tensor-parallel twin over the tp group (:mod:`dtrain.train.tensor_parallel_gpt`);
the model stays an ``nn.Sequential`` whose outputs are whole on every tp rank, so pipeline and data parallelism
wrap it unchanged and the dp average runs over the dp group only (each tp rank averages its own shards).
Checkpoints and resume: :mod:`dtrain.train.checkpoint`; pipeline traces: :mod:`dtrain.train.trace`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain import comm
from dtrain.bench.report import Progress
from dtrain.launch import rank_device, run_ranks, under_torchrun
from dtrain.parallel.data_parallel import DataParallel, split_batch
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.pipeline_parallel import PipelineParallel
from dtrain.parallel.pipeline_schedules import SCHEDULES, bubble_fraction, theoretical_bubble
from dtrain.parallel.tensor_parallel import vocab_parallel_cross_entropy
from dtrain.train.checkpoint import checkpoint_path, latest_complete_step, load_checkpoint, save_checkpoint
from dtrain.train.data import ClassificationBatches, TextBatches
from dtrain.train.models import build_model, model_config, num_layers
from dtrain.train.tensor_parallel_gpt import tensor_parallel_gpt
from dtrain.train.trace import write_chrome_trace, write_gantt

__all__ = ["INTERLEAVED_CHUNKS", "TrainConfig", "train", "train_rank", "validate_layout"]

INTERLEAVED_CHUNKS = 2  # model chunks a pipeline stage holds under --schedule interleaved-1f1b


@dataclass(kw_only=True)
class TrainConfig:
    """One training run; the fields are ``dtrain train``'s flags."""

    model: str = "gpt"  # "gpt" (on pydoc_data text) or "mlp" (on synthetic classification)
    preset: str = "debug"  # see dtrain.train.models.PRESETS
    steps: int = 20  # total optimizer steps (a resumed run continues up to this count)
    batch_size: int = 16  # global batch, split over dp ranks, then into micro-batches
    seed: int = 0  # model initialisation and data order
    dp: int = 1
    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"  # pipeline schedule, "gpipe", "1f1b" or "interleaved-1f1b" (2 model chunks a stage)
    microbatches: int = 1  # per pipeline step (pp > 1 only)
    lr: float = 3e-3
    weight_decay: float = 0.01
    out: str = "runs/train"  # metrics.jsonl, checkpoints/, pipeline trace and Gantt chart
    checkpoint_every: int = 0  # steps between checkpoints; 0: only after the last step
    resume: bool = False  # continue from the last complete checkpoint in out
    algorithm: str = "auto"  # collective algorithm for the gradient all-reduce

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "dp", "pp", "tp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        model_config(self.model, self.preset)  # raises on an unknown model or preset


def validate_layout(config: TrainConfig, world_size: int) -> ParallelDims:
    """Check the layout against the world, the batch and the model before any rank does work."""
    dims = ParallelDims(world_size=world_size, dp=config.dp, pp=config.pp, tp=config.tp)
    if config.tp > 1:
        _validate_tensor_parallel(config)
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
    if config.resume and latest_complete_step(config.out, world_size) is None:
        raise ValueError(f"--resume: no complete checkpoint of {world_size} ranks under {config.out}/checkpoints")
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


def train(config: TrainConfig, nproc: int) -> list[dict[str, Any]]:
    """Validate, then run :func:`train_rank` on ``nproc`` local ranks (or this torchrun job); rank 0's metrics."""
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    validate_layout(config, world)
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
        self.config, self.grid, self.device = config, grid, rank_device()
        self.data, self.tokenizer, overrides = _data(config)
        torch.manual_seed(config.seed)  # every rank builds the same full model, then keeps its stage
        model = build_model(config.model, config=model_config(config.model, config.preset, **overrides))
        self.loss_fn = _loss
        if config.tp > 1:
            # logits stay split over the vocabulary: the head's classes never sit whole on one device
            model = tensor_parallel_gpt(model, grid.tp_group, algorithm=config.algorithm, gather_logits=False)
            self.loss_fn = functools.partial(_vocab_parallel_loss, group=grid.tp_group, algorithm=config.algorithm)
        model = model.to(self.device)
        if config.pp > 1:
            interleaved = config.schedule == "interleaved-1f1b"
            self.pipeline = PipelineParallel(
                model,
                grid.pp_group,
                num_microbatches=config.microbatches,
                schedule=config.schedule,
                virtual_stages=INTERLEAVED_CHUNKS if interleaved else 1,
                grad_group=grid.pp_grad_group,
            )
            self.module = self.pipeline.stage
        else:
            self.pipeline = None
            self.module = model
            self.forward = DataParallel(model, grid.dp_group, algorithm=config.algorithm) if config.dp > 1 else model
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)

    def step(self, step: int) -> dict[str, Any]:
        cfg, grid = self.config, self.grid
        x, y = self.data.batch(step)
        if cfg.dp > 1:
            x, y = split_batch((x, y), grid.dp_group)
        x, y = x.to(self.device), y.to(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(x, y, self.loss_fn)
        else:
            loss = self.loss_fn(self.forward(x), y)
            loss.backward()  # DataParallel averages over dp here, overlapped with backward
        computed = time.perf_counter()
        loss = loss.detach().clone()
        if cfg.dp > 1:
            if self.pipeline is not None:
                self._average_gradients()
            comm.all_reduce(loss, op="avg", group=grid.dp_group, algorithm=cfg.algorithm)
        communicated = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        tokens = x.numel() * cfg.dp if cfg.model == "gpt" else x.shape[0] * cfg.dp
        return {
            "step": step + 1,
            "loss": loss.item(),
            "tokens_per_s" if cfg.model == "gpt" else "samples_per_s": tokens / (end - start),
            "step_s": end - start,
            "compute_s": computed - start,
            "comm_s": communicated - computed,
            "optimizer_s": end - communicated,
        }

    def _average_gradients(self) -> None:
        """One all-reduce of this stage's flattened gradients over its dp group (pp > 1)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op="avg", group=self.grid.dp_group, algorithm=self.config.algorithm)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()

    def layout(self) -> dict[str, Any]:
        return {k: getattr(self.config, k) for k in ("model", "preset", "dp", "pp", "tp", "seed", "batch_size")}

    def save(self, step: int) -> None:
        state = {
            "step": step,
            "layout": self.layout(),
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
        if state["layout"] != self.layout():
            raise ValueError(f"--resume: the checkpoint was written by {state['layout']}, not {self.layout()}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])


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
    grid = RankGrid.build(dims)
    trainer = _Trainer(config, grid)
    first = trainer.restore() if config.resume else 0
    is_main = dist.get_rank() == 0
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if is_main:
        (out / "config.json").write_text(json.dumps(asdict(config), indent=2))
        if trainer.tokenizer is not None:
            trainer.tokenizer.save(out / "vocab.json")
    records = []
    with (
        open(out / "metrics.jsonl", "a" if config.resume else "w") if is_main else open(os.devnull, "w") as metrics,
        Progress(config.steps - first, enabled=is_main) as progress,
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
