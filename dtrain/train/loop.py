"""The training loop of ``dtrain train``: a decoder language model (:mod:`dtrain.models`) trained on packed
token sequences (:mod:`dtrain.data`) data, pipeline and/or tensor parallel, with ZeRO, mixed precision,
gradient accumulation and clipping, a learning-rate schedule, evaluation, metrics and checkpoints.

The parallel composition is :class:`~dtrain.parallel.hybrid.HybridParallel` over a
:class:`~dtrain.parallel.grid.RankGrid`: ``tp > 1`` turns the model into its tensor-parallel form
(:func:`~dtrain.parallel.parallelize.tensor_parallelize`, the logits left split over the vocabulary for
:func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy`), ``pp > 1`` cuts it into pipeline
stages, and data parallelism (plain or ZeRO) averages the gradients over the replicas. Each dp rank reads its
own rows of the global batch of step ``s`` (:class:`~dtrain.data.loader.PackedBatches`); the reported loss is
the dp average, the loss of the whole global batch.

Everything a user can get wrong is checked in the launching process before any rank starts (:func:`check_run`):
the model's shape (a preset, a ``config.json`` or a model directory), the tokenizer against it, the dataset
(the default one is prepared there, once), the layout against the world and the model, the precision against
the device, the checkpoint to resume from, and the output directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from dtrain import comm
from dtrain.comm.ir import algorithms as comm_registry
from dtrain.comm.values import all_gather_json
from dtrain.data.loader import PackedBatches, TokenDataset
from dtrain.data.tokenizer import Tokenizer
from dtrain.env import SameOnEveryRank
from dtrain.files import write_atomically
from dtrain.launch import (
    OUT_OF_MEMORY,
    last_saved_step,
    mark_saved,
    maybe_kill,
    out_of_memory_line,
    rank_device,
    restart_count,
    run_ranks,
)
from dtrain.models import ModelConfig, build, preset, train_flops_per_token
from dtrain.models import dropout as dropouts
from dtrain.models.decoder import Block
from dtrain.models.flops import pass_flops_per_token
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.parallelize import causal_lm_loss, tensor_parallelize, validate_tensor_parallel
from dtrain.parallel.pipeline_schedules import (
    Timeline,
    bubble_fraction,
    chunks_per_stage,
    theoretical_bubble,
    timelines_clock,
)
from dtrain.parallel.recompute import checkpoint_activations, chosen_blocks, from_text
from dtrain.train.checkpoint import (
    Checkpointer,
    check_files,
    checkpoint_dir,
    latest_complete_step,
    read_meta,
    restore_training_state,
    saved_data_fingerprint,
    training_state,
)
from dtrain.train.config import ConfigError, TrainConfig, check_out, run_world
from dtrain.train.metrics import MetricsWriter, mfu, peak_memory_bytes, plan_score, reset_peak_memory
from dtrain.train.optim import adamw, lr_schedule, set_lr
from dtrain.train.precision import DynamicLossScaler, autocast_dtype
from dtrain.train.trace import write_chrome_trace, write_gantt

__all__ = ["INTERLEAVED_CHUNKS", "RunPlan", "check_run", "describe", "run_world", "train", "train_rank"]

INTERLEAVED_CHUNKS = 2  # model chunks a pipeline stage holds under schedule interleaved-1f1b


@dataclass(frozen=True)
class RunPlan:
    """What the launching process resolved: the world and layout, the model's shape, the data, and the step the
    run continues from. Every rank trains from the same plan."""

    world_size: int
    dims: ParallelDims
    model: ModelConfig
    dataset: str  # a prepared dataset directory
    tokenizer: str  # its tokenizer.json
    first_step: int
    steps: int

    @property
    def done(self) -> bool:
        """True when a resumed run has nothing left to do (its checkpoint is at the last step already)."""
        return self.first_step >= self.steps


DEFAULT_DATA_CACHE = Path.home() / ".cache" / "dtrain" / "data"  # where the default dataset is prepared, once


def _weights_tokenizer(config: TrainConfig) -> tuple[Path, Tokenizer] | None:
    """The ``tokenizer.json`` of the ``--weights`` directory and the tokenizer it holds, where it has one: the ids
    the pretrained weights know."""
    if not config.model.weights:
        return None
    file = Path(config.model.weights) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return file, Tokenizer.load(file)
    except ValueError as exc:
        raise ValueError(f"--weights: {exc}") from None


def _carried_from(config: TrainConfig) -> Path | None:
    """The ``--weights`` directory whose tokenizer the run trained with, whose generation and tokenizer settings
    its exported model keeps (:func:`dtrain.models.hf.save_pretrained`'s ``carry_from``); None without one."""
    if not config.model.weights or not (Path(config.model.weights) / "tokenizer.json").is_file():
        return None
    return Path(config.model.weights)


def resolve_data(config: TrainConfig) -> tuple[str, str]:
    """(dataset directory, tokenizer.json) of the run: ``[data] dataset``, or the default dataset (Python's help
    texts with a BPE tokenizer trained on them, or tokenized by the ``--weights`` directory's tokenizer.json where
    it has one), prepared once under :data:`DEFAULT_DATA_CACHE`. A dataset must have been tokenized by the
    weights' tokenizer.json where there is one."""
    weights = _weights_tokenizer(config)
    if config.data.dataset:
        try:
            dataset = TokenDataset(config.data.dataset)  # ValueError naming the directory or file at fault
        except ValueError as exc:
            raise ValueError(f"--dataset: {exc}") from None
        if weights is not None and dataset.tokenizer_fingerprint != weights[1].fingerprint:
            raise ValueError(
                f"--dataset: {config.data.dataset} was tokenized by another tokenizer than {weights[0]}, whose ids "
                f"the weights were trained on; prepare it with dtrain data prepare ... --tokenizer {weights[0]}"
            )
        return str(config.data.dataset), str(dataset.tokenizer_path)
    from dtrain.data.default import default_dataset

    if weights is None:
        directory, tokenizer = default_dataset(DEFAULT_DATA_CACHE, config.data.tokenizer_vocab)
    else:
        try:
            directory, tokenizer = default_dataset(DEFAULT_DATA_CACHE, tokenizer=weights[1])
        except ValueError as exc:  # a tokenizer with no end-of-text token
            raise ValueError(f"--weights: {exc}") from None
    return str(directory), str(tokenizer)


def _model_source(config: TrainConfig) -> str:
    """Where the run's model shape comes from, as the flag that gives it: ``--weights DIR``, ``--model-config
    FILE`` or the preset."""
    m = config.model
    if m.weights:
        return f"--weights {m.weights}"
    if m.config:
        return f"--model-config {m.config}"
    return f"preset {m.family}/{m.preset}"


def resolve_model(config: TrainConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model's shape: the weights' config.json, ``[model] config``, or the preset (its vocabulary grown to
    the tokenizer's where that is larger); checked against the tokenizer and the sequence length. Weights are
    checked whole short of their data (:func:`~dtrain.models.hf.check_pretrained`: every safetensors header,
    every tensor's name and shape against the config)."""
    from dtrain.models import hf

    m = config.model
    if m.weights:
        try:
            shape, source = hf.check_pretrained(m.weights), _model_source(config)
            if _carried_from(config) is not None:  # what the exported model will keep, checked before any rank
                hf.carried_settings(m.weights, shape.vocab_size)
        except ValueError as exc:
            raise ValueError(f"--weights: {exc}") from None
    elif m.config:
        try:
            shape, source = hf.load_config(m.config), _model_source(config)
        except ValueError as exc:
            raise ValueError(f"--model-config: {exc}") from None
    else:
        shape, source = preset(m.family, m.preset), _model_source(config)
        if shape.vocab_size < tokenizer.vocab_size:  # a preset trained from scratch takes the tokenizer's size
            shape = preset(m.family, m.preset, vocab_size=tokenizer.vocab_size)
    if tokenizer.vocab_size > shape.vocab_size:
        raise ValueError(
            f"{source}: the model's vocabulary of {shape.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}; use a tokenizer of at most {shape.vocab_size} tokens"
        )
    positions = getattr(shape, "n_positions", None) or shape.max_position_embeddings
    if config.data.seq_len > positions:
        raise ValueError(f"--seq-len: {config.data.seq_len} is longer than the {positions} positions of {source}")
    return shape


def validate_layout(config: TrainConfig, world_size: int, shape: ModelConfig) -> ParallelDims:
    """Check the layout against the world and the model before any rank does work."""
    par = config.parallel
    if par.dp * par.pp * par.tp != world_size:
        from dtrain.env import under_torchrun

        started = f"torchrun started {world_size}" if under_torchrun() else f"--nproc starts {world_size}"
        raise ValueError(
            f"--dp/--pp/--tp: dp x pp x tp = {par.dp} x {par.pp} x {par.tp} = {par.dp * par.pp * par.tp}, but "
            f"{started} processes; the degrees must multiply to the number of processes"
        )
    dims = ParallelDims(world_size=world_size, dp=par.dp, pp=par.pp, tp=par.tp, order=par.rank_order)
    if par.tp > 1:
        try:
            validate_tensor_parallel(shape, par.tp)
        except ValueError as exc:
            raise ValueError(f"--tp: {exc}") from None
    if comm_registry.needs_local_size(par.algorithm) and par.dp != world_size:
        raise ValueError(
            f"--algorithm {par.algorithm}: needs the node size, known only for a dp group of every rank; "
            f"use --dp {world_size} (pp = tp = 1) or another algorithm"
        )
    layers = shape.num_layers + 2  # the embedding, the blocks, the head
    chunks = par.pp * (chunks_per_stage(par.schedule, INTERLEAVED_CHUNKS) if par.pp > 1 else 1)
    if chunks > layers:
        raise ValueError(
            f"--pp: {par.pp} stages of {chunks // par.pp} chunk(s) need {chunks} layers, but the model has only "
            f"{layers} (embedding, {shape.num_layers} blocks, head)"
        )
    if par.zero and par.dp == 1:
        raise ValueError(f"--zero: ZeRO stage {par.zero} shards over the dp ranks, but dp is 1")
    if par.zero == 2 and par.pp > 1 and getattr(shape, "tie_word_embeddings", False):
        raise ValueError(
            "--zero 2: with --pp above 1 the tied embedding's two copies (first and last stage) are summed after "
            "backward, but ZeRO stage 2 reduces gradients during it; use --zero 1 or 3, or --pp 1"
        )
    tr = config.training
    try:  # the recomputed blocks exist in this model
        chosen_blocks(from_text(tr.activation_checkpointing, tr.recompute_layers)[1].get("layers"), shape.num_layers)
    except ValueError as exc:
        raise ValueError(f"--recompute-layers: {exc}") from None
    return dims


def _check_precision(config: TrainConfig) -> None:
    device = rank_device()
    autocast_dtype(config.training.precision, device)  # ValueError naming the precision where it cannot run
    for key in ("pipeline_graphs", "step_graph"):
        if getattr(config.parallel, key) and device.type != "cuda":
            raise ConfigError(f"parallel.{key}", f"records CUDA graphs; the ranks would run on {device.type}")


def layout(config: TrainConfig, shape: ModelConfig) -> dict[str, Any]:
    """The layout a checkpoint was written with and the model's shape (recorded in its meta.json; a resumed run
    may have another layout)."""
    par = config.parallel
    return {
        "dp": par.dp,
        "pp": par.pp,
        "tp": par.tp,
        "zero": par.zero,
        "schedule": par.schedule if par.pp > 1 else "",
        "balance": par.balance if par.pp > 1 else "",
        "seq_len": config.data.seq_len,
        "model": {"model_type": shape.model_type, **vars(shape)},
    }


def _check_fresh(config: TrainConfig) -> int:
    """0, the step a run that does not resume starts from; ValueError naming --out where its checkpoints directory
    holds an earlier run's complete checkpoint, which the new run's would mix with (``--resume`` would then take
    whichever is later, and ``--checkpoint-keep`` remove by step). A rank the elastic agent restarted before its job
    saved a checkpoint starts over in its own directory, whatever an earlier job left."""
    out = config.logging.out
    step = latest_complete_step(out) if restart_count() == 0 else None
    if step is not None:
        raise ValueError(
            f"--out {out}: holds an earlier run's checkpoints (the last complete at step {step}); --resume "
            f"continues it; to start over, remove {out}/checkpoints or choose another --out"
        )
    return 0


def _check_resume(config: TrainConfig, world_size: int, shape: ModelConfig, data: TokenDataset) -> int:
    """The step a resumed run continues from (at whatever layout this run has); ValueError if there is no
    complete checkpoint, a file of it is missing, truncated or unreadable (:func:`check_files`), or it is of
    another model shape, sequence length or dataset (``data``: this run's)."""
    from dtrain.models import hf

    out = config.logging.out
    where = f"{out}/checkpoints"
    step = latest_complete_step(out)
    if step is None:
        raise ValueError(f"--resume: no complete checkpoint under {where}")
    directory = checkpoint_dir(out, step)
    meta = read_meta(directory)
    try:
        check_files(directory)
    except ValueError as exc:
        raise ValueError(f"--resume: {exc}") from None
    saved_model, this_model = meta.get("model"), json.loads(json.dumps(hf.config_to_dict(shape)))
    if saved_model != this_model:
        if not isinstance(saved_model, dict):
            raise ValueError(f"--resume: {directory / 'meta.json'}: model: not a model config, got {saved_model!r}")
        absent = object()
        keys = sorted(set(saved_model) | set(this_model))
        key = next(k for k in keys if saved_model.get(k, absent) != this_model.get(k, absent))

        def shown(table: dict[str, Any]) -> str:
            return json.dumps(table[key]) if key in table else "absent"

        raise ValueError(
            f"--resume: the checkpoint under {where} is of another model than this run's ({_model_source(config)}): "
            f"{key} is {shown(saved_model)} there, {shown(this_model)} here"
        )
    if meta.get("seq_len") != config.data.seq_len:
        raise ValueError(
            f"--seq-len: {config.data.seq_len}, but the checkpoint under {where} has {meta.get('seq_len')}"
        )
    try:
        saved = saved_data_fingerprint(directory)
    except ValueError as exc:
        raise ValueError(f"--resume: {exc}") from None
    if saved is not None and saved != data.fingerprint:
        trained_on = f" ({meta['dataset']})" if isinstance(meta.get("dataset"), str) else ""
        this = data.path if config.data.dataset else f"the default dataset, {data.path}"
        raise ValueError(
            f"--dataset: the checkpoint under {where} was trained on another dataset{trained_on} than this run's "
            f"({this}); resume with the dataset it was trained on"
        )
    return step


def resize(config: TrainConfig, world_size: int) -> TrainConfig:
    """With ``[elastic] resize`` (``--elastic``): the config at ``world_size`` ranks, tp and pp kept and
    ``dp = world / (tp * pp)``; the config itself otherwise. ValueError naming --elastic if the world does not
    split so."""
    par = config.parallel
    if not config.elastic.resize or par.dp * par.pp * par.tp == world_size:
        return config
    cell = par.pp * par.tp
    if world_size % cell:
        raise ValueError(
            f"--elastic: a world of {world_size} processes is not a multiple of pp x tp = {par.pp} x {par.tp}"
        )
    try:
        return dataclasses.replace(config, parallel=dataclasses.replace(par, dp=world_size // cell))
    except ValueError as exc:
        raise ValueError(f"--elastic: at dp={world_size // cell} ({world_size} processes): {exc}") from None


def check_run(config: TrainConfig, nproc: int) -> RunPlan:
    """Everything checked in the launching process before any rank starts; ValueError with one line naming the
    flag, key or file otherwise. Prepares the default dataset (once) under the output directory."""
    world = run_world(nproc)
    config = resize(config, world)
    _check_precision(config)
    dataset, tokenizer_path = resolve_data(config)
    tokenizer = Tokenizer.load(tokenizer_path)
    shape = resolve_model(config, tokenizer)
    dims = validate_layout(config, world, shape)
    data = TokenDataset(dataset)
    PackedBatches(data, "train", seq_len=config.data.seq_len, batch_size=config.training.batch_size, seed=0)
    if config.data.eval_every:
        try:
            PackedBatches(data, "val", seq_len=config.data.seq_len, batch_size=config.training.batch_size)
        except ValueError:  # not one window
            val_tokens = data.num_tokens("val")
            raise ConfigError(
                "data.eval_every",
                f"the validation split of {dataset} holds {val_tokens} val tokens, too few for one sequence of "
                f"{config.data.seq_len} tokens (and its next token); set it to 0 or use more data",
            ) from None
    first = _check_resume(config, world, shape, data) if config.checkpoint.resume else _check_fresh(config)
    plan = RunPlan(
        world_size=world,
        dims=dims,
        model=shape,
        dataset=dataset,
        tokenizer=tokenizer_path,
        first_step=first,
        steps=config.training.steps,
    )
    if not plan.done:
        check_out(config.logging.out)
    return plan


def describe(config: TrainConfig, plan: RunPlan) -> str:
    """One line saying what a run is about to do."""
    out = config.logging.out
    if plan.done:
        where = f"{out}/checkpoints"
        return f"nothing to do: the checkpoint under {where} is at step {plan.first_step}, --steps is {plan.steps}"
    par, m = config.parallel, config.model
    name = m.weights or m.config or f"{m.family} ({m.preset})"
    from dtrain.models import parameter_count

    size = parameter_count(plan.model)
    pipeline = f", {par.schedule} x {par.microbatches} micro-batches" if par.pp > 1 else ""
    if par.pp > 1 and par.microbatch_group:
        pipeline += f" in groups of {par.microbatch_group}"
    fusion = par.grad_accumulation_fusion
    if par.pp > 1 and par.zero < 2 and not config.training.compile and fusion != "off":
        fused = fusion == "on" or par.step_graph
        pipeline += ", weight gradients accumulated inside their " + ("products" if fused else "large products")
    zero = f", ZeRO-{par.zero}" if par.zero else ""
    zero += ", gradients averaged through copy engines" if par.dp_exchange == "copy-engine" else ""
    zero += ", the optimizer stepped inside backward" if par.dp_overlap_optimizer else ""
    recorded = ", each step a CUDA graph from the third" if par.step_graph else ""
    order = f" (ranks {par.rank_order})" if par.rank_order != "tp-pp-dp" and par.dp > 1 and par.pp > 1 else ""
    resumed = f" from step {plan.first_step}" if plan.first_step else ""
    return (
        f"training {name}, {size / 1e6:.1f}M parameters, on {plan.world_size} process(es), dp={par.dp} x pp={par.pp} "
        f"x tp={par.tp}{order}{pipeline}{zero}{recorded}: {plan.steps - plan.first_step} steps{resumed}, batch "
        f"{config.training.batch_size} x {config.data.seq_len} tokens, output in {out}"
    )


def train(config: TrainConfig, nproc: int, *, announce: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Check (:func:`check_run`), then run :func:`train_rank` on ``nproc`` local ranks (or this torchrun job);
    rank 0's metrics ([] when a resumed run is already complete). ``announce`` gets one line saying what starts."""
    try:
        config = resize(config, run_world(nproc))
        plan = check_run(config, nproc)
    except ValueError as exc:  # before any rank-specific work: under torchrun, every rank finds it alike
        raise SameOnEveryRank(str(exc)) from None
    if announce is not None and int(os.environ.get("RANK", "0")) == 0 and restart_count() == 0:  # once
        announce(describe(config, plan))
    if plan.done:
        return []
    restarts = config.elastic.restarts(config.checkpoint.every)
    return run_ranks(
        train_rank, nproc, config, plan, max_restarts=restarts, monitor_interval=config.elastic.monitor_interval
    )


class _Trainer:
    """One rank's model, optimizer, data and step; built from a config, its plan and the rank grid."""

    def __init__(self, config: TrainConfig, plan: RunPlan, grid: RankGrid) -> None:
        self.config, self.plan, self.grid = config, plan, grid
        par, tr, opt = config.parallel, config.training, config.optimizer
        self.device = rank_device()
        dataset = TokenDataset(plan.dataset)
        self.data = PackedBatches(dataset, "train", seq_len=config.data.seq_len, batch_size=tr.batch_size, seed=tr.seed)
        # every rank builds the same full model, on its own device (a GPU's generator is seeded too), then keeps its
        # part
        torch.manual_seed(tr.seed)
        if config.model.weights:
            from dtrain.models import hf

            model = hf.load_pretrained(config.model.weights, device=self.device).train()  # its dropout, as it trains
        else:
            model = build(plan.model, device=self.device)
        # a model without dropout leaves the masks' state alone: nothing is written to the device a micro-batch
        self.dropout = any(isinstance(m, dropouts.Dropout) and m.p > 0 for m in model.modules())
        mode, options = from_text(tr.activation_checkpointing, tr.recompute_layers, tr.recompute_keep)
        checkpoint_activations(model, mode, **options)  # on the plain model's blocks, before it is split
        # with tp > 1 the logits stay split over the vocabulary: the head never sits whole on one device
        self.loss_fn = causal_lm_loss(grid.tp_group, algorithm=par.algorithm)
        self._eval_loss_fn = causal_lm_loss(grid.tp_group, algorithm=par.algorithm, reduction="none")
        self.precision = autocast_dtype(tr.precision, self.device)
        self.scaler = DynamicLossScaler() if self.precision == torch.float16 else None
        fused = self.device.type == "cuda"
        self.hybrid = HybridParallel(
            model,
            grid,
            lambda named: adamw(
                named,
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                fused=fused or None,
                capturable=par.dp_overlap_optimizer and par.step_graph,  # its step is recorded with the rest
            ),
            tensor_parallel=functools.partial(tensor_parallelize, algorithm=par.algorithm, loss_parallel=True),
            num_microbatches=par.microbatches,
            schedule=par.schedule,
            pipeline_graphs=par.pipeline_graphs,
            step_graph=par.step_graph,
            pipeline_transport=par.pipeline_transport,
            virtual_stages=INTERLEAVED_CHUNKS if par.schedule == "interleaved-1f1b" else 1,
            microbatch_group=par.microbatch_group or None,
            schedule_costs=pass_flops_per_token(plan.model, config.data.seq_len),
            algorithm=par.algorithm,
            shard_size=par.zero_shard_size or None,
            device=self.device,
            zero_stage=par.zero,
            autocast_dtype=self.precision,
            reduce_dtype=torch.bfloat16 if tr.grad_reduce_dtype == "bf16" else None,
            dp_exchange=par.dp_exchange,
            overlap_optimizer=par.dp_overlap_optimizer,
            # compiled blocks keep autograd's own linear
            grad_accumulation_fusion=False
            if tr.compile
            else {"auto": "auto", "on": True, "off": False}[par.grad_accumulation_fusion],
            accumulation=tr.accumulation,
            balance=par.balance,
        )
        if tr.compile:
            for module in self.hybrid.module.modules():
                if isinstance(module, Block):
                    module.compile()
            if par.tp == 1:  # one fused kernel reads the bf16 logits: no float32 copy of (B, T, V)
                self.loss_fn = torch.compile(self.loss_fn)
                self._eval_loss_fn = torch.compile(self._eval_loss_fn)
        self.pipeline, self.optimizer = self.hybrid.pipeline, self.hybrid.optimizer
        sched = config.lr_schedule
        self.lr = lr_schedule(
            sched.kind,
            lr=opt.lr,
            steps=tr.steps,
            warmup_steps=sched.warmup_steps,
            decay_steps=sched.decay_steps or None,
            min_lr_ratio=sched.min_lr_ratio,
        )
        self.flops_per_token = train_flops_per_token(plan.model, config.data.seq_len)
        ck = config.checkpoint
        # the job's store records each checkpoint once it is complete, for a restarted attempt to continue from
        self.checkpointer = Checkpointer(
            config.logging.out, async_save=ck.async_save, keep=ck.keep, on_complete=mark_saved
        )

    def step(self, step: int) -> dict[str, Any]:
        cfg, grid = self.config, self.grid
        lr = self.lr(step)
        set_lr(self.optimizer, lr)
        x, y = self.data.next_batch(rank=grid.dp_rank, world=cfg.parallel.dp)  # this replica's rows
        if self.dropout:
            dropouts.set_step(cfg.training.seed, step)  # the masks of this step, on any layout and after a resume
        reset_peak_memory(self.device)
        start = time.perf_counter()
        loss = self.hybrid.train_step(
            x,
            y,
            self.loss_fn,
            local=True,
            max_grad_norm=cfg.optimizer.grad_clip or None,
            loss_scaler=self.scaler,
        )
        loss_value = loss.item()  # waits for the device
        elapsed = time.perf_counter() - start
        tokens_per_s = cfg.training.batch_size * cfg.data.seq_len / elapsed
        peak = peak_memory_bytes(self.device)
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": self.hybrid.last_grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, self.flops_per_token, self.plan.world_size, self.device),
            "peak_memory_gib": None if peak is None else peak / 2**30,
            "step_s": elapsed,
            **self.hybrid.timings,
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.scale
            record["step_skipped"] = self.hybrid.step_skipped
        return record

    def evaluate(self) -> float:
        """The mean next-token loss over every token of the validation split's first ``eval_batches`` batches (the
        same every time), whatever the layout: as one process computes it. Each replica takes an equal share of a
        batch's rows, and a pipeline evaluates in pieces of a training micro-step's rows (``batch_size / dp /
        accumulation``, cut into its micro-batches), as its stages agreed the messages' shapes at the first step;
        where a batch's rows do not fill the replicas' shares or the pieces evenly, rows of padding whose targets
        count for nothing fill them."""
        cfg, grid = self.config, self.grid
        dp = cfg.parallel.dp
        pipeline = self.hybrid.pipeline
        piece = cfg.training.batch_size // dp // cfg.training.accumulation if pipeline is not None else None
        unit = dp * (piece or 1)  # rows every batch is padded to a multiple of
        # hybrid.evaluate averages the loss function's value over the micro-batches and the replicas: undone, the
        # values summed over pieces are the summed token losses
        undo = dp * (pipeline.num_microbatches if pipeline is not None else 1)
        per_token = self._eval_loss_fn

        def summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            counted = targets >= 0
            return (per_token(logits, targets.clamp(min=0)) * counted).sum() * undo

        total, tokens = 0.0, 0
        for x, y in self.data.eval_batches(cfg.data.eval_batches, cfg.training.batch_size, split="val"):
            tokens += y.numel()
            short = -x.shape[0] % unit
            if short:
                x = torch.cat([x, x.new_zeros((short, x.shape[1]))])
                y = torch.cat([y, y.new_full((short, y.shape[1]), -1)])
            rows = x.shape[0] // dp
            mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
            xs, ys = x[mine], y[mine]
            for start in range(0, rows, piece or rows):
                end = start + (piece or rows)
                total += self.hybrid.evaluate(xs[start:end], ys[start:end], summed, local=True).item()
        return total / tokens

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's meta.json records: the layout that wrote it, the model, the data shape, the
        dataset and its fingerprint (which a resumed run's dataset must match), and its end-of-text id."""
        from dtrain.models import hf

        return {
            "layout": layout(self.config, self.plan.model),
            "model": hf.config_to_dict(self.plan.model),
            "seq_len": self.config.data.seq_len,
            "tokenizer": str(Path(self.plan.tokenizer).resolve()),
            "dataset": str(Path(self.plan.dataset).resolve()),
            "data_fingerprint": self.data.dataset.fingerprint,
            "eos_id": self.data.dataset.eos_id,
        }

    def save(self, step: int) -> None:
        group = self.checkpointer.group
        state = training_state(self.hybrid, step=step, data=self.data, scaler=self.scaler, process_group=group)
        self.checkpointer.save(step, state, self.meta())

    def restore(self) -> int:
        """Load the last complete checkpoint (after a restart, this job's last), whatever layout wrote it; the step to
        continue from."""
        out = self.config.logging.out
        found = _step_to_resume(out)
        # on the rank's device: a GPU job's group has no backend for CPU tensors
        agreed = torch.tensor([-1 if found is None else found], dtype=torch.int64, device=self.device)
        comm.all_reduce(agreed, op="min")
        if agreed.item() < 0:
            raise ValueError(f"--resume: no complete checkpoint under {out}/checkpoints")
        group = self.checkpointer.group
        state = training_state(self.hybrid, data=self.data, scaler=self.scaler, process_group=group, for_load=True)
        self.checkpointer.load(int(agreed.item()), state)
        return restore_training_state(state, data=self.data, scaler=self.scaler)

    def export(self) -> None:
        """The whole model as a Hugging Face directory ``<out>/model`` (gathered onto rank 0, which writes it)."""
        from dtrain.models import hf

        state = self.hybrid.full_state_dict()
        if dist.get_rank() == 0:
            hf.save_pretrained(
                state,
                self.plan.model,
                Path(self.config.logging.out) / "model",
                tokenizer=self.plan.tokenizer,
                eos_token_id=self.data.dataset.eos_id,
                carry_from=_carried_from(self.config),
            )


class _Progress:
    """Rank 0's progress line over a run's steps (nothing on other ranks), shown from before the model is built."""

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


def _progress_text(record: dict[str, Any], steps: int) -> str:
    text = f"step {record['step']}/{steps} loss {record['loss']:.4f} {record['tokens_per_s']:,.0f} tok/s"
    if record.get("mfu") is not None:
        text += f" MFU {record['mfu']:.1%}"
    if record.get("eval_loss") is not None:
        text += f" eval {record['eval_loss']:.4f}"
    return text


def _write_pipeline_trace(trainer: _Trainer, record: dict[str, Any]) -> None:
    """Gather the last step's timelines of this pp group; dp rank 0 writes the trace and the Gantt chart.
    ``bubble_clock`` says what ``bubble_measured`` was read on: "device" on a GPU (the step was timed with CUDA
    events, :attr:`~dtrain.parallel.pipeline_parallel.PipelineParallel.device_clock`), "host" on the CPU, "none"
    where the step was replayed as one CUDA graph, which has no action times (``bubble_measured`` None)."""
    grid, par = trainer.grid, trainer.config.parallel
    timelines = all_gather_json(trainer.pipeline.timeline.to_json(), Timeline.from_json, group=grid.pp_group)
    clock = timelines_clock(timelines)
    record["bubble_clock"] = clock
    record["bubble_measured"] = bubble_fraction(timelines) if clock != "none" else None
    record["bubble_theory"] = theoretical_bubble(
        par.pp, par.microbatches, trainer.pipeline.virtual_stages, schedule=par.schedule
    )
    if grid.dp_rank == 0 and grid.pp_rank == 0:
        out = Path(trainer.config.logging.out)
        write_chrome_trace(out / "pipeline-trace.json", timelines, grid.global_ranks("pp"))
        write_gantt(out / "pipeline-gantt.png", timelines, par.schedule)


def _peak_over_ranks(records: list[dict[str, Any]], device: torch.device) -> float | None:
    """The largest ``peak_memory_gib`` of ``records`` over every rank (a collective: every rank calls it); None
    where no memory is measured (a CPU: every rank alike). Pipeline stages hold different layers and activations,
    and the plan predicts the fullest device."""
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    if not peaks:
        return None
    most = torch.tensor([max(peaks)], dtype=torch.float64, device=device)
    comm.all_reduce(most, op="max", algorithm="native")
    return most.item()


def _after_restart(config: TrainConfig) -> TrainConfig:
    """The config of a rank the elastic agent restarted: resuming from the job's last complete checkpoint where
    an earlier attempt wrote one (else it starts over)."""
    if restart_count() == 0 or config.checkpoint.resume or last_saved_step() is None:
        return config
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=True))


def _step_to_resume(out: str | Path) -> int | None:
    """The checkpoint a resuming rank loads: after a restart, the last one this job completed (recorded in its
    store; a checkpoint an earlier run left in the directory, at a later step, is not this run's), else the last
    complete one under ``out``."""
    if restart_count() > 0:
        saved = last_saved_step()
        if saved is not None:
            return saved
    return latest_complete_step(out)


def _record_step(line: str) -> float:
    """The step of one metrics line; a line the dead attempt left half written (not a JSON record) sorts after
    every step, so it is dropped with the records past the checkpoint."""
    try:
        record = json.loads(line)
    except ValueError:
        return math.inf
    step = record.get("step", 0) if isinstance(record, dict) else math.inf
    return step if isinstance(step, int) else math.inf


def _trim_metrics(out: Path, step: int) -> None:
    """Drop the metrics records past ``step`` (an attempt that died after its last checkpoint wrote them)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _record_step(line) <= step]
    if len(kept) != len(lines):
        write_atomically(path, "".join(kept))


def train_rank(config: TrainConfig, plan: RunPlan) -> list[dict[str, Any]]:
    """Train on this rank (the default process group must be up); the metrics records (rank 0 writes them).
    After the elastic agent restarted the workers it continues from the job's last complete checkpoint. A rank
    that runs out of device memory stops the job in one line saying what needs less."""
    try:
        return _train_rank(config, plan)
    except OUT_OF_MEMORY as err:
        raise ValueError(
            f"{out_of_memory_line(err)}; a smaller --batch-size, more --accumulation (or "
            "--microbatches with pp), --zero 3, --activation-checkpointing full or more --tp / --pp need less"
        ) from None


def _train_rank(config: TrainConfig, plan: RunPlan) -> list[dict[str, Any]]:
    is_main = dist.get_rank() == 0
    config = _after_restart(config)
    log = config.logging
    out = Path(log.out)
    with _Progress(plan.steps - plan.first_step, enabled=is_main) as progress:
        grid = RankGrid.build(plan.dims)
        trainer = _Trainer(config, plan, grid)
        first = 0
        if config.checkpoint.resume:
            progress.describe("loading the checkpoint")
            first = trainer.restore()
        if is_main and restart_count() > 0:
            par, attempt = config.parallel, restart_count()
            where = f"the checkpoint of step {first}" if config.checkpoint.resume else "the start"
            print(
                f"dtrain train: restart {attempt}: continuing from {where} on {dist.get_world_size()} process(es), "
                f"dp={par.dp} x pp={par.pp} x tp={par.tp}",
                file=sys.stderr,
                flush=True,
            )
        if is_main and config.checkpoint.resume:
            _trim_metrics(out, first)
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            config.to_toml(out / "config.toml")
        progress.describe(f"step {first}/{plan.steps}")
        records = []
        writer = (
            MetricsWriter(out, tensorboard=log.tensorboard, resume=config.checkpoint.resume, first_step=first)
            if is_main
            else None
        )
        with writer if writer is not None else contextlib.nullcontext():
            for step in range(first, plan.steps):
                maybe_kill(step)
                if trainer.pipeline is not None:  # the last step's timeline is traced: on a GPU, time it there
                    trainer.pipeline.device_clock = step + 1 == plan.steps
                record = trainer.step(step)
                done = step + 1
                if trainer.pipeline is not None and done == plan.steps:
                    _write_pipeline_trace(trainer, record)
                if config.data.eval_every and (done % config.data.eval_every == 0 or done == plan.steps):
                    record["eval_loss"] = trainer.evaluate()
                if done == plan.steps or (config.checkpoint.every and done % config.checkpoint.every == 0):
                    trainer.save(done)
                if config.plan.step_s:  # the plan's prediction beside each step, scored on the last
                    record["plan_step_s"] = config.plan.step_s
                    if done == plan.steps:
                        peak = _peak_over_ranks([*records, record], trainer.device)
                        scored = plan_score([*records, record], config, peak_memory_gib=peak)
                        record |= scored
                        if is_main:
                            write_atomically(out / "plan_score.json", json.dumps(scored, indent=2) + "\n")
                if writer is not None and (done % log.log_every == 0 or done == plan.steps or "eval_loss" in record):
                    writer.write(record)
                records.append(record)
                progress.step(_progress_text(record, plan.steps))
            trainer.checkpointer.wait()  # an asynchronous save still writing
            if config.checkpoint.export:
                last = _progress_text(records[-1], plan.steps) if records else f"step {first}/{plan.steps}"
                progress.describe(f"{last}, writing the Hugging Face model directory")
                trainer.export()
    return records
