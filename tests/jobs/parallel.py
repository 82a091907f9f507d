"""Jobs for tests/parallel/test_parallelize.py and test_hybrid_models.py: the decoders of :mod:`dtrain.models`
split by :func:`~dtrain.parallel.parallelize.tensor_parallelize` and trained by
:class:`~dtrain.parallel.hybrid.HybridParallel`, against the unsplit model on one process.

Every rank builds the same tiny model from a seed and trains an untouched copy itself as the reference: the
whole global batch through the whole model, plain autograd, AdamW (and ``clip_grad_norm_`` where clipping is
tested). Each rank's parameters must equal its slice (tensor parallel, vocabulary padding zero) of its stage's
layers (pipeline) of the reference, whichever replica (data parallel) it is in.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.models import dropout as dropouts
from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import build
from dtrain.parallel import tensor_parallel_communications as tpc
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.parallelize import causal_lm_loss, tensor_parallelize
from dtrain.parallel.recompute import checkpoint_activations
from dtrain.testing.pool import group_of
from tests.jobs import hybrid as hybrid_jobs

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ, GLOBAL_BATCH, STEPS = 97, 8, 8, 3  # 97 does not divide by 2 or 4: the vocabulary is padded
LR, WEIGHT_DECAY, EPS, MAX_NORM = 1e-3, 0.1, 1e-5, 1.0
DROPOUT_SEED = 5
INIT = 0.2  # wide enough that attention is not uniform: no gradient so small that Adam's rescaling amplifies noise


def config(kind: str, vocab: int = VOCAB, init: float = INIT, dropout: float = 0.0):
    """The tiny model's shape; ``dropout``: every dropout probability the model has (Llama: attention's)."""
    if kind == "llama":  # grouped-query attention (4 heads, 2 key-value heads), tied embeddings
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            initializer_range=init,
            attention_dropout=dropout,
        )
    return GPT2Config(
        vocab_size=vocab,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        initializer_range=init,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )


def model(kind: str, vocab: int = VOCAB, init: float = INIT, dropout: float = 0.0) -> nn.Sequential:
    """The tiny model from seed 0. GPT-2's key biases are frozen: their gradient is zero in exact arithmetic (a
    softmax row does not change when all its scores move by q . b_k), so AdamW would turn its rounding noise,
    which differs with the summation order, into steps of the learning rate's size."""
    torch.manual_seed(0)
    net = build(config(kind, vocab, init, dropout))
    for block in list(net)[1:-1]:
        if block.attn.k_proj.bias is not None:
            block.attn.k_proj.bias.requires_grad_(False)
    return net


def _global_batch(step: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, (B, T) next tokens


def _adamw(named: list[tuple[str, nn.Parameter]], groups: bool = True, lr: float = LR) -> torch.optim.Optimizer:
    """AdamW at ``lr``; with ``groups``, no weight decay on 1-d parameters (norms, biases), chosen by dimension.

    ``eps`` 1e-5: a smaller one lets the rounding noise of gradients that nearly cancel (GPT-2's key weights)
    decide AdamW's first steps."""
    if not groups:
        return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=WEIGHT_DECAY, eps=EPS)
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}], lr=lr, eps=EPS
    )


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


_REFERENCES: dict[tuple, tuple[list[float], list[float], dict[str, torch.Tensor]]] = {}


def reference(
    kind: str,
    clip: bool,
    autocast: bool | torch.dtype = False,
    groups: bool = True,
    skip: int | None = None,
    lr: float = LR,
    dropout: float = 0.0,
) -> tuple[list, list, dict]:
    """Losses, gradient norms and final state dict of one process training the whole model on the global batch
    (leaving out step ``skip``) at ``lr``; ``autocast``: under CPU autocast to that dtype (True: bf16);
    ``dropout``: the model's dropout probabilities, each step's masks drawn as step ``step`` of seed
    ``DROPOUT_SEED``."""
    key = (kind, clip, autocast, groups, skip, lr, dropout)
    if key not in _REFERENCES:
        net = model(kind, dropout=dropout)
        opt = _adamw([(n, p) for n, p in net.named_parameters() if p.requires_grad], groups, lr)
        losses, norms = [], []
        for step in (s for s in range(STEPS) if s != skip):
            x, y = _global_batch(step)
            dropouts.set_step(DROPOUT_SEED, step)
            dtype = autocast if isinstance(autocast, torch.dtype) else torch.bfloat16
            with torch.autocast("cpu", dtype=dtype, enabled=autocast is not False):
                loss = _lm_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM if clip else float("inf"))
            opt.step()
            losses.append(loss.item())
            norms.append(norm.item())
        dropouts.untracked()
        _REFERENCES[key] = (losses, norms, {k: v.detach().clone() for k, v in net.state_dict().items()})
    return _REFERENCES[key]


_GRIDS: dict[tuple, RankGrid | None] = {}  # building groups is collective: once per layout per pool


def _grid(dp: int, pp: int, tp: int, order: str = "tp-pp-dp") -> RankGrid | None:
    key = (dp, pp, tp) if order == "tp-pp-dp" else (dp, pp, tp, order)
    shared = {dims: name for name, dims in hybrid_jobs.LAYOUTS.items()}
    if key in shared:  # the grids of tests/jobs/hybrid.py, built once for both
        return hybrid_jobs._grid(shared[key])
    if key not in _GRIDS:
        dims = ParallelDims(world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, order=order)
        _GRIDS[key] = RankGrid.build(dims, range(dims.world_size))
    return _GRIDS[key]


def _excess(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> float:
    """How far ``got`` lies beyond rtol, atol of ``want`` (0 within it; inf on a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    return max(((got.double() - want.double()).abs() - (atol + rtol * want.double().abs())).max().item(), 0.0)


def expected_shard(full: torch.Tensor, param: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's slice of the single-device tensor ``full`` as ``param`` holds it: split along
    ``tensor_parallel_dim`` after zero padding to the padded size, or whole."""
    dim = getattr(param, "tensor_parallel_dim", None)
    if dim is None:
        return full
    padded = param.shape[dim] * tp
    if padded > full.shape[dim]:
        pad = list(full.shape)
        pad[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    return full.chunk(tp, dim)[tp_rank]


def train(kind: str, layout: dict) -> dict | None:
    """Train ``STEPS`` steps with ``layout`` (dp, pp, tp, HybridParallel's keywords, and ``clip``: clip at
    ``MAX_NORM``; ``autocast``: bf16; ``local``: each replica handed its own rows; ``scaler``: a loss scale, step 1's
    loss infinite); this rank's worst loss, parameter and gradient-norm errors against the reference, or None off
    the grid."""
    layout = dict(layout)
    dp, pp, tp = layout.pop("dp", 1), layout.pop("pp", 1), layout.pop("tp", 1)
    clip, autocast = layout.pop("clip", False), layout.pop("autocast", False)
    local = layout.pop("local", False)  # hand each replica its own rows
    dropout = layout.pop("dropout", 0.0)  # every dropout of the model at this probability
    recompute = layout.pop("recompute", None)  # checkpoint_activations' mode and keywords
    if "reduce_dtype" in layout:
        layout["reduce_dtype"] = getattr(torch, layout["reduce_dtype"])
    grid = _grid(dp, pp, tp)
    if grid is None:
        return None
    scaler = _LossScaler() if layout.pop("scaler", False) else None
    overflow = 1 if scaler is not None else None  # the step whose loss is made infinite
    groups = not layout.get("zero_stage")  # ZeRO: one parameter group
    ref_losses, ref_norms, ref_state = reference(kind, clip, autocast, groups, overflow, dropout=dropout)
    net = model(kind, dropout=dropout)
    if recompute is not None:
        checkpoint_activations(net, recompute[0], **recompute[1])
    hybrid = HybridParallel(
        net,
        grid,
        lambda named: _adamw(named, groups),
        autocast_dtype=torch.bfloat16 if autocast else None,
        **layout,
    )
    loss_fn = causal_lm_loss(grid.tp_group) if tp > 1 else _lm_loss
    losses, norms, skipped = [], [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        if local:
            x, y = x.chunk(dp)[grid.dp_rank], y.chunk(dp)[grid.dp_rank]
        fn = (lambda o, t: loss_fn(o, t) * float("inf")) if step == overflow else loss_fn
        dropouts.set_step(DROPOUT_SEED, step)
        try:
            loss = hybrid.train_step(
                x, y, fn, max_grad_norm=MAX_NORM if clip else None, loss_scaler=scaler, local=local
            )
        finally:
            dropouts.untracked()
        loss = loss.item()
        skipped.append(hybrid.step_skipped)
        if step != overflow:
            losses.append(loss)
            norms.append(hybrid.last_grad_norm)
        elif math.isfinite(hybrid.last_grad_norm):
            norms.append(hybrid.last_grad_norm)  # an overflow that the norm missed: fails the comparison
    rtol, atol = (1e-3, 1e-4) if autocast else (RTOL, ATOL)
    params = 0.0
    # ZeRO-3's parameters hold no storage between steps: its gathered state dict (exported) is compared instead
    for name, param in hybrid.named_params if layout.get("zero_stage") != 3 else ():
        want = expected_shard(ref_state[name], param, tp, grid.tp_rank)
        params = max(params, _excess(param.detach(), want, rtol, atol))
    full = hybrid.full_state_dict()
    exported = None
    if full is not None:
        want = {k: v for k, v in ref_state.items() if k in full}
        missing = set(ref_state) - set(full)
        exported = max((_excess(full[k], want[k], rtol, atol) for k in want), default=0.0)
        exported = exported if sorted(missing) == _tied_duplicates(kind) else float("inf")
    start = model(kind).state_dict()
    moved = max((ref_state[k] - start[k]).abs().max().item() for k in start)
    return {
        "coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank),
        "loss": _excess(torch.tensor(losses), torch.tensor(ref_losses), rtol, atol),
        "norm": _excess(torch.tensor(norms), torch.tensor(ref_norms), rtol, atol),
        "norms": norms,
        "skipped": skipped,
        "scaler_updates": scaler.updates if scaler is not None else None,
        "params": params,
        "param_count": len(hybrid.named_params),
        "exported": exported,
        "moved": moved,
        # weight gradients the pipeline's gradient-accumulation fusion added in place (None without it)
        "fused": getattr(getattr(hybrid.pipeline, "fused_accumulation", None), "fused", None),
    }


class _LossScaler:
    """A fixed fp16 loss scale (a power of two, so scaling is exact) that records its updates."""

    scale = 2.0**10

    def __init__(self) -> None:
        self.updates: list[bool] = []

    def update(self, found_inf: bool) -> None:
        self.updates.append(found_inf)


def _tied_duplicates(kind: str) -> list[str]:
    """State-dict keys of a tied weight's second name (the head's), which the export leaves out."""
    net = model(kind)
    return [f"{len(net) - 1}.lm_head.weight"] if net.tied else []


def layouts(kind: str, names: list[str], table: dict[str, dict]) -> dict[str, dict | None]:
    """:func:`train` for each named layout of ``table`` in turn (every process of the pool runs them all)."""
    return {name: train(kind, table[name]) for name in names}


def _compare(problems: list[str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        problems.append(f"{name}: max abs error {(got - want).abs().max().item():.3g}")


def model_equivalence(kind: str, tp: int, vocab: int, loss_parallel: bool) -> list[str]:
    """A whole model and its tensor-parallel twin over the first ``tp`` ranks, forward and backward: logits (the
    slice with padding at -inf, or gathered), loss, and every parameter's gradient against this rank's slice of
    the reference's; padding rows get no gradient; the tied table stays one Parameter."""
    group = group_of(tp)
    rank = dist.get_rank(group)
    full = model(kind, vocab, init=0.02)  # Hugging Face's initialisation: logits of order 1
    parallel = tensor_parallelize(copy.deepcopy(full), group, loss_parallel=loss_parallel)
    x, y = _global_batch(0, vocab)
    logits = full(x)
    loss = _lm_loss(logits, y)
    loss.backward()
    tp_logits = parallel(x)
    tp_loss = causal_lm_loss(group)(tp_logits, y) if loss_parallel else _lm_loss(tp_logits, y)
    reductions = []
    unpatched = tpc.all_reduce
    tpc.all_reduce = lambda t, *a, **k: reductions.append(tuple(t.shape)) or unpatched(t, *a, **k)
    try:
        tp_loss.backward()
    finally:
        tpc.all_reduce = unpatched
    problems: list[str] = []
    # one all-reduce of the summed input gradient for q, k and v, one for the MLP's input, one for the head's
    blocks = len(parallel) - 2
    if len(reductions) != 2 * blocks + 1:
        problems.append(f"backward all-reduces {len(reductions)}, expected {2 * blocks + 1}: {reductions}")
    if loss_parallel:
        rows = tp_logits.shape[-1]
        real = max(0, min(rows, vocab - rank * rows))
        _compare(problems, "logits slice", tp_logits[..., :real], logits[..., rank * rows : rank * rows + real])
        if not torch.isneginf(tp_logits[..., real:]).all():
            problems.append("padding logits are not -inf")
    else:
        _compare(problems, "logits", tp_logits, logits)
    _compare(problems, "loss", tp_loss, loss)
    want = dict(full.named_parameters(remove_duplicate=False))
    for name, param in parallel.named_parameters(remove_duplicate=False):
        if not param.requires_grad:  # a frozen part stays frozen
            if want[name].requires_grad or param.grad is not None:
                problems.append(f"{name}: requires_grad {param.requires_grad}, expected {want[name].requires_grad}")
            continue
        _compare(problems, f"{name} grad", param.grad, expected_shard(want[name].grad, param, tp, rank))
    if parallel.tied != full.tied:
        problems.append(f"tied is {parallel.tied}, expected {full.tied}")
    heads = [(b.attn.n_heads, b.attn.n_kv_heads) for b in list(parallel)[1:-1]]
    config_heads = (full[1].attn.n_heads // tp, full[1].attn.n_kv_heads // tp)
    if any(h != config_heads for h in heads):
        problems.append(f"local head counts {heads}, expected {config_heads}")
    return problems


def refused(kind: str, tp: int) -> str:
    """The message of the ValueError that splitting ``kind`` over the first ``tp`` ranks raises ('' if none)."""
    try:
        tensor_parallelize(model(kind), group_of(tp))
    except ValueError as e:
        return str(e)
    return ""


def stage_link_dtypes() -> list[str]:
    """Stage 0 sends a bf16 activation, stage 1 an fp16 gradient back: each arrives in the dtype it was sent."""
    from dtrain.parallel.pipeline_parallel_communications import StageLink
    from dtrain.parallel.pipeline_schedules import Timeline, one_f_one_b

    group = group_of(2)
    stage = dist.get_rank(group)
    link = StageLink(group, stage, 2)
    link.plan([one_f_one_b(2, 1, s) for s in range(2)])  # one micro-batch: F0 then B0 on each stage
    link.begin_step(Timeline(stage=stage, num_stages=2, num_microbatches=1))
    activation = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    grad = torch.linspace(-1, 1, 6).view(2, 3).to(torch.float16)
    problems = []
    if stage == 0:
        link.send_forward(activation, 0)
        got, want = link.recv_backward(0), grad
    else:
        got, want = link.recv_forward(0), activation
        link.send_backward(grad, 0)
    link.wait_sends()
    link.begin_step(None)
    if got.dtype != want.dtype or not torch.equal(got, want):
        problems.append(f"stage {stage} received {got.dtype} {got.tolist()}, expected {want.dtype} {want.tolist()}")
    return problems


def tied_after_split() -> bool:
    """Whether the split Llama's head weight is its embedding shard (one Parameter), marked as split on dim 0."""
    net = tensor_parallelize(model("llama"), group_of(2))
    weight = net[0].embed_tokens.weight
    return net[-1].lm_head.weight is weight and weight.tensor_parallel_dim == 0 and net.tied


def evaluate_between_steps(kind: str, names: list[str], table: dict[str, dict], rows: int) -> dict[str, dict | None]:
    """Each named layout of ``table``: before every training step and after the last, :meth:`HybridParallel.evaluate`
    on the first ``rows`` rows of the step's global batch (a batch of another size than training's), against one
    process's loss on those rows at that point; then the training losses and parameters against the reference.
    A layout's ``dropout`` gives the model's dropouts that probability: the reference evaluates in eval mode, and
    the models stay in training mode throughout."""
    out: dict[str, dict | None] = {}
    for name in names:
        layout = dict(table[name])
        dp, pp, tp = layout.pop("dp", 1), layout.pop("pp", 1), layout.pop("tp", 1)
        dropout = layout.pop("dropout", 0.0)
        grid = _grid(dp, pp, tp)
        if grid is None:
            out[name] = None
            continue
        hybrid = HybridParallel(model(kind, dropout=dropout), grid, _adamw, **layout)
        loss_fn = causal_lm_loss(grid.tp_group) if tp > 1 else _lm_loss
        ref = model(kind, dropout=dropout)
        ref_opt = _adamw([(n, p) for n, p in ref.named_parameters() if p.requires_grad])
        evals, ref_evals, losses, ref_losses = [], [], [], []
        for step in range(STEPS + 1):
            x, y = _global_batch(min(step, STEPS - 1))
            dropouts.set_step(DROPOUT_SEED, step)
            try:
                evals.append(hybrid.evaluate(x[:rows], y[:rows], loss_fn).item())
                with torch.no_grad():
                    ref_evals.append(_lm_loss(ref.eval()(x[:rows]), y[:rows]).item())
                ref.train()
                if step == STEPS:
                    break
                losses.append(hybrid.train_step(x, y, loss_fn).item())
                loss = _lm_loss(ref(x), y)
            finally:
                dropouts.untracked()
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        want = ref.state_dict()
        params = max(_excess(p.detach(), expected_shard(want[n], p, tp, grid.tp_rank)) for n, p in hybrid.named_params)
        out[name] = {
            "evals": _excess(torch.tensor(evals), torch.tensor(ref_evals)),
            "loss": _excess(torch.tensor(losses), torch.tensor(ref_losses)),
            "params": params,
            "moved": max((want[k] - v).abs().max().item() for k, v in model(kind).state_dict().items()),
        }
    return out
