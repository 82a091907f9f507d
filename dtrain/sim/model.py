"""A transformer training job as numbers: its size, its parallel layout, its FLOPs and its memory per device.

FLOPs: a dense decoder of ``P`` parameters trains at ``6 P`` FLOPs a token (forward 2, backward 4; Kaplan et al.
2020, "Scaling Laws for Neural Language Models", section 2.1), plus the attention scores and values, ``12 L h s``
a token over forward and backward (ibid., and Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", appendix, without the LM head's share).

Memory per device, mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", section 3.1): ``2 P`` bytes of 16-bit
weights, ``2 P`` of 16-bit gradients and ``12 P`` of optimizer state (32-bit master weights, momentum and
variance), each cut by ``tp x pp``; ZeRO stage 1 cuts the optimizer state by ``dp``, stage 2 the gradients
too, stage 3 the weights too. Activations of one transformer layer and one micro-batch, in bytes (Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2; ``t`` the tensor-parallel
degree):

- no recomputation: ``s b h (10 + 24 / t + 5 a s / (h t))`` (equation 2; ``s b h (34 + 5 a s / h)`` at
  ``t = 1``), with sequence parallelism ``s b h / t (34 + 5 a s / h)`` (equation 4);
- selective recomputation of the attention core (section 5): ``s b h (10 + 24 / t)``, with sequence
  parallelism ``34 s b h / t``;
- full recomputation: the layer's input only, ``2 s b h`` (section 4.3), ``2 s b h / t`` with sequence
  parallelism (the input kept split along the sequence).

A layout with fused (flash) attention (``Layout.attention``) keeps none of the ``5 a s / h`` terms: the kernel
stores the output and the softmax statistics only (Dao et al. 2022).

FP8 linear layers (``Layout.fp8``, Transformer Engine's ``fp8_autocast``; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning"): each linear layer keeps its input for the weight gradient in 8 bits, not 16, which saves
``s b h`` bytes at the QKV and first MLP products (after their norms), ``s b h / t`` at the attention output's
and ``4 s b h / t`` at the second MLP product's (``7 s b h / t`` in all with sequence parallelism, where every
one is split); and each device holds an 8-bit copy of its weights and of their transpose beside the 16-bit ones
(2 bytes a weight). With 8-bit weights (``Layout.fp8_params``: Transformer Engine's ``fp8_model_init``, the
optimizer writing its 32-bit master weights straight into 8-bit ones) the 16-bit weights are not kept: 2 bytes a
weight in all, the 8-bit weights and their transpose.

With recomputation the backward of one layer of one micro-batch also holds what it recomputes (the whole
layer, or its attention core ``5 a s^2 b / t``) for a moment; that is added once. A 1F1B stage holds at most
``pp`` micro-batches in flight (GPipe holds all ``m``).

Recomputation costs FLOPs (:func:`recompute_flops_per_microbatch`): full recomputation runs each layer's
forward again, ``(2 P + 4 L h s)`` a token, and its two tensor-parallel all-reduces; selective runs the
attention core's forward again, ``4 L h s`` a token (Korthikanti et al. 2022, section 5), no communication.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from dtrain.parallel.pipeline_schedules import PLACEMENT, cut_sizes, stage_of_virtual, zb_v

__all__ = [
    "ATTENTION",
    "BALANCE",
    "MODELS",
    "RECOMPUTE",
    "SCHEDULES",
    "Layout",
    "MemoryUse",
    "ModelSpec",
    "activation_bytes_per_layer",
    "block_flops_weight",
    "chunk_flops",
    "chunk_shares",
    "context_view",
    "head_stage",
    "stage_blocks",
    "flops_per_microbatch",
    "layers_in_flight",
    "memory_per_device",
    "stage_layers",
    "stage_parameters",
    "recompute_flops_per_microbatch",
    "tp_all_reduces_per_layer",
]

#: Activation recomputation of a layout: none, the attention core of each layer, or each layer's whole forward.
RECOMPUTE = ("none", "selective", "full")
#: Pipeline schedules (:mod:`dtrain.parallel.pipeline_schedules`): interleaved 1F1B takes ``chunks`` >= 2 model
#: chunks a stage (Narayanan et al. 2021, section 2.2.2), ZB-V exactly 2 (Qi et al. 2024), the others 1.
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v")
#: The attention core: Megatron-LM's unfused kernels (the ``s x s`` scores kept for backward) or flash attention
#: (Dao et al. 2022: nothing of size ``s x s`` kept; its backward recomputes the scores).
ATTENTION = ("unfused", "flash")
#: How the pipeline cuts the model (:attr:`Layout.balance`): Megatron-LM's even split (None), dtrain's equal layer
#: counts or equal FLOPs.
BALANCE = (None, "layers", "flops")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer: ``parameters`` in all, ``layers`` blocks of width ``hidden`` with ``heads``
    attention heads, trained on sequences of ``sequence`` tokens."""

    name: str = "model"
    parameters: float
    layers: int
    hidden: int
    heads: int
    sequence: int
    bytes_per_value: int = 2  # 16-bit weights, gradients and activations on the wire
    vocab: int = 0  # tokens of the vocabulary; 0: no embedding or logits work is modelled
    ffn_hidden: int = 0  # width of the MLP's inner layer; 0: 4 x hidden
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    gated_mlp: bool = False  # SwiGLU (three MLP matrices) rather than two
    tied_embeddings: bool = True  # the output layer reuses the word embedding; False: its own V x h matrix
    #: this spec's ``sequence`` is one of this many equal shards of each training sequence, a context-parallel
    #: rank's share, whose attention reads every shard's keys (:func:`context_view` makes such specs; 1: whole)
    context_shards: int = 1

    def __post_init__(self) -> None:
        for field_name in ("parameters", "layers", "hidden", "heads", "sequence", "bytes_per_value", "context_shards"):
            value = getattr(self, field_name)
            if not value > 0:
                raise ValueError(f"ModelSpec.{field_name} must be > 0, got {value!r}")
        for field_name in ("vocab", "ffn_hidden", "kv_heads"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelSpec.{field_name} must be an int >= 0, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if not isinstance(self.context_shards, int):
            raise ValueError(f"ModelSpec.context_shards must be a positive int, got {self.context_shards!r}")

    @property
    def keys(self) -> int:
        """Tokens of a whole training sequence, whose keys a query's attention reads: ``sequence`` times
        ``context_shards``."""
        return self.sequence * self.context_shards

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def key_value_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` where it is 0."""
        return self.kv_heads or self.heads

    @property
    def shape_parameters(self) -> float:
        """The parameters the shape holds: each layer's attention (queries and output ``2 h^2``, keys and values
        ``2 h x kv``) and MLP (two or, gated, three ``h x ffn`` matrices), and the embeddings (the vocabulary's
        ``V x h``, twice where untied); norms and biases aside."""
        kv = self.hidden // self.heads * self.key_value_heads
        layer = 2 * self.hidden**2 + 2 * self.hidden * kv + (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return float(self.layers * layer + self.vocab * self.hidden * (1 if self.tied_embeddings else 2))


#: Models people plan for (sizes from the papers that introduced them).
MODELS: dict[str, ModelSpec] = {
    "gpt2-xl": ModelSpec(name="gpt2-xl", parameters=1.5e9, layers=48, hidden=1600, heads=25, sequence=1024),
    "llama-7b": ModelSpec(name="llama-7b", parameters=6.7e9, layers=32, hidden=4096, heads=32, sequence=4096),
    "llama-13b": ModelSpec(name="llama-13b", parameters=13e9, layers=40, hidden=5120, heads=40, sequence=4096),
    "gpt3-175b": ModelSpec(name="gpt3-175b", parameters=175e9, layers=96, hidden=12288, heads=96, sequence=2048),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a step is spread: ``dp x tp x pp`` ranks, ``micro_batch`` sequences a micro-batch and
    ``global_batch`` sequences a step (so ``global_batch / (dp x micro_batch)`` micro-batches a replica);
    ``recompute`` (one of :data:`RECOMPUTE`) and ``sequence_parallel`` (Korthikanti et al. 2022, section 4.2.2:
    the activations outside the tensor-parallel regions split along the sequence; the same communication volume)
    change what each layer keeps for backward; ``fp8``: the linear layers' products run in 8-bit floating point
    (Transformer Engine's FP8 recipe: E4M3 forward, E5M2 gradients, per-tensor scales), their inputs kept in 8 bits
    (module docstring; :func:`dtrain.sim.compute.layer_ops`); ``fp8_params``: the weights themselves kept in 8 bits
    (no 16-bit copy; the data-parallel all-gather of weights moves a byte a weight). ``microbatch_group``:
    interleaved 1F1B's micro-batch group (0: ``pp``;
    :func:`dtrain.parallel.pipeline_schedules.interleaved_one_f_one_b`). ``embedding_layers``: the pipeline split
    counts the input embedding and the output layer as that many transformer layers each, so the first and last
    stages hold that many fewer (DeepSpeed's ``partition_method="type:transformer|embedding"``: BLOOM-176B's 70
    layers and two embeddings on 12 stages are 5, 6 x 10 and 5 layers, BigScience tr11-176B-ml README;
    :func:`stage_layers`). ``cp``: context parallelism, each sequence cut into ``cp`` shards over as many ranks,
    which share every replica's weights (Megatron-Core's ``--context-parallel-size``; Liu et al. 2023, "Ring
    Attention with Blockwise Transformers for Near-Infinite Context"): ``dp x cp x tp x pp`` ranks, the
    gradients reduced and the optimizer's state sharded over the ``dp x cp`` ranks of a stage and tensor-parallel
    rank, each rank's attention reading the keys and values of its whole sequence as they pass round the ``cp``
    ranks (:func:`context_view`; flash attention only, as Transformer Engine's is the kernel that runs it).
    ``balance``: the cut ``dtrain train`` makes (its ``--balance``,
    :func:`dtrain.parallel.pipeline_parallel.partition_layers` over the model's embedding, blocks and head as
    layers, the head costing its ``2 V h`` FLOPs a token): ``"layers"`` (equal layer counts) or ``"flops"`` (equal
    forward FLOPs a stage, its chunks together); None, the default, is Megatron-LM's cut (``L / (p v)`` blocks a
    chunk, the embedding and head beside them), that of the published runs (:func:`stage_blocks`)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    attention: str = "unfused"
    embedding_layers: int = 0
    microbatch_group: int = 0
    fp8: bool = False
    fp8_params: bool = False
    balance: str | None = None

    def __post_init__(self) -> None:
        for field_name in ("dp", "tp", "pp", "cp", "micro_batch", "global_batch"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{field_name} must be a positive int, got {value!r}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of dp x micro_batch = "
                f"{self.dp} x {self.micro_batch}; each replica needs a whole number of micro-batches"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"Layout.chunks must be a positive int, got {self.chunks!r}")
        need = {"interleaved-1f1b": "at least 2", "zb-v": "2"}.get(self.schedule, "1")
        if (
            (need == "1" and self.chunks != 1)
            or (need == "2" and self.chunks != 2)
            or (need != "1" and self.chunks < 2)
        ):
            raise ValueError(
                f"schedule {self.schedule!r} takes chunks = {need} model chunks a stage, got {self.chunks}"
            )
        group = self.microbatch_group
        if not isinstance(group, int) or group < 0:
            raise ValueError(f"Layout.microbatch_group must be an int >= 0, got {group!r}")
        if group and (self.schedule != "interleaved-1f1b" or group % self.pp):
            raise ValueError(
                f"microbatch_group = {group} groups interleaved-1f1b's micro-batches in a multiple of pp={self.pp}; "
                f"schedule is {self.schedule}"
            )
        if self.schedule == "interleaved-1f1b" and self.microbatches % (group or self.pp):
            raise ValueError(
                "interleaved-1f1b takes micro-batches in groups of "
                + (f"microbatch_group={group}" if group else f"pp={self.pp}")
                + f"; {self.microbatches} micro-batches a replica is not a multiple"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if not isinstance(self.embedding_layers, int) or self.embedding_layers < 0:
            raise ValueError(f"Layout.embedding_layers must be an int >= 0, got {self.embedding_layers!r}")
        if self.embedding_layers and self.chunks != 1:
            raise ValueError(f"embedding_layers takes one model chunk a stage, got chunks = {self.chunks}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if not isinstance(self.fp8, bool) or not isinstance(self.fp8_params, bool):
            raise ValueError(f"fp8 and fp8_params must be true or false, got {self.fp8!r} and {self.fp8_params!r}")
        if self.fp8_params and not self.fp8:
            raise ValueError("fp8_params keeps the weights in 8 bits for FP8 linear layers: it needs fp8")
        if self.balance not in BALANCE:
            raise ValueError(f"balance must be one of {', '.join(map(str, BALANCE))}, got {self.balance!r}")
        if self.balance and self.embedding_layers:
            raise ValueError("balance cuts dtrain's layers; embedding_layers is DeepSpeed's cut: one or the other")
        if self.cp > 1 and self.attention != "flash":
            raise ValueError(
                f"cp = {self.cp} runs the attention as flash attention over the ring: it needs attention "
                f"'flash', got {self.attention!r}"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """Micro-batches each replica runs a step (``m``)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def check(self, model: ModelSpec) -> None:
        """Raise ``ValueError`` if the layout cannot cut ``model``: layers over stages, heads over tp ranks."""
        if self.embedding_layers and not model.vocab:
            raise ValueError("embedding_layers counts the embeddings as layers: the model needs a vocabulary")
        if self.embedding_layers and self.pp > 1:
            units = model.layers + 2 * self.embedding_layers
            if units % self.pp or units // self.pp <= self.embedding_layers:
                raise ValueError(
                    f"{model.layers} layers and 2 embeddings of {self.embedding_layers} layers each do not split "
                    f"into pp={self.pp} equal stages with a layer on each"
                )
        elif self.balance is not None:
            units = model.layers + (2 if model.vocab else 0)
            if units < self.pp * self.chunks:
                held = f"{model.layers} blocks" + (", the embedding and the head" if model.vocab else "")
                raise ValueError(
                    f"{held} ({units} layers) do not cut into pp={self.pp} stages of {self.chunks} chunk(s): "
                    f"{self.pp * self.chunks} non-empty ranges"
                )
        elif model.layers % (self.pp * self.chunks):
            raise ValueError(
                f"{model.layers} layers do not split into pp={self.pp} equal stages of {self.chunks} equal chunks"
            )
        if model.heads % self.tp:
            raise ValueError(f"{model.heads} heads do not split over tp={self.tp} ranks")
        if self.cp > 1 and model.sequence % (2 * self.cp):
            raise ValueError(
                f"a sequence of {model.sequence} tokens does not cut into 2 x cp = {2 * self.cp} equal pieces (each "
                f"context-parallel rank takes two, one from each end, to share the causal mask's work evenly)"
            )

    def describe(self) -> str:
        zero = f" zero{self.zero_stage}" if self.zero_stage else ""
        sp = " sp" if self.sequence_parallel else ""
        recompute = f" recompute-{self.recompute}" if self.recompute != "none" else ""
        schedule = (
            "" if self.schedule == "1f1b" else f" {self.schedule}" + (f"x{self.chunks}" if self.chunks > 1 else "")
        )
        if self.microbatch_group:
            schedule += f" group{self.microbatch_group}"
        flash = " flash" if self.attention == "flash" else ""
        flash += (" fp8-params" if self.fp8_params else " fp8") if self.fp8 else ""
        embedding = f" embedding-as-{self.embedding_layers}" if self.embedding_layers else ""
        embedding += f" balance-{self.balance}" if self.balance else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (
            f"dp{self.dp}{cp} tp{self.tp} pp{self.pp}{embedding} mb{self.micro_batch}x{self.microbatches}{schedule}"
            f"{zero}{flash}{sp}{recompute}"
        )


@dataclass(frozen=True, kw_only=True)
class MemoryUse:
    """Bytes one device holds at the peak of a step."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class EagerForm:
    """What the ``"dtrain"`` kernels' layer does with its inputs and grouped-query heads. ``shared_inputs``:
    attention and the MLP cast their 32-bit input to 16 bits once for all their products, and under tensor
    parallelism sum that input's gradient over the group once a part, in 16 bits (dtrain.models' parts:
    ``tensor_parallel_shared_input``); False: each product casts its own input and, column-parallel, sums its own
    input's gradient, in 32 bits. ``repeat_kv``: grouped-query keys and values repeated to every head before the
    attention (``repeat_interleave``, as an SDPA call without ``enable_gqa`` needs them), kept so for backward,
    and their gradients summed back; dtrain.models' attention reads them in place."""

    shared_inputs: bool = True
    repeat_kv: bool = False


#: dtrain.models' layer as it runs.
EAGER = EagerForm()


def head_stage(layout: Layout) -> int:
    """The pipeline stage that runs the output layer (the last chunk): the last stage, or the first under the V
    of ZB-V (:data:`dtrain.parallel.pipeline_schedules.PLACEMENT`)."""
    return stage_of_virtual(layout.pp * layout.chunks - 1, layout.pp, PLACEMENT.get(layout.schedule, "loop"))[0]


def stage_blocks(model: ModelSpec, layout: Layout) -> tuple[int, ...]:
    """Transformer blocks each pipeline stage holds, all its chunks together: ``L / pp`` each for Megatron-LM's cut
    (``layout.balance`` None, embedding layers aside), or the cut ``dtrain train`` makes of its layers (the
    embedding, the ``L`` blocks, the head: :func:`dtrain.parallel.pipeline_schedules.cut_sizes`, as
    :func:`dtrain.parallel.pipeline_parallel.partition_layers` calls it), less the embedding and head."""
    if layout.balance is None or layout.pp == 1:
        return tuple(stage_layers(model, layout, s) for s in range(layout.pp))
    placement = PLACEMENT.get(layout.schedule, "loop")
    blocks = [0] * layout.pp
    for u, held in enumerate(_dtrain_blocks(model, layout.pp, layout.chunks, placement, layout.balance)):
        blocks[stage_of_virtual(u, layout.pp, placement)[0]] += held
    return tuple(blocks)


def chunk_flops(model: ModelSpec, layout: Layout) -> tuple[float, ...] | None:
    """ZB-V's forward FLOPs a token of each virtual stage (model order): its blocks' (:func:`block_flops_weight`)
    and, on the last, the output layer's ``2 V h``: the weights ``dtrain.parallel.PipelineParallel`` builds its
    order with. None for the other schedules."""
    if layout.schedule != "zb-v" or layout.pp == 1:
        return None
    p, v = layout.pp, layout.chunks
    if layout.balance is None:
        blocks = (model.layers // (p * v),) * (p * v)
    else:
        blocks = _dtrain_blocks(model, p, v, "v", layout.balance)
    work = [held * block_flops_weight(model) for held in blocks]
    work[-1] += 2.0 * model.vocab * model.hidden
    return tuple(work)


def chunk_shares(model: ModelSpec, layout: Layout) -> tuple[tuple[float, float], ...] | None:
    """ZB-V's share of each stage's work in each of its two chunks (chunk 0 the V's way down, chunk 1 its way
    back), by forward FLOPs: a chunk's blocks (:func:`block_flops_weight`) and, on the last virtual stage, the
    output layer's ``2 V h`` a token, the weights ``dtrain.parallel.PipelineParallel`` builds its order with. None
    for the other schedules, and where every stage's chunks are alike."""
    work = chunk_flops(model, layout)
    if work is None:
        return None
    p = layout.pp
    shares = []
    for s in range(p):
        pair = (work[s], work[2 * p - 1 - s])  # virtual stages s and 2p - 1 - s
        total = pair[0] + pair[1]
        shares.append((0.5, 0.5) if total <= 0 else (pair[0] / total, pair[1] / total))
    return None if all(pair == (0.5, 0.5) for pair in shares) else tuple(shares)


def block_flops_weight(model: ModelSpec) -> float:
    """Twice a block's matrix weights: its forward FLOPs a token as ``dtrain.parallel.pipeline_parallel.
    forward_flops_weight`` counts them (attention's scores aside)."""
    kv = model.hidden // model.heads * model.key_value_heads
    mlp = (3 if model.gated_mlp else 2) * model.hidden * model.ffn
    return 2.0 * (2 * model.hidden**2 + 2 * model.hidden * kv + mlp)


@functools.lru_cache(maxsize=256)
def zb_v_blocks_in_flight(model: ModelSpec, layout: Layout) -> tuple[int, ...]:
    """Under ZB-V with ``dtrain train``'s cut: each stage's peak of blocks' activations held (micro-batch-blocks),
    from the order ``dtrain train`` runs (:func:`dtrain.parallel.pipeline_schedules.zb_v`, built for its passes'
    FLOPs, ``dtrain.models.flops.pass_flops_per_token``, and each chunk's FLOPs, :func:`chunk_flops`): a chunk's
    blocks held from a micro-batch's forward until its weight-gradient pass. The V's two chunks of a stage are
    unequal under the cut, and its order may hold a pair more than 1F1B's ``2p``; the ``min(p, m)`` stage's worth
    of 1F1B misses both."""
    p, m = layout.pp, layout.microbatches
    blocks = _dtrain_blocks(model, p, 2, "v", layout.balance)
    products = model.layers * block_flops_weight(model) + 2.0 * model.vocab * model.hidden
    attention = 4.0 * model.layers * model.hidden * model.sequence
    costs = (products + attention, products + 2 * attention, products)
    out = []
    for stage in range(p):
        chunk_blocks = {stage_of_virtual(u, p, "v")[1]: blocks[u] for u in range(2 * p)
                        if stage_of_virtual(u, p, "v")[0] == stage}  # fmt: skip
        held = peak = 0
        for action in zb_v(p, m, stage, 2, costs=costs, weights=chunk_flops(model, layout)):
            if action.kind == "F":
                held += chunk_blocks[action.chunk]
            elif action.kind == "W":
                held -= chunk_blocks[action.chunk]
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _dtrain_blocks(model: ModelSpec, p: int, v: int, placement: str, balance: str) -> tuple[int, ...]:
    """The blocks of each virtual stage (model order) in ``dtrain train``'s cut of its layers."""
    head = [2.0 * model.vocab * model.hidden] if model.vocab else []
    costs = [0.0] * bool(model.vocab) + [block_flops_weight(model)] * model.layers + head
    stage_of = [stage_of_virtual(u, p, placement)[0] for u in range(p * v)]
    sizes = cut_sizes(len(costs), p * v, costs if balance == "flops" else None, stage_of)
    blocks = []
    start = 0
    for size in sizes:
        kinds = range(start, start + size)
        blocks.append(sum(1 for i in kinds if not (model.vocab and i in (0, len(costs) - 1))))
        start += size
    return tuple(blocks)


def stage_layers(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Transformer layers pipeline stage ``stage`` holds: ``L / pp``, or with ``layout.embedding_layers = e`` (and a
    vocabulary) ``(L + 2 e) / pp`` less ``e`` on the first and last stages, or with ``layout.balance`` the
    blocks of ``dtrain train``'s cut (:func:`stage_blocks`)."""
    if layout.balance is not None and layout.pp > 1:
        return stage_blocks(model, layout)[stage]
    e = layout.embedding_layers if model.vocab and layout.pp > 1 else 0
    per = (model.layers + 2 * e) // layout.pp
    return per - e if stage in (0, layout.pp - 1) else per


def context_view(model: ModelSpec, layout: Layout) -> tuple[ModelSpec, Layout]:
    """``model`` and ``layout`` as one context-parallel rank sees them, in a layout without context parallelism
    (``layout`` itself where ``cp`` is 1). Each of the ``cp`` ranks of a context-parallel group runs the whole
    pipeline schedule on its shard of every sequence, in step with the others, and shares its replica's weights
    with them; so the simulator prices it as a replica of ``dp x cp`` whose sequences are ``s / cp`` tokens
    long (the model's ``context_shards`` recording the cut: its attention reads the keys of all ``cp`` shards,
    :func:`dtrain.sim.compute.layer_ops`), ``cp`` times as many of them a step. The gradients are then reduced,
    and ZeRO's shards cut, over the ``dp x cp`` ranks, as Megatron-Core does (its data-parallel group "with
    context parallel"); the view's data-parallel rank ``d cp + c`` is replica ``d``'s ``c``-th context-parallel
    rank, the order in which Megatron-Core numbers them (tensor, context, data, pipeline)."""
    if layout.cp == 1:
        return model, layout
    if model.context_shards != 1:
        raise ValueError(f"{model.name} is already one of {model.context_shards} context-parallel shards")
    layout.check(model)
    view_model = replace(model, sequence=model.sequence // layout.cp, context_shards=layout.cp)
    view = replace(layout, dp=layout.dp * layout.cp, cp=1, global_batch=layout.global_batch * layout.cp)
    return view_model, view


def memory_per_device(
    model: ModelSpec, layout: Layout, kernels: str = "fused", *, eager: EagerForm = EAGER
) -> MemoryUse:
    """Peak bytes per device of ``model`` trained with ``layout``: the largest of the first stage's and the last
    stage's (and the second stage's where the embeddings count as layers: it holds more layers than the first),
    see the module docstring for the sources. ``kernels = "dtrain"``: as ``dtrain.models`` holds them under bf16
    autocast (:func:`activation_bytes_per_layer`, 32-bit weights and gradients; ``eager`` as there). With context
    parallelism, a context-parallel rank's (:func:`context_view`): a sequence's ``1 / cp`` of the activations."""
    model, layout = context_view(model, layout)
    first = _stage_memory(model, layout, 0, kernels, eager)
    if layout.pp == 1:
        return first
    if layout.balance is not None:
        stages = [_stage_memory(model, layout, s, kernels, eager) for s in range(layout.pp)]
    else:
        stages = [first, _stage_memory(model, layout, layout.pp - 1, kernels, eager)]
    if layout.embedding_layers and layout.pp > 2:
        stages.append(_stage_memory(model, layout, 1, kernels, eager))
    return max(stages, key=lambda use: use.total)


def stage_parameters(model: ModelSpec, layout: Layout, stage: int) -> float:
    """Parameters pipeline stage ``stage`` holds, before the tensor-parallel split. With a vocabulary the first
    stage holds the embedding and the last one the output matrix (Megatron-LM keeps a copy of the tied embedding
    there, Narayanan et al. 2021), the layers share the rest; without one every stage holds ``P / pp``. With
    ``tied_embeddings`` off, ``parameters`` counts both matrices and a single stage holds both."""
    if not model.vocab:
        return model.parameters / layout.pp
    embedding = model.vocab * model.hidden
    per_layer = max(model.parameters - embedding * (1 if model.tied_embeddings else 2), 0.0) / model.layers
    whole = layout.embedding_layers or layout.balance is not None
    held = per_layer * (stage_layers(model, layout, stage) if whole else model.layers / layout.pp)
    if stage == 0:
        held += embedding
    if stage == head_stage(layout) and (stage != 0 or not model.tied_embeddings):
        held += embedding
    return held


def layers_in_flight(model: ModelSpec, layout: Layout) -> float:
    """Layers' activations the first stage holds at its peak, in micro-batch-layers: GPipe all ``m``
    micro-batches of its ``L / p`` layers; 1F1B, ZB-H1 and ZB-V ``min(p, m)`` (Qi et al. 2024 keep 1F1B's peak);
    interleaved 1F1B ``min(2 (p - 1) + (v - 1) g + 1, m v)`` chunks of ``L / (p v)`` layers (``g`` the micro-batch
    group, ``p`` by default), about ``L (1 + (p - 1) / (p v))`` with ``g = p`` (Narayanan et al. 2021, section
    2.2.2; Korthikanti et al. 2022, section 4.2.3)."""
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    whole = layout.embedding_layers or layout.balance is not None
    per_stage = stage_layers(model, layout, 0) if whole else model.layers / p
    if layout.schedule == "gpipe":
        return m * per_stage
    if layout.schedule == "interleaved-1f1b":
        return min(2 * (p - 1) + (v - 1) * (layout.microbatch_group or p) + 1, m * v) * per_stage / v
    return min(p, m) * per_stage


def _stage_memory(
    model: ModelSpec, layout: Layout, stage: int, kernels: str = "fused", eager: EagerForm = EAGER
) -> MemoryUse:
    shard = stage_parameters(model, layout, stage) / layout.tp
    zero = layout.zero_stage
    dtrain = kernels == "dtrain"  # 32-bit weights and gradients, Adam's two 32-bit moments
    weights = (4 if dtrain else 2) * shard / (layout.dp if zero >= 3 else 1)
    if layout.fp8 and not layout.fp8_params:  # the 8-bit weights and their transpose beside the 16-bit ones
        weights += 2 * shard / (layout.dp if zero >= 3 else 1)
    gradients = (4 if dtrain else 2) * shard / (layout.dp if zero >= 2 else 1)
    optimizer = (8 if dtrain else 12) * shard / (layout.dp if zero >= 1 else 1)
    if layout.schedule == "zb-v" and layout.balance is not None and layout.pp > 1:
        held = zb_v_blocks_in_flight(model, layout)[stage]
    elif stage == 0:
        held = layers_in_flight(model, layout)
    elif layout.embedding_layers or layout.balance is not None:  # a 1F1B stage s holds p - s (m under GPipe)
        waiting = layout.microbatches if layout.schedule == "gpipe" else min(layout.pp - stage, layout.microbatches)
        held = waiting * stage_layers(model, layout, stage)
    else:
        held = min(1, layout.microbatches) * model.layers / layout.pp
    per_layer = activation_bytes_per_layer(model, layout, kernels=kernels, eager=eager)
    activations = per_layer * held
    if layout.recompute != "none":  # what one layer's backward recomputes, held while it runs
        kept = activation_bytes_per_layer(model, layout, "none", kernels, eager=eager)
        activations += kept if layout.recompute == "full" else kept - per_layer
    tokens = layout.micro_batch * model.sequence
    if stage == head_stage(layout) and model.vocab and dtrain:
        # the final norm's 32-bit input and the output layer's 16-bit input and weight (cast for each micro-batch);
        # the loss's backward holds three 32-bit tensors of logits at once: the saved log-probabilities, their
        # gradient (nll_loss_backward's) and the logits' gradient (log-softmax's backward)
        cast = 0 if zero >= 3 else 2 * model.vocab * model.hidden / layout.tp
        activations += 6 * tokens * model.hidden + cast + 12 * tokens * model.vocab / layout.tp
    elif stage == head_stage(layout) and model.vocab:  # the logits (16-bit) and the cross-entropy's 32-bit softmax
        activations += 6 * tokens * model.vocab / layout.tp
    return MemoryUse(weights=weights, gradients=gradients, optimizer=optimizer, activations=activations)


def activation_bytes_per_layer(
    model: ModelSpec, layout: Layout, recompute: str | None = None, kernels: str = "fused", *, eager: EagerForm = EAGER
) -> float:
    """Bytes one transformer layer keeps for backward of one micro-batch on one device, under ``recompute``
    (default: the layout's) and the layout's sequence parallelism (Korthikanti et al. 2022, table 2); with
    ``kernels = "dtrain"``, what ``dtrain.models``' block saves under bf16 autocast (:func:`_dtrain_activations`)."""
    recompute = layout.recompute if recompute is None else recompute
    s, b, h, a, t = model.sequence, layout.micro_batch, model.hidden, model.heads, layout.tp
    if kernels == "dtrain":
        return _dtrain_activations(model, layout, recompute, eager)
    sp = layout.sequence_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention_core = 0.0 if layout.attention == "flash" else 5 * a * s / (h * t)
    outside = 34 / t if sp else 10 + 24 / t  # the norms and dropouts are split over t only with sequence parallelism
    if layout.fp8:  # the linear layers' inputs in 8 bits (module docstring)
        outside -= 7 / t if sp else 2 + 5 / t
    return s * b * h * (outside + (attention_core if recompute == "none" else 0.0))


def _dtrain_activations(model: ModelSpec, layout: Layout, recompute: str, eager: EagerForm = EAGER) -> float:
    """Bytes a ``dtrain.models`` block saves for backward of one micro-batch of ``T`` tokens under bf16 autocast
    with 32-bit weights, as autograd holds them (counted with ``torch.autograd.graph.saved_tensors_hooks``): the
    block's 32-bit input and the stream after attention (the norms' inputs, 4 bytes a value each), the 16-bit
    inputs of the products (attention's and the MLP's, each cast once; or, without ``eager.shared_inputs``, one a
    product, q, k, v, gate and up: 2 bytes a value each), the attention's q, its keys and values (one a key-value
    head: grouped-query attention reads them in place) and output (2 bytes each), the MLP's gate, SiLU, up and
    product outputs (2 bytes each, ``f`` wide), the attention's 32-bit log-sum-exp, and every weight's 16-bit cast
    (2 bytes a weight, each micro-batch its own). Under ZeRO-3 the block runs on gathered 16-bit weights: a 16-bit
    stream, one norm output for q, k and v and one for gate and up, no casts kept. Full recomputation
    (``activation_checkpointing``) keeps the block's input alone. ``eager`` (:class:`EagerForm`): the inputs'
    casts, and the keys and values kept repeated to every head where the attention repeats them."""
    tokens, h, a, t = layout.micro_batch * model.sequence, model.hidden, model.heads, layout.tp
    sixteen = layout.zero_stage >= 3
    if recompute == "full":
        return (2 if sixteen else 4) * tokens * h
    d, f, kv = h // a, model.ffn / t, model.key_value_heads
    query = tokens * a * d / t
    weights = (h * (h + 2 * kv * d) + h * h + (3 if model.gated_mlp else 2) * h * model.ffn) / t
    stream = 2 * (2 if sixteen else 4) * tokens * h
    inputs = (2 if sixteen or eager.shared_inputs else 5 if model.gated_mlp else 4) * 2 * tokens * h
    attention = 2 * 2 * query + 2 * 2 * (query if eager.repeat_kv else tokens * kv * d / t) + 4 * tokens * a / t
    mlp = (4 if model.gated_mlp else 2) * 2 * tokens * f
    return stream + inputs + attention + mlp + (0 if sixteen else 2 * weights)


def tp_all_reduces_per_layer(layout: Layout) -> int:
    """Tensor-parallel all-reduces (or reduce-scatter and all-gather pairs) a layer and micro-batch: two forward,
    two backward, and two more where full recomputation runs the forward again."""
    return 6 if layout.recompute == "full" else 4


def recompute_flops_per_microbatch(model: ModelSpec, layout: Layout) -> float:
    """FLOPs of one micro-batch on one device spent recomputing activations in backward: one more forward
    ``(2 P + 4 L h s)`` a token (full), the attention core's forward ``4 L h s`` a token (selective), or 0."""
    model, layout = context_view(model, layout)
    tokens = layout.micro_batch * model.sequence
    attention = 4 * model.layers * model.hidden * model.keys
    per_token = {"none": 0.0, "selective": attention, "full": 2 * model.parameters + attention}[layout.recompute]
    return per_token * tokens / (layout.tp * layout.pp)


def flops_per_microbatch(model: ModelSpec, layout: Layout) -> float:
    """Training FLOPs (forward and backward) of one micro-batch on one device: ``(6 P + 12 L h s)`` a token,
    shared by the ``tp x pp`` devices of a replica (and its ``cp`` context-parallel ranks: each runs ``s / cp``
    tokens, their attention over all ``s`` keys)."""
    model, layout = context_view(model, layout)
    tokens = layout.micro_batch * model.sequence
    per_token = 6 * model.parameters + 12 * model.layers * model.hidden * model.keys
    return per_token * tokens / (layout.tp * layout.pp)
