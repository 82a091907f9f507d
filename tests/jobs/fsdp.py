"""Jobs for tests/parallel/test_fsdp.py: ZeRO-3 (:class:`~dtrain.parallel.fsdp.FullyShardedDataParallel` through
``HybridParallel(zero_stage=3)``) on the tiny decoders of tests/jobs/parallel.py against one process.

Every rank trains the unsplit model itself as the reference (the whole global batch, plain autograd, AdamW with
a decay and a no-decay group, ``clip_grad_norm_``); the sharded run must give the same losses and gradient
norms, each rank's float32 shard of every parameter must equal its element range of the reference (its
tensor-parallel slice), and the exported whole model must equal the reference's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dtrain.models.config import LlamaConfig
from dtrain.models.decoder import Block, build
from dtrain.parallel.fsdp import hybrid_shard_groups
from dtrain.parallel.grid import ParallelDims
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.parallelize import causal_lm_loss
from dtrain.train.precision import DynamicLossScaler
from tests.jobs import parallel as jobs

KIND = "llama"  # tied embeddings: one parameter shared by the first and last units (or stages)


def train(layout: dict) -> dict | None:
    """``jobs.STEPS`` ZeRO-3 steps with ``layout`` (dp, pp, tp, ``shard_size`` and HybridParallel's keywords),
    clipped at ``jobs.MAX_NORM``; this rank's worst errors against the reference, or None off the grid."""
    layout = dict(layout)
    dp, pp, tp = layout.pop("dp", 1), layout.pop("pp", 1), layout.pop("tp", 1)
    bf16 = layout.pop("bf16", False)  # gathered and computed in bf16 over the float32 shards
    fp16 = layout.pop("fp16", False)  # computed in fp16 (autocast) over float32 parameters, the loss scaled
    compiled = layout.pop("compile", False)  # every block torch.compile'd after sharding, as dtrain train does
    # 16-bit compute: against one process under the same autocast, at a rate ten times the float32 runs' so that
    # each step moves the losses well past their tolerance (``trains``: one that did not train lies outside it);
    # the parameters only within 2 lr a step, AdamW's first steps being about lr x the sign of each gradient,
    # which 16-bit rounding flips where the gradient is near 0
    half = bf16 or fp16
    lr = 10 * jobs.LR if half else jobs.LR
    rtol, atol = (3e-3, 3e-4) if half else (jobs.RTOL, jobs.ATOL)
    shard_rtol, shard_atol = (2e-2, 2 * jobs.STEPS * lr) if half else (rtol, atol)
    grid = jobs._grid(dp, pp, tp)
    shard_size = layout.get("shard_size")
    if grid is None:
        if shard_size is not None:  # group creation is collective over the whole pool
            hybrid_shard_groups(
                ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp), shard_size, range(dp * pp * tp)
            )
        return None
    autocast = torch.bfloat16 if bf16 else torch.float16 if fp16 else False
    ref_losses, ref_norms, ref_state = jobs.reference(KIND, clip=True, autocast=autocast, groups=True, lr=lr)
    untrained = jobs.reference(KIND, clip=True, autocast=autocast, groups=True, lr=0.0)[0]
    if bf16 or fp16:
        layout["autocast_dtype"] = torch.bfloat16 if bf16 else torch.float16
    hybrid = HybridParallel(jobs.model(KIND), grid, functools.partial(jobs._adamw, lr=lr), zero_stage=3, **layout)
    if compiled:
        for module in hybrid.module.modules():
            if isinstance(module, Block):
                # dynamo traces the block and its hooks as in training; aot_eager skips inductor's code generation,
                # which costs a fresh machine 20 s and is not what the sharding's correctness depends on
                module.compile(backend="aot_eager")
    scaler = DynamicLossScaler() if fp16 else None
    loss_fn = causal_lm_loss(grid.tp_group) if tp > 1 else jobs._lm_loss
    losses, norms, skipped = [], [], 0
    for step in range(jobs.STEPS):
        batch = jobs._global_batch(step)
        losses.append(hybrid.train_step(*batch, loss_fn, max_grad_norm=jobs.MAX_NORM, loss_scaler=scaler).item())
        norms.append(hybrid.last_grad_norm)
        skipped += hybrid.step_skipped
    fsdp = hybrid.optimizer
    whole_name = {id(p): name for name, p in hybrid.named_params}
    by_stage_name = dict(hybrid.module.named_parameters())
    shards, held, problems = 0.0, 0, []
    for piece in fsdp.shards():
        param = by_stage_name[piece.name]
        want = jobs.expected_shard(ref_state[whole_name[id(param)]], param, tp, grid.tp_rank)
        if tuple(want.shape) != piece.shape or piece.shard.dtype != torch.float32:
            problems.append(f"{piece.name}: shape {piece.shape}, dtype {piece.shard.dtype}")
        if not 0 <= piece.start <= piece.end <= want.numel() or piece.shard.numel() != piece.end - piece.start:
            problems.append(f"{piece.name}: range [{piece.start}, {piece.end}) of {piece.shard.numel()} elements")
            continue
        held += piece.end - piece.start
        if piece.end > piece.start:  # AdamW's moments over the same elements, in the parameter's group
            shards = max(
                shards, jobs._excess(piece.shard, want.reshape(-1)[piece.start : piece.end], shard_rtol, shard_atol)
            )
            if piece.optimizer_state["exp_avg"].shape != piece.shard.shape:
                problems.append(f"{piece.name}: exp_avg {piece.optimizer_state['exp_avg'].shape}")
            decay = fsdp.param_groups[piece.param_group]["weight_decay"]
            if decay != (jobs.WEIGHT_DECAY if param.dim() > 1 else 0.0):
                problems.append(f"{piece.name}: weight decay {decay}")
    problems += _read_between_steps(hybrid)
    full = hybrid.full_state_dict()
    exported = None
    if full is not None:
        missing = set(ref_state) - set(full)
        exported = max(jobs._excess(full[k], ref_state[k], shard_rtol, shard_atol) for k in full)
        exported = exported if sorted(missing) == jobs._tied_duplicates(KIND) else float("inf")
    return {
        "coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank),
        "loss": jobs._excess(torch.tensor(losses), torch.tensor(ref_losses), rtol, atol),
        "norm": jobs._excess(torch.tensor(norms), torch.tensor(ref_norms), 5 * rtol, atol),
        "param_dtype": {str(p.dtype) for p in hybrid.parameters()},
        "shards": shards,
        "held": held,
        "local_numel": sum(p.numel() for _, p in hybrid.named_params),
        "exported": exported,
        "trains": jobs._excess(torch.tensor(untrained), torch.tensor(ref_losses), rtol, atol) > 0,
        "launches": fsdp.launches,
        "loss_scale": None if scaler is None else scaler.scale,
        "skipped": skipped,
        "problems": problems,
    }


def _read_between_steps(hybrid: HybridParallel) -> list[str]:
    """Between steps every parameter read through the module is its placeholder: its shape, dtype and device, NaN
    everywhere (no freed storage read), writes refused; inside ``gathered()`` each holds its shard group's values."""
    fsdp, problems = hybrid.optimizer, []
    for name, param in hybrid.module.named_parameters():
        if not bool(param.detach().isnan().all()) or param.device != fsdp.device or param.dtype != fsdp.param_dtype:
            problems.append(f"{name}: reads {param.detach().flatten()[:3].tolist()} on {param.device} between steps")
        if param.numel() > 1:
            try:
                with torch.no_grad():
                    param.add_(1.0)
                problems.append(f"{name}: a write between steps was accepted")
            except RuntimeError:
                pass
    whole = fsdp.full_parameters()
    with fsdp.gathered():
        for name, param in hybrid.module.named_parameters():
            if name in whole and not torch.equal(param.detach(), whole[name].to(param.dtype)):
                problems.append(f"{name}: gathered() differs from full_parameters()")
    return problems


def _deep_model(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return build(
        LlamaConfig(
            vocab_size=jobs.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=blocks,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=jobs.SEQ,
            tie_word_embeddings=False,
        )
    )


def memory(dp: int, blocks: int) -> dict | None:
    """One ZeRO-3 step of an untied ``blocks``-block Llama over ``dp`` ranks; its memory report and the model's
    float32 bytes."""
    grid = jobs._grid(dp, 1, 1)
    if grid is None:
        return None
    net = _deep_model(blocks)
    model_nbytes = sum(p.numel() for p in net.parameters()) * 4
    units = [sum(p.numel() for p in layer.parameters()) * 4 for layer in net]
    hybrid = HybridParallel(net, grid, jobs._adamw, zero_stage=3, algorithm="native")
    hybrid.optimizer.reset_peak()
    hybrid.train_step(*jobs._global_batch(0), jobs._lm_loss)
    report = hybrid.optimizer.memory_report()
    # the full buffers' storages, and the distinct storages the parameters read (their one placeholder element)
    resident = sum(flat.full.untyped_storage().nbytes() for flat in hybrid.optimizer.flats)
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in hybrid.parameters()}
    return {
        "report": report,
        "model_nbytes": model_nbytes,
        "units": units,
        "resident_after_step": resident,
        "parameter_storage_nbytes": sum(distinct.values()),
    }


def trainer(config, plan, steps: int) -> dict | None:
    """``steps`` steps of ``dtrain train``'s trainer (its model, data, optimizer and loss from ``config``) on the
    dp grid of ``plan``; the metrics records, the validation loss and the checkpointed model state, or None off
    the grid."""
    from dtrain.train import loop

    grid = jobs._grid(plan.dims.dp, plan.dims.pp, plan.dims.tp)
    if grid is None:
        return None
    run = loop._Trainer(config, plan, grid)
    records = [run.step(step) for step in range(steps)]
    return {"records": records, "eval_loss": run.evaluate(), "model": run.hybrid.full_state_dict()}
