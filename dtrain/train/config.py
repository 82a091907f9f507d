"""The configuration of one ``dtrain train`` run: a TOML file, ``--set`` overrides and command-line flags.

:class:`TrainConfig` is the single declaration of every option, in sections (``[model]``, ``[data]``,
``[parallel]``, ``[optimizer]``, ``[lr_schedule]``, ``[training]``, ``[checkpoint]``, ``[logging]``). Each section
is a frozen dataclass; each field's metadata carries its help text, its accepted values (``choices``) or bounds,
and its flag where that is not ``--<field-name-with-dashes>``. The same fields make the TOML file
(:meth:`TrainConfig.to_toml`, :meth:`TrainConfig.from_dict`), the ``argparse`` flags (:func:`add_arguments`) and
the reference table of ``docs/configuration.md`` (:func:`markdown_reference`). A new option is one new field.

Values are layered, later over earlier (:func:`load_config`)::

    the defaults  <  the file (--config FILE)  <  --set section.key=VALUE (in order)  <  explicit flags

A config is validated when it is made. Every error is a :class:`ConfigError`, one line naming where the value
came from: the file and key (``train.toml: [parallel] tp: must be a positive int, got 0``), the ``--set`` key
(``--set parallel.tp: ...``) or the flag (``--tp: ...``). Checks that need the world size, the model's shape or
the tokenizer belong to the training loop.

This module imports nothing heavy at import time, so building the command's parser stays fast; validation
imports the model presets and the collective registry when a config is made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tomllib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.files import write_atomically

__all__ = [
    "check_out",
    "SECTIONS",
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "ElasticSection",
    "LoggingSection",
    "LrScheduleSection",
    "ModelSection",
    "OptimizerSection",
    "ParallelSection",
    "TrainConfig",
    "TrainingSection",
    "add_arguments",
    "flag_name",
    "from_arguments",
    "keys",
    "load_config",
    "markdown_reference",
]

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


class ConfigError(ValueError):
    """A bad configuration value, one line: ``<where>: <message>``.

    ``key`` is the ``section.field`` it is about (None for a file that cannot be read); ``where`` names where the
    value came from (``train.toml: [parallel] tp``, ``--set parallel.tp``, ``--tp``); by default the key as
    ``[section] field``.
    """

    def __init__(self, key: str | None, message: str, where: str | None = None) -> None:
        self.key = key
        self.message = message
        if where is None and key is not None:
            where = _plain_where(key)
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def _plain_where(key: str) -> str:
    section, _, name = key.partition(".")
    return f"[{section}] {name}" if name else key


def _option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Sequence[Any] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A config field; ``minimum``/``maximum`` are inclusive bounds, ``above``/``below`` exclusive ones."""
    given = {"flag": flag, "choices": tuple(choices) if choices else None, "minimum": minimum, "above": above}
    given |= {"below": below, "maximum": maximum}
    return field(default=default, metadata={"help": help, **{k: v for k, v in given.items() if v is not None}})


def _bounds_text(f: dataclasses.Field, kind: type) -> str:
    """What a bounded number must be, e.g. ``a positive int``, ``a number in [0, 1)``."""
    lo, hi = f.metadata.get("minimum", f.metadata.get("above")), f.metadata.get("maximum", f.metadata.get("below"))
    noun = "an int" if kind is int else "a number"

    def shown(bound) -> str:  # whole bounds in full (4294967295, not 4.29497e+09)
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    if kind is int and f.metadata.get("minimum") == 1 and hi is None:
        return "a positive int"
    if lo is not None and hi is not None:
        left = "[" if "minimum" in f.metadata else "("
        right = "]" if "maximum" in f.metadata else ")"
        return f"{noun} in {left}{shown(lo)}, {shown(hi)}{right}"
    if lo is not None:
        return f"{noun} {'>=' if 'minimum' in f.metadata else '>'} {shown(lo)}"
    if hi is not None:
        return f"{noun} {'<=' if 'maximum' in f.metadata else '<'} {shown(hi)}"
    return noun


def _check_field(section: str, obj: Any, f: dataclasses.Field) -> None:
    """Type, choices and bounds of one field; an int given for a float field becomes a float."""
    key = f"{section}.{f.name}"
    value = getattr(obj, f.name)
    kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
        object.__setattr__(obj, f.name, value)
    type_ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and type_ok and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    choices = f.metadata.get("choices")
    if choices is not None:
        if not type_ok or value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return
    if not type_ok:
        noun = {int: "an int", float: "a number", str: "a string", bool: "true or false"}[kind]
        if kind in (int, float):
            noun = _bounds_text(f, kind)
        raise ConfigError(key, f"must be {noun}, got {value!r}")
    if kind in (int, float):
        meta = f.metadata
        bad = (
            ("minimum" in meta and value < meta["minimum"])
            or ("above" in meta and value <= meta["above"])
            or ("maximum" in meta and value > meta["maximum"])
            or ("below" in meta and value >= meta["below"])
        )
        if bad:
            raise ConfigError(key, f"must be {_bounds_text(f, kind)}, got {value!r}")


class _Section:
    """A section of :class:`TrainConfig`: its fields are checked when it is made."""

    name: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(self.name, self, f)


@dataclass(frozen=True, kw_only=True)
class ModelSection(_Section):
    """The model: a named preset, a Hugging Face ``config.json``, or a Hugging Face model directory to start
    from."""

    name = "model"
    family: str = _option("llama", "model family", flag="--model", choices=("llama", "gpt2"))
    preset: str = _option(
        "tiny",
        "named shape of the family (dtrain.models.presets): llama tiny, 125m, 1b, 8b; gpt2 tiny, 124m, 355m",
    )
    config: str = _option(
        "", "path to a Hugging Face config.json whose shape replaces the preset's", flag="--model-config"
    )
    weights: str = _option(
        "", "a Hugging Face model directory (config.json + safetensors) to start from; its shape replaces the preset's"
    )


@dataclass(frozen=True, kw_only=True)
class DataSection(_Section):
    """The training text, its tokenizer, and evaluation on its validation split."""

    name = "data"
    dataset: str = _option(
        "",
        "a directory made by `dtrain data prepare` (with `--weights`, by the weights' tokenizer.json where they "
        "have one); empty: Python's own help texts (pydoc_data) with a BPE tokenizer trained on them, or tokenized "
        "by the weights' tokenizer.json",
    )
    tokenizer_vocab: int = _option(
        512,
        "vocabulary of the BPE tokenizer trained for the default dataset (the 256 bytes, the end-of-text token and "
        "merges)",
        minimum=257,
        maximum=2**24,
    )
    seq_len: int = _option(128, "tokens per training sequence", minimum=1)
    eval_every: int = _option(0, "steps between validation-loss evaluations (0: never)", minimum=0)
    eval_batches: int = _option(4, "batches per validation-loss evaluation", minimum=1)


@dataclass(frozen=True, kw_only=True)
class ParallelSection(_Section):
    """How the ranks split the work: dp x pp x tp must equal the world size."""

    name = "parallel"
    dp: int = _option(1, "data-parallel degree", minimum=1)
    pp: int = _option(1, "pipeline stages", minimum=1)
    tp: int = _option(1, "tensor-parallel degree (divides the attention heads)", minimum=1)
    schedule: str = _option(
        "1f1b",
        "pipeline schedule (interleaved-1f1b: 2 model chunks a stage, micro-batches a multiple of pp; zb-h1, zb-v: "
        "zero bubble, backward split into input and weight gradients, zb-v with 2 chunks a stage in a V)",
        choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"),  # pipeline_schedules.SCHEDULES
    )
    microbatches: int = _option(1, "micro-batches per pipeline step (only used when pp > 1)", minimum=1)
    microbatch_group: int = _option(
        0,
        "interleaved-1f1b: micro-batches that go through one model chunk before the next, a multiple of pp that "
        "divides microbatches (0: pp, Megatron-LM's); a larger group hides the messages from the last stage to the "
        "first behind compute and holds (group - pp) more chunks' activations",
        minimum=0,
    )
    pipeline_graphs: bool = _option(
        False,
        "replay each micro-batch's forward and backward as CUDA graphs from the second step (pp > 1 on GPUs; not with "
        "tp > 1, zero = 3, fp16, training.compile or activation checkpointing)",
    )
    step_graph: bool = _option(
        False,
        "record the whole training step as one CUDA graph at the third step and replay it: forward, loss, backward "
        "and the overlapped gradient all-reduces (pp = 1), or each stage's step with its messages (pp > 1, GPUs of "
        "one host, over peer channels); on GPUs, not with tp > 1, zero = 2 or 3, fp16, training.compile or "
        "activation checkpointing, nor with pp > 1 and pipeline_transport = group or pipeline_graphs",
    )
    pipeline_transport: str = _option(
        "auto",
        "how activations and gradients cross pipeline stages: group (the process group's send and recv), peer (peer "
        "channels between GPUs or processes of one host, from the second step), auto (peer on one host; on GPUs "
        "for messages of 64 KiB and more while a step's messages on a channel fit in 1 GiB)",
        choices=("auto", "group", "peer"),  # pipeline_parallel_communications.TRANSPORTS
    )
    dp_exchange: str = _option(
        "collective",
        "how data parallelism averages its gradient buckets (dp > 1, pp = 1, zero = 0): collective (the all-reduce "
        "[parallel] algorithm names), copy-engine (ranks of one host: each bucket scattered, summed and gathered "
        "through peer windows by the copy engines, one summing pass on the SMs; float32 reduction)",
        choices=("collective", "copy-engine"),  # data_parallel_communications.EXCHANGES
    )
    dp_overlap_optimizer: bool = _option(
        False,
        "step the optimizer inside backward, every bucket's parameters but the last's while the last bucket is "
        "still averaged, then the last's (dp > 1, pp = 1, zero = 0, optimizer.grad_clip = 0, not fp16); with "
        "step_graph the step is recorded with it",
    )
    grad_accumulation_fusion: str = _option(
        "auto",
        "pp > 1: from a stage's second micro-batch on, add each linear layer's weight gradient into its gradient "
        "inside the product, not in a second pass (Megatron-LM's gradient-accumulation fusion): on, off, or auto "
        "(every layer where the step is recorded, step_graph; eagerly the layers whose product has 2^32 "
        "multiply-adds or more, enough to pay for its Python autograd function's host time); never with zero = 2 or "
        "3 or training.compile",
        choices=("auto", "on", "off"),
    )
    zero: int = _option(
        0,
        "ZeRO stage: 0 off, 1 optimizer state sharded over dp, 2 gradients too, 3 parameters too (fully sharded)",
        choices=(0, 1, 2, 3),
    )
    zero_shard_size: int = _option(
        0,
        "ZeRO-3 hybrid sharding: shard over blocks of this many dp ranks (a node, say) and replicate across the "
        "blocks (0: shard over all of dp)",
        minimum=0,
    )
    algorithm: str = _option(
        "native",
        "all-reduce algorithm for the gradients: native (the backend's own: NCCL, Gloo), auto (dtrain's measured "
        "choice) or one of dtrain.comm.algorithms",
    )
    balance: str = _option(
        "layers",
        "how pipeline stages are cut: equal layer counts, or equal forward FLOPs a rank (its chunks together)",
        choices=("layers", "flops"),
    )
    rank_order: str = _option(
        "tp-pp-dp",
        "how the grid numbers its ranks, innermost axis first: tp-pp-dp (a replica's pipeline stages on "
        "neighbouring ranks, on one server where they fit) or tp-dp-pp (a stage's replicas on neighbouring ranks: "
        "Megatron-LM's, DeepSpeed's and torchtitan's order; part of each gradient reduction stays inside a server "
        "and, where a stage fills whole servers, every pipeline message crosses servers)",
        choices=("tp-pp-dp", "tp-dp-pp"),  # grid.RANK_ORDERS
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from dtrain.comm.ir.algorithms import accepted  # the names alone: no torch

        known = accepted("all_reduce")
        if self.algorithm not in known:
            raise ConfigError("parallel.algorithm", f"must be one of {', '.join(known)}, got {self.algorithm!r}")
        if self.zero:  # ZeRO gathers weights and reduce-scatters gradients with the same algorithm
            for collective in ("all_gather", "reduce_scatter"):
                if self.algorithm not in accepted(collective):
                    raise ConfigError(
                        "parallel.algorithm",
                        f"zero = {self.zero} runs {collective.replace('_', '-')}s with it too, which have no "
                        f"{self.algorithm!r}; one that all three have: "
                        + ", ".join(
                            a for a in known if a in accepted("all_gather") and a in accepted("reduce_scatter")
                        ),
                    )


@dataclass(frozen=True, kw_only=True)
class OptimizerSection(_Section):
    """AdamW (Loshchilov & Hutter 2019); no weight decay on norms, biases and other 1-d parameters."""

    name = "optimizer"
    lr: float = _option(3e-3, "peak learning rate", above=0)
    weight_decay: float = _option(0.1, "AdamW weight decay", minimum=0)
    beta1: float = _option(0.9, "AdamW first-moment decay", minimum=0, below=1)
    beta2: float = _option(0.95, "AdamW second-moment decay", minimum=0, below=1)
    eps: float = _option(1e-8, "AdamW denominator epsilon", above=0)
    grad_clip: float = _option(1.0, "clip the global gradient norm to this (0: off)", minimum=0)


@dataclass(frozen=True, kw_only=True)
class LrScheduleSection(_Section):
    """The learning rate over the steps: linear warmup, then constant, cosine decay, or warmup-stable-decay
    (Hu et al. 2024, MiniCPM)."""

    name = "lr_schedule"
    kind: str = _option("cosine", "shape after the warmup", flag="--lr-schedule", choices=("constant", "cosine", "wsd"))
    warmup_steps: int = _option(0, "steps of linear warmup from 0 to the peak", minimum=0)
    decay_steps: int = _option(0, "wsd: steps of the final decay (0: 20% of the steps)", minimum=0)
    min_lr_ratio: float = _option(0.1, "final learning rate as a fraction of the peak", minimum=0, maximum=1)


@dataclass(frozen=True, kw_only=True)
class TrainingSection(_Section):
    """Steps, batch, seed and numerics."""

    name = "training"
    steps: int = _option(20, "total optimizer steps (a resumed run continues up to this count)", minimum=1)
    batch_size: int = _option(
        16,
        "global batch in sequences per optimizer step: split over dp ranks, then into accumulation steps, then "
        "into micro-batches",
        minimum=1,
    )
    accumulation: int = _option(1, "gradient-accumulation steps per optimizer step", minimum=1)
    seed: int = _option(0, "model initialisation and data order", minimum=0, maximum=2**32 - 1)
    precision: str = _option(
        "auto",
        "compute precision (auto: bf16 on CUDA, float32 on CPU; fp16 uses a dynamic loss scale)",
        choices=("auto", "float32", "bf16", "fp16"),
    )
    grad_reduce_dtype: str = _option(
        "float32", "dtype the gradients are averaged in over dp", choices=("float32", "bf16")
    )
    compile: bool = _option(False, "torch.compile each block")
    activation_checkpointing: str = _option(
        "none",
        "recompute activations in backward instead of keeping them (dtrain.parallel.recompute): full (each block "
        "keeps only its input) or selective (the blocks of recompute_layers, keeping the op kinds of recompute_keep)",
        choices=("none", "full", "selective"),
    )
    recompute_layers: str = _option(
        "", "selective: the blocks recomputed: empty for every block, every:K for every K-th, or indices like 0,2,5"
    )
    recompute_keep: str = _option(
        "matmul",
        "selective: comma-separated op kinds whose outputs the recomputed blocks keep (attention, matmul, norm, "
        "elementwise); empty recomputes the whole block",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from dtrain.parallel.recompute_options import OP_KINDS, parse_layers

        try:
            parse_layers(self.recompute_layers)
        except ValueError:
            raise ConfigError(
                "training.recompute_layers",
                f"must be empty (every block), every:K or block indices like 0,2,5, got {self.recompute_layers!r}",
            ) from None
        kinds = [k.strip() for k in self.recompute_keep.split(",")] if self.recompute_keep.strip() else []
        if any(k not in OP_KINDS for k in kinds):
            raise ConfigError(
                "training.recompute_keep",
                f"must be comma-separated op kinds of {', '.join(OP_KINDS)} (or empty), got {self.recompute_keep!r}",
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(_Section):
    """Checkpoints under ``<out>/checkpoints`` and the Hugging Face export."""

    name = "checkpoint"
    every: int = _option(
        0, "steps between checkpoints (0: only after the last step)", flag="--checkpoint-every", minimum=0
    )
    resume: bool = _option(
        False, "continue from the last complete checkpoint in the output directory, at this run's layout"
    )
    keep: int = _option(0, "complete checkpoints kept, the newest (0: all)", flag="--checkpoint-keep", minimum=0)
    async_save: bool = _option(
        False, "write checkpoints in a background thread while training goes on", flag="--async-checkpoint"
    )
    export: bool = _option(True, "at the end, write a Hugging Face model directory, model/ in the output directory")


@dataclass(frozen=True, kw_only=True)
class LoggingSection(_Section):
    """Where the run writes, and how often."""

    name = "logging"
    out: str = _option("runs/train", "output directory: metrics.jsonl, checkpoints/, TensorBoard events, traces")
    tensorboard: bool = _option(True, "also write TensorBoard event files")
    log_every: int = _option(1, "steps between metric records", minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.out:
            raise ConfigError("logging.out", "must be a directory path, got ''")


@dataclass(frozen=True, kw_only=True)
class PlanSection(_Section):
    """What ``dtrain plan --write`` predicted for this layout (informational: training records it beside what it
    measures, and does not act on it); 0 and empty mean no prediction."""

    name = "plan"
    step_s: float = _option(0.0, "predicted seconds a step", minimum=0, flag="--plan-step-s")
    memory_gib: float = _option(
        0.0,
        "predicted peak memory a device, GiB (scored against the most any rank allocates)",
        minimum=0,
        flag="--plan-memory-gib",
    )
    tokens_per_s: float = _option(
        0.0, "predicted tokens a second over all devices", minimum=0, flag="--plan-tokens-per-s"
    )
    topology: str = _option("", "the topology the plan was simulated on", flag="--plan-topology")
    devices: int = _option(0, "the devices the plan was simulated on", minimum=0, flag="--plan-devices")
    layout: str = _option("", "the layout the plan chose, as the planner describes it", flag="--plan-layout")


@dataclass(frozen=True, kw_only=True)
class ElasticSection(_Section):
    """Surviving a dead rank (torchelastic, https://pytorch.org/docs/stable/elastic/run.html): the agent
    restarts the workers, which continue from the last complete checkpoint; under ``torchrun --nnodes MIN:MAX``
    the job may come back with fewer processes."""

    name = "elastic"
    max_restarts: int = _option(
        -1,
        "times the workers are restarted after one fails (-1: 3 when [checkpoint] every > 0, else 0)",
        minimum=-1,
    )
    monitor_interval: float = _option(0.1, "seconds between the agent's checks of its workers", above=0)
    resize: bool = _option(
        False,
        "on a world of another size keep tp and pp and take dp = world / (tp * pp), loading the checkpoint at "
        "the new layout",
        flag="--elastic",
    )

    def restarts(self, checkpoint_every: int) -> int:
        """The restarts a run gets: ``max_restarts``, or for -1 three when checkpoints are written as it goes."""
        if self.max_restarts >= 0:
            return self.max_restarts
        return 3 if checkpoint_every > 0 else 0


SECTIONS: dict[str, type[_Section]] = {
    cls.name: cls
    for cls in (
        ModelSection,
        DataSection,
        ParallelSection,
        OptimizerSection,
        LrScheduleSection,
        TrainingSection,
        CheckpointSection,
        LoggingSection,
        ElasticSection,
        PlanSection,
    )
}


def keys() -> Iterator[tuple[str, dataclasses.Field]]:
    """Every ``(section.field, field)`` of :class:`TrainConfig`, in declaration order."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])} if section in SECTIONS else {}
    if name not in fields:
        raise KeyError(key)
    return fields[name]


def flag_name(key: str) -> str:
    """The command-line flag of config key ``section.field``: ``training.batch_size`` -> ``--batch-size``,
    ``checkpoint.every`` -> ``--checkpoint-every``."""
    f = _field(key)
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run, in sections; ``TrainConfig()`` is the defaults. Cross-field checks run when it is made."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_schedule: LrScheduleSection = field(default_factory=LrScheduleSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)
    plan: PlanSection = field(default_factory=PlanSection)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {getattr(self, name)!r}")
        model, parallel, training = self.model, self.parallel, self.training
        if model.config and model.weights:
            raise ConfigError(
                "model.config", "give model.config or model.weights, not both (the weights' directory has its own)"
            )
        if not model.config and not model.weights:
            from dtrain.models.presets import PRESETS

            if model.preset not in PRESETS[model.family]:
                known = ", ".join(PRESETS[model.family])
                raise ConfigError("model.preset", f"no preset {model.preset!r} for {model.family}; known: {known}")
        schedule = self.lr_schedule
        if schedule.warmup_steps > training.steps:
            raise ConfigError(
                "lr_schedule.warmup_steps",
                f"must be at most training.steps ({training.steps}), got {schedule.warmup_steps}",
            )
        if schedule.kind == "wsd" and schedule.decay_steps > training.steps - schedule.warmup_steps:
            raise ConfigError(
                "lr_schedule.decay_steps",
                f"must be at most training.steps - warmup_steps ({training.steps - schedule.warmup_steps}), got "
                f"{schedule.decay_steps}",
            )
        if training.batch_size % parallel.dp:
            raise ConfigError(
                "training.batch_size", f"{training.batch_size} sequences do not split over dp={parallel.dp} ranks"
            )
        if parallel.grad_accumulation_fusion == "on":
            cannot = (
                "pp = 1 (no micro-batches a stage accumulates)"
                if parallel.pp == 1
                else f"zero = {parallel.zero} (its gradients are reduced as they are made)"
                if parallel.zero >= 2
                else "training.compile (compiled blocks keep autograd's own linear)"
                if training.compile
                else None
            )
            if cannot is not None:
                raise ConfigError(
                    "parallel.grad_accumulation_fusion",
                    f"'on' needs pp > 1, zero 0 or 1 and no training.compile; it cannot apply with {cannot}",
                )
        if parallel.zero_shard_size:
            if parallel.zero != 3:
                raise ConfigError(
                    "parallel.zero_shard_size",
                    f"shards parameters over part of dp: it needs zero = 3, got {parallel.zero}",
                )
            if parallel.dp % parallel.zero_shard_size:
                raise ConfigError(
                    "parallel.zero_shard_size",
                    f"must divide dp={parallel.dp} (blocks of equal size), got {parallel.zero_shard_size}",
                )
        local = training.batch_size // parallel.dp
        if local % training.accumulation:
            raise ConfigError(
                "training.accumulation",
                f"each dp rank's {local} sequences do not split into {training.accumulation} accumulation steps",
            )
        if parallel.dp_exchange != "collective":
            refused = [
                (parallel.dp == 1, "dp = 1 (no gradient to average)"),
                (parallel.pp > 1, "pp > 1 (the stages average their gradients after the pipeline)"),
                (parallel.zero > 0, f"zero = {parallel.zero} (ZeRO reduces its own shards)"),
                (training.grad_reduce_dtype != "float32", "grad_reduce_dtype = bf16 (it averages in float32)"),
            ]
            reason = next((why for bad, why in refused if bad), None)
            if reason is not None:
                raise ConfigError("parallel.dp_exchange", f"{parallel.dp_exchange} does not run with {reason}")
        if parallel.dp_overlap_optimizer:
            refused = [
                (parallel.dp == 1, "dp = 1 (no gradient to average)"),
                (parallel.pp > 1, "pp > 1 (the stages average their gradients after the pipeline)"),
                (parallel.zero > 0, f"zero = {parallel.zero} (ZeRO steps its own shards)"),
                (self.optimizer.grad_clip > 0, "optimizer.grad_clip > 0 (clipping needs every gradient first)"),
                (training.precision == "fp16", "fp16 (its loss scale needs every gradient checked first)"),
            ]
            reason = next((why for bad, why in refused if bad), None)
            if reason is not None:
                raise ConfigError("parallel.dp_overlap_optimizer", f"does not run with {reason}")
        if parallel.pipeline_graphs and parallel.pp == 1:
            raise ConfigError("parallel.pipeline_graphs", "replays a pipeline's micro-batches; it needs pp > 1")
        if parallel.step_graph:
            refused = [
                (parallel.tp > 1, "tp > 1 (its collectives run inside each forward)"),
                (parallel.zero in (2, 3), f"zero = {parallel.zero} (its collectives run inside forward and backward)"),
                (training.precision == "fp16", "fp16 (its loss scale changes between steps)"),
                (training.compile, "training.compile"),
                (training.activation_checkpointing != "none", "activation checkpointing"),
                (
                    parallel.pp > 1 and parallel.pipeline_transport == "group",
                    "pipeline_transport = group (no peer channels)",
                ),
                (parallel.pipeline_graphs, "pipeline_graphs (one or the other)"),
            ]
            reason = next((why for bad, why in refused if bad), None)
            if reason is not None:
                raise ConfigError("parallel.step_graph", f"does not run with {reason}")
        if parallel.pp > 1:
            step = local // training.accumulation
            if step % parallel.microbatches:
                raise ConfigError(
                    "parallel.microbatches",
                    f"each accumulation step's {step} sequences (batch_size / dp / accumulation) do not split into "
                    f"{parallel.microbatches} micro-batches",
                )
            if parallel.schedule in ("zb-h1", "zb-v") and (parallel.zero in (2, 3) or training.compile):
                raise ConfigError(
                    "parallel.schedule",
                    f"{parallel.schedule} defers weight gradients out of autograd, after zero = 2 and 3 reduce them; "
                    "it does not run with zero = 2, zero = 3 or training.compile (use 1f1b or interleaved-1f1b)",
                )
            if parallel.pipeline_graphs:
                refused = [
                    (parallel.tp > 1, "tp > 1 (its collectives run inside each forward)"),
                    (parallel.zero == 3, "zero = 3 (its gathers run inside each forward)"),
                    (training.precision == "fp16", "fp16 (its loss scale changes between steps)"),
                    (training.compile, "training.compile"),
                    (training.activation_checkpointing != "none", "activation checkpointing"),
                ]
                reason = next((why for bad, why in refused if bad), None)
                if reason is not None:
                    raise ConfigError("parallel.pipeline_graphs", f"does not run with {reason}")
            group = parallel.microbatch_group
            if group and parallel.schedule != "interleaved-1f1b":
                raise ConfigError(
                    "parallel.microbatch_group",
                    f"groups interleaved-1f1b's micro-batches; schedule is {parallel.schedule}",
                )
            if group and group % parallel.pp:
                raise ConfigError("parallel.microbatch_group", f"{group} is not a multiple of pp={parallel.pp}")
            if parallel.schedule == "interleaved-1f1b" and parallel.microbatches % (group or parallel.pp):
                raise ConfigError(
                    "parallel.microbatches",
                    "interleaved-1f1b takes micro-batches in groups of "
                    + (f"microbatch_group={group}" if group else f"pp={parallel.pp}")
                    + f"; {parallel.microbatches} is not a multiple",
                )
        elif parallel.microbatch_group:
            raise ConfigError("parallel.microbatch_group", "groups a pipeline's micro-batches; pp is 1")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as ``{section: {field: value}}`` of plain values."""
        return dataclasses.asdict(self)

    def to_toml(self, path: str | os.PathLike | None = None) -> str:
        """The config as a TOML file (every key, in declaration order); written to ``path`` atomically where
        given. :func:`load_config` reads it back equal."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines += [f"[{section}]", *(f"{name} = {_toml_value(value)}" for name, value in values.items()), ""]
        text = "\n".join(lines)
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, text)
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> TrainConfig:
        """The config of ``{section: {field: value}}`` (missing keys keep their defaults). ``source`` (a file
        name) starts every error's location: ``train.toml: [parallel] tp: ...``."""
        flat = _flatten(data, source)
        where = {key: f"{source}: {_plain_where(key)}" if source else _plain_where(key) for key in flat}
        return _build(flat, where)


def _toml_value(value: Any) -> str:
    """One TOML value: a basic string (JSON's escapes are TOML's), an integer, a float or a boolean."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _valid_keys(section: str) -> str:
    return ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))


def _flatten(data: Mapping[str, Any], source: str | None) -> dict[str, Any]:
    """``{section: {field: value}}`` as ``{"section.field": value}``; unknown sections and keys are errors."""
    prefix = f"{source}: " if source else ""
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            what = f"[{section}]: unknown section" if isinstance(values, Mapping) else f"{section}: not a section"
            raise ConfigError(None, f"{prefix}{what}; sections: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(None, f"{prefix}{section}: must be a table [{section}], got {values!r}")
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for name, value in values.items():
            if name not in names:
                raise ConfigError(
                    None, f"{prefix}[{section}] {name}: unknown key; keys of [{section}]: {_valid_keys(section)}"
                )
            flat[f"{section}.{name}"] = value
    return flat


def _build(flat: Mapping[str, Any], where: Mapping[str, str]) -> TrainConfig:
    """A :class:`TrainConfig` of ``section.field`` values; an error names ``where[key]`` for the key at fault."""
    try:
        sections = {}
        for section, cls in SECTIONS.items():
            values = {k.partition(".")[2]: v for k, v in flat.items() if k.partition(".")[0] == section}
            sections[section] = cls(**values)
        return TrainConfig(**sections)
    except ConfigError as exc:
        if exc.key in where:
            raise ConfigError(exc.key, exc.message, where[exc.key]) from None
        raise


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(None, f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(None, f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(None, f"{path}: not valid TOML: {exc}") from None


def _parse_set(item: str) -> tuple[str, Any]:
    """``section.key=VALUE`` as ``(key, value)``: the value in TOML value syntax (``2``, ``3e-4``, ``true``,
    ``"text"``), else the bare text; a string field takes the bare text unless it is a quoted TOML string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(None, f"--set {item}: expected section.key=VALUE")
    section, dot, name = key.partition(".")
    if not dot:
        raise ConfigError(None, f"--set {key}: expected section.key=VALUE; sections: {', '.join(SECTIONS)}")
    if section not in SECTIONS:
        raise ConfigError(None, f"--set {key}: unknown section [{section}]; sections: {', '.join(SECTIONS)}")
    try:
        f = _field(key)
    except KeyError:
        raise ConfigError(None, f"--set {key}: unknown key; keys of [{section}]: {_valid_keys(section)}") from None
    text = text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if f.type in ("str", str) and not isinstance(value, str):
        value = text
    return key, value


def load_config(
    path: str | os.PathLike | None = None,
    sets: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """The config of the defaults, then the TOML file ``path``, then each ``section.key=VALUE`` of ``sets`` in
    order, then ``flags`` (``{"section.field": value}``, values already typed); each later layer overrides the
    earlier ones key by key. Errors name the layer the value at fault came from."""
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        layer = _flatten(_read_file(path), str(path))
        flat |= layer
        where |= {key: f"{path}: {_plain_where(key)}" for key in layer}
    for item in sets:
        key, value = _parse_set(item)
        flat[key], where[key] = value, f"--set {key}"
    for key, value in (flags or {}).items():
        flat[key], where[key] = value, flag_name(key)  # _field raises KeyError for an unknown key
    return _build(flat, where)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE``, ``--set KEY=VALUE`` and one flag per config key to ``parser``, one argument group
    per section. Every default is ``argparse.SUPPRESS``: only the flags given appear in the parsed namespace
    (``dest`` is the ``section.field`` key), so they override the file and ``--set``."""
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="TOML file of [section] tables (see configs/); flags and --set override it",
    )
    parser.add_argument(
        "--set",
        dest="config_sets",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=argparse.SUPPRESS,
        help="override one key (repeatable), e.g. --set optimizer.lr=3e-4; the value in TOML syntax or bare text",
    )
    for section, cls in SECTIONS.items():
        about = " ".join((cls.__doc__ or "").split()).replace("``", "").replace("%", "%%")
        group = parser.add_argument_group(f"[{section}]", about)
        for f in dataclasses.fields(cls):
            kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
            text = f"{f.metadata['help']} (default: {_toml_value(f.default)})".replace("%", "%%")
            kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS, "help": text}
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = kind
                kwargs["metavar"] = {int: "N", float: "X", str: "TEXT"}[kind]
                if "choices" in f.metadata:
                    kwargs["choices"] = list(f.metadata["choices"])
                    kwargs["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
            group.add_argument(flag_name(f"{section}.{f.name}"), **kwargs)


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of flags parsed by a parser given :func:`add_arguments`: the defaults, then
    ``--config``, then each ``--set`` in order, then the explicit flags."""
    given = vars(args)
    flags = {key: given[key] for key, _ in keys() if key in given}
    config = load_config(given.get("config_file"), given.get("config_sets") or (), flags)
    _check_flags_used(config, flags)
    return config


def _check_flags_used(config: TrainConfig, flags: dict[str, Any]) -> None:
    """Refuse a flag given explicitly that the run would ignore: ``--preset`` or a ``--model`` of another family
    beside the shape of ``--weights`` / ``--model-config``, ``--tokenizer-vocab`` beside the tokenizer of
    ``--dataset`` or of the ``--weights`` directory."""
    m, data = config.model, config.data
    source = ("--weights", m.weights) if m.weights else ("--model-config", m.config) if m.config else None
    if source is not None and "model.preset" in flags:
        raise ConfigError(
            "model.preset", f"{source[0]} {source[1]} gives the model's shape; drop the preset", where="--preset"
        )
    if source is not None and "model.family" in flags:
        file = Path(source[1]) / "config.json" if m.weights else Path(source[1])
        try:
            kind = json.loads(file.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            kind = None  # the run's own check names what is wrong with the file
        if isinstance(kind, str) and kind != m.family:
            raise ConfigError(
                "model.family", f"{m.family}, but {source[0]} {source[1]} is a {kind} model", where="--model"
            )
    if "data.tokenizer_vocab" in flags:
        given = f"{data.tokenizer_vocab}"
        if data.dataset:
            why = f"--dataset {data.dataset} was tokenized already"
        elif m.weights and (Path(m.weights) / "tokenizer.json").is_file():
            why = f"the run takes the tokenizer of --weights {m.weights}"
        else:
            return
        raise ConfigError(
            "data.tokenizer_vocab",
            f"{given}: trains a tokenizer for the default dataset, but {why}; drop the flag",
            where="--tokenizer-vocab",
        )


def markdown_reference() -> str:
    """The reference tables of ``docs/configuration.md``: one per section, each key's flag, default and meaning."""
    out: list[str] = []
    for section, cls in SECTIONS.items():
        doc = " ".join((cls.__doc__ or "").split()).replace("``", "`")
        out += [f"### `[{section}]`", "", doc, "", "| Key | Flag | Default | Meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
            flag = flag_name(f"{section}.{f.name}")
            flags = f"`{flag}`, `--no-{flag[2:]}`" if kind is bool else f"`{flag}`"
            meaning = f.metadata["help"]
            if "choices" in f.metadata:
                meaning += "; one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
            elif kind in (int, float) and ({"minimum", "above", "below", "maximum"} & set(f.metadata)):
                meaning += f"; {_bounds_text(f, kind)}"
            meaning = meaning.replace("|", "\\|")
            out.append(f"| `{f.name}` | {flags} | `{_toml_value(f.default)}` | {meaning}. |")
        out.append("")
    return "\n".join(out)


def check_out(out: str, *, create: bool = True) -> None:
    """Create ``out`` (and its parents) and check a file can be written there; ValueError naming --out if not.
    Without ``create`` nothing is made: a file is written and removed in ``out`` or, where it does not exist yet,
    in the nearest directory above it that does."""
    path = Path(out)
    if not create:
        path = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    probe = path / f".dtrain-write-check-{uuid.uuid4().hex[:8]}"
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--out {out}: cannot create or write the output directory ({reason})") from None


def run_world(nproc: int) -> int:
    """The number of ranks a run has: torchrun's ``WORLD_SIZE`` under torchrun, else ``nproc`` (checked, before
    torch is imported)."""
    from dtrain.env import under_torchrun

    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc: must be a positive int, got {nproc!r}")
    return nproc
