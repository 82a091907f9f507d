"""A run config's layout chosen by the simulator, and the run's measurements scored against the prediction.

``dtrain plan --config RUN.toml --write BEST.toml`` prices every layout of the run's model and batch on a
topology (:func:`dtrain.sim.planner.plan`), keeps the fastest one that ``dtrain train`` can execute, and writes
the run config with that layout in ``[parallel]`` / ``[training]`` and the prediction in ``[plan]``
(:func:`plan_run`). ``dtrain train --config BEST.toml`` then records the predicted step time and memory beside
the measured ones (:func:`dtrain.train.metrics.plan_score`), so every planned run says how far its plan was off.

How a simulated layout maps onto the run config: dp, tp, pp and the ZeRO stage are the same; a replica's ``m``
micro-batches become the pipeline's micro-batches where pp > 1 and gradient-accumulation steps where pp = 1
(both run ``m`` forward and backward passes of ``micro_batch`` sequences); recomputation ``selective`` and
``full`` become ``[training] activation_checkpointing`` of the same name; a pipeline is priced as
``partition_layers`` cuts it, by equal layer counts and by equal FLOPs (``[parallel] balance``), the faster
written.

A layout is kept only where ``dtrain train`` runs it as it was priced (:func:`refusal`): the config expresses it,
the launching process's checks pass (:func:`dtrain.train.loop.validate_layout`), the ranks can build it
(:class:`~dtrain.parallel.hybrid.HybridParallel` refuses ZeRO-2 with a parameter tied across pipeline stages, as
the embedding and head of a tied model are), and its placement is one ``dtrain train`` makes: it puts global
rank ``r`` on the ``r``-th device, so the ``aware`` placement (:mod:`dtrain.sim.placement`) is its rank order
``tp-pp-dp`` and the ``megatron`` one its ``tp-dp-pp``; the chosen order is written as ``[parallel] rank_order``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dtrain.models.config import GPT2Config
from dtrain.models.flops import parameter_count, shape_dims
from dtrain.train.config import TrainConfig

__all__ = ["RUN_PLACEMENTS", "PlannedRun", "model_spec", "plan_run", "refusal", "run_kernels", "run_shape"]

#: the placements dtrain train's ranks take (global rank r on the r-th device), by its [parallel] rank_order:
#: dtrain.sim.placement's "aware" is tp-pp-dp, its "megatron" tp-dp-pp
RUN_PLACEMENTS = {"aware": "tp-pp-dp", "megatron": "tp-dp-pp"}


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """The run config to execute, the simulator's plan it came from, and how many plans ranked above it could not
    be expressed as a run (``skipped``, with the first reason)."""

    config: TrainConfig
    plan: Any  # dtrain.sim.planner.Plan
    skipped: int
    first_reason: str | None


def run_shape(config: TrainConfig):
    """The model's shape as the run resolves it (the preset's vocabulary grown to the tokenizer's, as training
    does); prepares the default dataset's tokenizer once where the config names no dataset."""
    from dtrain.data.tokenizer import Tokenizer
    from dtrain.train.loop import resolve_data, resolve_model

    _, tokenizer = resolve_data(config)
    return resolve_model(config, Tokenizer.load(tokenizer))


def run_kernels(config: TrainConfig) -> str:
    """The simulator's kernel set (:data:`dtrain.sim.compute.KERNELS`) of a run: ``"dtrain"``, dtrain.models' own
    eager operations, or ``"fused"`` where ``training.compile`` has them fused."""
    return "fused" if config.training.compile else "dtrain"


def model_spec(shape, seq_len: int, name: str = "model"):
    """The simulator's :class:`~dtrain.sim.model.ModelSpec` of a model config (Llama or GPT-2) trained on
    ``seq_len``-token sequences; an untied output layer a matrix of its own, on the stage that runs it."""
    from dtrain.sim.model import ModelSpec

    dim, layers, heads, kv, _, ffn, vocab = shape_dims(shape)
    return ModelSpec(
        name=name,
        parameters=float(parameter_count(shape)),
        layers=layers,
        hidden=dim,
        heads=heads,
        sequence=seq_len,
        vocab=vocab,
        ffn_hidden=ffn,
        kv_heads=kv,
        gated_mlp=not isinstance(shape, GPT2Config),
        tied_embeddings=shape.tie_word_embeddings,
    )


def refusal(run: TrainConfig, shape, placement: str | None = None) -> str | None:
    """Why ``dtrain train`` would not run ``run`` (a config of ``shape``'s model) as the simulator priced it under
    ``placement`` (None: its own rank order's), or None where it would: a placement other than its rank order's,
    a check of the launching process (:func:`~dtrain.train.loop.validate_layout`), or ZeRO-2 across pipeline
    stages of a tied embedding."""
    from dtrain.train.loop import validate_layout

    par = run.parallel
    if placement is not None and RUN_PLACEMENTS.get(placement) != par.rank_order:
        known = ", ".join(f"{how} ({order})" for how, order in RUN_PLACEMENTS.items())
        return f"the {placement} placement: dtrain train places rank r on the r-th device in its rank order: {known}"
    try:  # ZeRO-2 across the stages of a tied embedding among them
        validate_layout(run, par.dp * par.pp * par.tp, shape)
    except ValueError as exc:
        return str(exc)
    return None


def _run_config(config: TrainConfig, layout, plan, topology: str, devices: int) -> TrainConfig:
    """``config`` with ``layout``'s parallel settings and ``plan``'s prediction; ConfigError where the run config
    cannot express it."""
    data = config.to_dict()
    m = layout.microbatches
    pipelined = layout.pp > 1
    data["parallel"] |= {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "zero": layout.zero_stage,
        "zero_shard_size": 0,
        "microbatches": m if pipelined else 1,
        "schedule": layout.schedule if pipelined else "1f1b",
        "balance": layout.balance if pipelined and layout.balance else data["parallel"].get("balance", "layers"),
        "rank_order": RUN_PLACEMENTS.get(plan.placement, data["parallel"].get("rank_order", "tp-pp-dp")),
    }
    data["training"] |= {
        "accumulation": 1 if pipelined else m,
        "activation_checkpointing": layout.recompute,
    }
    data["plan"] = {
        "step_s": plan.result.step_s,
        "memory_gib": plan.result.memory.total / 2**30,
        "tokens_per_s": plan.result.tokens_per_s,
        "topology": topology,
        "devices": devices,
        "layout": f"{layout.describe()} ({plan.placement} placement)",
    }
    return TrainConfig.from_dict(data)


def plan_run(
    config: TrainConfig,
    topology,
    *,
    devices: int,
    shape=None,
    step_config=None,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    placements: Sequence[str] = tuple(RUN_PLACEMENTS),
    recompute: Sequence[str] | None = None,
    max_tp: int | None = None,
    schedules: Sequence[tuple[str, int]] | None = None,
) -> PlannedRun:
    """The fastest simulated layout of ``config``'s model and global batch on ``devices`` devices of
    ``topology`` that ``dtrain train`` runs, as a run config. ``schedules``: the (pipeline schedule, chunks a
    stage) pairs to try (default: every schedule dtrain train runs but GPipe, interleaved 1F1B with its chunks);
    ``step_config`` defaults to the simulator's defaults with the run's own kernels (:func:`run_kernels`).
    ValueError (one line) where no layout fits."""
    from dtrain.sim.model import RECOMPUTE
    from dtrain.sim.planner import plan
    from dtrain.sim.step import StepConfig
    from dtrain.train.loop import INTERLEAVED_CHUNKS

    if step_config is None:
        step_config = StepConfig(kernels=run_kernels(config))

    shape = run_shape(config) if shape is None else shape
    spec = model_spec(shape, config.data.seq_len, name=config.model.preset if not config.model.config else "model")
    plans, dropped = plan(
        spec,
        topology,
        global_batch=config.training.batch_size,
        devices=devices,
        placements=placements,
        config=step_config,
        micro_batches=micro_batches,
        zero_stages=zero_stages,
        max_tp=max_tp,
        recompute=recompute or RECOMPUTE,
        attention="flash",  # dtrain.models' attention is torch's scaled_dot_product_attention
        sequence_parallel=False,  # dtrain's tensor parallelism keeps whole activations outside its regions
        schedules=schedules or (("1f1b", 1), ("interleaved-1f1b", INTERLEAVED_CHUNKS), ("zb-h1", 1), ("zb-v", 2)),
        balances=("layers", "flops"),  # the cuts partition_layers makes of the model's layers
    )
    skipped, reason = 0, None
    for p in plans:
        try:
            run = _run_config(config, p.layout, p, topology.name, devices)
            refused = refusal(run, shape, p.placement)
        except ValueError as exc:  # ConfigError included: a layout the run config cannot express
            refused = str(exc)
        if refused is not None:
            skipped += 1
            reason = reason or f"{p.layout.describe()} ({p.placement}): {refused}"
            continue
        return PlannedRun(config=run, plan=p, skipped=skipped, first_reason=reason)
    why = f"; {len(plans)} fit but none runs (first: {reason})" if plans else f"; {dropped} layouts too big"
    raise ValueError(
        f"--config: no layout of the model trains on {devices} device(s) of {topology.name} with batch "
        f"{config.training.batch_size}{why}"
    )
