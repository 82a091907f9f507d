"""The training state of a :class:`~dtrain.parallel.hybrid.HybridParallel` as a sharded state dict in canonical
names, for ``torch.distributed.checkpoint`` (DCP) to save at one layout and load at any other.

Canonical names are the parameter names of the unparallelized model (``"1.attn.q_proj.weight"``), whatever the
data (dp), tensor (tp) and pipeline (pp) degrees and the ZeRO stage. The state dict is nested as

- ``"model"``: ``{name: ShardedTensor}``, the full tensor of every parameter;
- ``"optim"``: ``{name: {"exp_avg": ShardedTensor, "exp_avg_sq": ShardedTensor, "step": tensor}}``, the
  optimizer's per-element state of the parameter sharded as the parameter is, its scalars (AdamW's step) plain.

Each rank contributes only the pieces it owns, as the local shards of a ``ShardedTensor`` whose
``ShardMetadata`` places them in the full tensor (DCP's resharding: a load reads, from the chunks written at
any layout, exactly the rectangles each rank asks for, Wang et al. 2024, "TorchTitan", section 3.2):

- a tensor-parallel shard (a parameter carrying ``tensor_parallel_dim``) sits at ``tp_rank`` times its size
  along that dim; a vocabulary-parallel table's padding rows (past the real vocabulary) are not written;
- a pipeline stage holds only its layers' parameters; a parameter tied across stages (the embedding and the LM
  head) is written once, by the stage of its first layer, under its first name, and read by every stage;
- ZeRO keeps the optimizer state of a flat range ``[start, stop)`` of each parameter on each dp rank; a flat
  range of a row-major tensor is up to ``2 (ndim - 1) + 1`` rectangles (:func:`flat_range_boxes`; for a matrix a
  partial first row, whole rows, a partial last row), each contiguous in the flat buffer, so each is a local
  shard that is a view of the optimizer's own storage;
- replicated pieces (over dp without ZeRO, over tp for unsplit parameters) are written by one rank only.

Loading fills the same views in place, so a loaded state is in the model and the optimizer at once.

Pieces come from *sources*: functions from a ``HybridParallel`` to a list of :class:`Piece`, a flat range of one
parameter (in this rank's tensor of it) with the 1-D views of every value kept for that range. :data:`SOURCES`
lists them; a sharded-parameter wrapper (ZeRO-3, where the parameters themselves are flat ranges) adds its own
source for ``"model"`` values and the ones of its optimizer, with ``write=True`` on every dp rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.values import all_gather_json

__all__ = [
    "SOURCES",
    "Piece",
    "Placement",
    "canonical_names",
    "flat_range_boxes",
    "init_optimizer_state",
    "placements",
    "sharded_state_dict",
]


@dataclass(frozen=True)
class Placement:
    """Where this rank's tensor of a parameter (``local_shape``) lies in the full one (``full_shape``): at
    ``offset`` along the tensor-parallel ``dim`` (None: the whole tensor). Elements past the full extent (the
    padding of a vocabulary-parallel table) belong to no canonical tensor."""

    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int | None = None
    offset: int = 0


@dataclass
class Piece:
    """Elements ``[start, stop)`` of parameter ``name`` (canonical) in the row-major order of this rank's tensor
    of it. ``values`` maps a state-dict path (``("model",)``, ``("optim", "exp_avg")``, ...) to a 1-D view of
    ``stop - start`` elements; ``scalars`` maps a path to a 0-d tensor (an optimizer's step) kept as it is.
    ``write``: this rank writes the piece (one rank among those holding the same elements)."""

    name: str
    start: int
    stop: int
    values: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    scalars: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    write: bool = True


def flat_range_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as rectangles, in flat order:
    ``(flat start, offsets, sizes)`` each, every one contiguous in the flat order."""
    if not 0 <= start <= stop <= _numel(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {tuple(shape)}")
    if start == stop:
        return []
    if len(shape) == 0:
        return [(0, (), ())]
    if len(shape) == 1:
        return [(start, (start,), (stop - start,))]
    row = _numel(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # inside one row: that row's range, one step down
        return [
            (flat + first * row, (first, *offsets), (1, *sizes))
            for flat, offsets, sizes in flat_range_boxes(shape[1:], start - first * row, stop - first * row)
        ]
    boxes = []
    whole_from, whole_to = first, last + 1
    if start % row:
        boxes += flat_range_boxes(shape, start, (first + 1) * row)
        whole_from = first + 1
    if stop % row:
        whole_to = last
    if whole_to > whole_from:
        boxes.append((whole_from * row, (whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if stop % row:
        boxes += flat_range_boxes(shape, last * row, stop)
    return boxes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _names(value: object) -> list[str]:
    """A rank's list of parameter names, as :func:`canonical_names` gathers them."""
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"a list of parameter names, not {value!r}"[:200])
    return value


def canonical_names(hybrid) -> dict[str, str]:
    """This rank's parameter and buffer names -> their canonical names (a tied weight's second name -> its first).

    Collective over the stages sharing a tied parameter (every rank of the grid calls it)."""
    export = hybrid._export
    local = hybrid._local_state
    by_id: dict[int, list[str]] = {}
    for name, t in local.items():
        by_id.setdefault(id(t), []).append(name)
    names = {}
    for group in by_id.values():
        known = [n for n in group if n in export]
        if known:
            for n in group:
                names[n] = known[0]
    for param, group, _ in hybrid._tied:  # copies whose first name lives on another stage
        mine = [n for n in by_id.get(id(param), []) if n in export]
        gathered = all_gather_json(mine, _names, group=group)
        first = sorted((n for got in gathered for n in got), key=_layer_of)
        if not first:
            raise ValueError("canonical_names: a tied parameter has no stage holding its first name")
        for n in by_id.get(id(param), []):
            names[n] = first[0]
    missing = sorted(set(local) - set(names))
    if missing:
        raise ValueError(f"canonical_names: {missing[0]!r} is not a parameter of the unparallelized model")
    return names


def placements(hybrid, names: dict[str, str]) -> dict[str, Placement]:
    """Canonical name -> :class:`Placement` of this rank's tensor of it."""
    out = {}
    tp, tp_rank = hybrid.grid.dims.tp, hybrid.grid.tp_rank
    for local, canonical in names.items():
        t = hybrid._local_state[local]
        full = tuple(hybrid._export[canonical][0])
        dim = getattr(t, "tensor_parallel_dim", None) if tp > 1 else None
        offset = tp_rank * t.shape[dim] if dim is not None else 0
        out[canonical] = Placement(full_shape=full, local_shape=tuple(t.shape), dim=dim, offset=offset)
    return out


def _is_unsplit(hybrid, tensor: torch.Tensor) -> bool:
    return hybrid.grid.dims.tp == 1 or getattr(tensor, "tensor_parallel_dim", None) is None


def model_pieces(hybrid, names: dict[str, str]) -> list[Piece]:
    """Every parameter this rank holds, whole: written by dp rank 0, tp rank 0 for an unsplit parameter, and the
    stage of a tied parameter's first name."""
    grid = hybrid.grid
    pieces, seen = [], set()
    for local, t in hybrid._local_state.items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        canonical = names[local]
        owner = local == canonical or canonical in hybrid._local_state
        write = grid.dp_rank == 0 and (grid.tp_rank == 0 or not _is_unsplit(hybrid, t)) and owner
        view = t.detach().view(-1)
        pieces.append(Piece(canonical, 0, view.numel(), {("model",): view}, write=write))
    return pieces


def _state_values(state: dict[str, Any], numel: int, where: str) -> tuple[dict, dict]:
    values, scalars = {}, {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: optimizer state {key!r} is a {type(value).__name__}, not a tensor")
        if value.dim() == 0:
            scalars[("optim", key)] = value
        elif value.numel() == numel:
            values[("optim", key)] = value.view(-1)
        else:
            raise ValueError(f"{where}: optimizer state {key!r} of shape {tuple(value.shape)} is not per element")
    return values, scalars


def optimizer_pieces(hybrid, names: dict[str, str]) -> list[Piece]:
    """The optimizer's per-element state of every parameter this rank steps: the whole parameter (plain
    optimizer, written by dp rank 0) or its ZeRO flat ranges (every dp rank writes its own)."""
    from dtrain.parallel.zero import ZeroOptimizer

    grid, opt = hybrid.grid, hybrid.optimizer
    canonical_of = {id(t): names[n] for n, t in hybrid._local_state.items()}
    pieces = []
    if isinstance(opt, ZeroOptimizer):
        for param, piece, _ in opt.pieces:
            canonical = canonical_of[id(param)]
            start = (piece.data_ptr() - param.data_ptr()) // piece.element_size()
            values, scalars = _state_values(opt.optimizer.state.get(piece, {}), piece.numel(), canonical)
            owner = canonical in hybrid._local_state
            write = (grid.tp_rank == 0 or not _is_unsplit(hybrid, param)) and owner
            pieces.append(Piece(canonical, start, start + piece.numel(), values, scalars, write=write))
        return pieces
    for group in opt.param_groups:
        for param in group["params"]:
            canonical = canonical_of[id(param)]
            values, scalars = _state_values(opt.state.get(param, {}), param.numel(), canonical)
            owner = canonical in hybrid._local_state
            write = grid.dp_rank == 0 and (grid.tp_rank == 0 or not _is_unsplit(hybrid, param)) and owner
            pieces.append(Piece(canonical, 0, param.numel(), values, scalars, write=write))
    return pieces


def fully_sharded_pieces(hybrid, names: dict[str, str], *, optimizer: bool = True) -> list[Piece]:
    """ZeRO-3 (:class:`~dtrain.parallel.fsdp.FullyShardedDataParallel`): the flat range of every parameter this
    rank's float32 shard holds, with the optimizer state of the same range; every dp rank writes its own (under
    hybrid sharding, the ranks of the first replica). Tensors outside the shards (buffers) come whole, as
    :func:`model_pieces` gives them."""
    grid, fsdp = hybrid.grid, hybrid.optimizer
    canonical_of = {id(t): names[n] for n, t in hybrid._local_state.items()}
    first_replica = fsdp.replicate_group is None or dist.get_rank(fsdp.replicate_group) == 0
    pieces, sharded = [], set()
    for flat in fsdp.flats:
        for param in flat.params:
            sharded.add(id(param))
            _, start, stop, piece = fsdp._piece_of[id(param)]
            if piece is None:
                continue
            canonical = canonical_of[id(param)]
            values, scalars = {("model",): piece.data.view(-1)}, {}
            if optimizer:
                state, scalars = _state_values(fsdp.optimizer.state.get(piece, {}), piece.numel(), canonical)
                values.update(state)
            owner = canonical in hybrid._local_state
            write = first_replica and (grid.tp_rank == 0 or not _is_unsplit(hybrid, param)) and owner
            pieces.append(Piece(canonical, start, stop, values, scalars, write=write))
    unsharded = {names[n] for n, t in hybrid._local_state.items() if id(t) not in sharded}
    return pieces + [p for p in model_pieces(hybrid, names) if p.name in unsharded]


def _sources(hybrid, optimizer: bool) -> list[Callable[[Any, dict[str, str]], list[Piece]]]:
    if hybrid.zero_stage == 3:
        return [lambda h, names: fully_sharded_pieces(h, names, optimizer=optimizer)]
    return SOURCES if optimizer else [model_pieces]


#: the sources of a HybridParallel's pieces: (hybrid, canonical names) -> pieces
SOURCES: list[Callable[[Any, dict[str, str]], list[Piece]]] = [model_pieces, optimizer_pieces]


@torch.no_grad()
def init_optimizer_state(hybrid) -> None:
    """Create the optimizer's state where it does not exist yet (torch builds it at the first step), so that a
    load has tensors to fill: one step of the parameters without state alone (their param groups narrowed for the
    call), on zero gradients at learning rate 0 (as ``torch.distributed.checkpoint.state_dict`` does), then every
    tensor of their new state set to 0: the step count, and buffers such as SGD's momentum, which weight decay
    would have started at ``wd * p``. A state so made steps as no state does (Adam's and AdamW's exactly). The
    parameters already stepped keep their state untouched (a parameter no step has had a gradient for has none),
    and no parameter moves."""
    from dtrain.parallel.fsdp import FullyShardedDataParallel
    from dtrain.parallel.zero import ZeroOptimizer

    opt = hybrid.optimizer
    inner = opt.optimizer if isinstance(opt, ZeroOptimizer | FullyShardedDataParallel) else opt
    fresh = [p for g in inner.param_groups for p in g["params"] if not inner.state.get(p)]
    if not fresh:
        return
    keep = {id(p) for p in fresh}
    groups = inner.param_groups
    saved = [(g["params"], g["lr"]) for g in groups]
    grads = [(p, p.grad) for p in fresh]
    try:
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in fresh:
            p.grad = torch.zeros_like(p)
        type(inner).step(inner)  # the class's own step: DataParallel.overlap_optimizer replaces the instance's
    finally:
        for g, (params, lr) in zip(groups, saved, strict=True):
            g["params"], g["lr"] = params, lr
        for p, grad in grads:
            p.grad = grad
    for p in fresh:
        for value in inner.state[p].values():
            if isinstance(value, torch.Tensor):
                value.zero_()


def sharded_state_dict(hybrid, *, process_group=None, for_load: bool = False, optimizer: bool = True) -> dict:
    """``{"model": {name: ShardedTensor}, "optim": {name: {key: ShardedTensor or 0-d tensor}}}`` of this rank's
    pieces (module docstring). For saving (default) only the pieces this rank writes; ``for_load``: every piece
    it holds, views that ``dcp.load`` fills in place. ``process_group``: the group DCP saves or loads over
    (default: the world). Collective over tied stages (:func:`canonical_names`)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    names = canonical_names(hybrid)
    where = placements(hybrid, names)
    if optimizer:
        init_optimizer_state(hybrid)
    sources = _sources(hybrid, optimizer)
    pieces = [p for source in sources for p in source(hybrid, names)]
    me = dist.get_rank()
    shards: dict[tuple[str, ...], list] = {}
    state: dict[str, Any] = {}
    for piece in pieces:
        if not (piece.write or for_load):
            continue
        place = where[piece.name]
        for path, scalar in piece.scalars.items():
            _put(state, (path[0], piece.name, *path[1:]), scalar)
        for flat, offsets, sizes in flat_range_boxes(place.local_shape, piece.start, piece.stop):
            offsets, sizes = list(offsets), list(sizes)
            if place.dim is not None:  # the tp offset; padding past the full extent is no one's
                d = place.dim
                keep = max(0, min(sizes[d], place.full_shape[d] - place.offset - offsets[d]))
                if keep == 0:
                    continue
                if keep < sizes[d] and any(s > 1 for s in sizes[:d]):
                    raise ValueError(f"{piece.name}: padding along dim {d} cuts a rectangle in the middle")
                sizes[d] = keep
                offsets[d] += place.offset
            count = _numel(tuple(sizes))
            for path, view in piece.values.items():
                start = flat - piece.start
                # the kept part of a box is a prefix of it in flat order (clipping cuts trailing rows)
                tensor = view[start : start + count].view(sizes)
                meta = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{me}/{tensor.device}")
                shards.setdefault((path[0], piece.name, *path[1:]), []).append(Shard(tensor, meta))
    for key, local in shards.items():
        first = local[0].tensor
        full = where[key[1]].full_shape
        props = TensorProperties(dtype=first.dtype, layout=torch.strided, requires_grad=False)
        shards_meta = [s.metadata for s in local]
        meta = ShardedTensorMetadata(shards_meta, torch.Size(full), props)
        _put(state, key, _sharded_tensor(local, meta, process_group))
    return state


def _sharded_tensor(local: list, meta, process_group):
    """A ShardedTensor of this rank's ``local`` shards, ``meta`` listing only them: torch's constructors check
    that the listed shards cover the tensor, which only all ranks' pieces together do (DCP gathers those)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    props = meta.tensor_properties
    st = ShardedTensor.__new__(
        ShardedTensor,
        _LocalPieces(meta.shards_metadata),
        *meta.size,
        dtype=props.dtype,
        layout=props.layout,
        pin_memory=props.pin_memory,
        requires_grad=props.requires_grad,
    )
    st._local_shards = local
    st._prepare_init(process_group=process_group, init_rrefs=False)
    st._post_init()
    return st


def _local_pieces_spec():
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata
    from torch.distributed._shard.sharding_spec import ShardingSpec

    class LocalPieces(ShardingSpec):
        """The sharding of a tensor of which this rank knows only its own pieces: DCP reads nothing else (it
        gathers every rank's pieces into the checkpoint's metadata itself), so the pieces need not cover the
        tensor, which torch's own specs check."""

        def __init__(self, shards) -> None:
            self.shards = shards

        def build_metadata(self, tensor_sizes, tensor_properties):
            return ShardedTensorMetadata(self.shards, tensor_sizes, tensor_properties)

        def shard(self, tensor, src_rank=0, process_group=None):
            raise NotImplementedError("LocalPieces only describes pieces that exist already")

    return LocalPieces


def _LocalPieces(shards):  # noqa: N802  (a class, built on first use: torch.distributed._shard is a heavy import)
    global _LOCAL_PIECES
    if _LOCAL_PIECES is None:
        _LOCAL_PIECES = _local_pieces_spec()
    return _LOCAL_PIECES(shards)


_LOCAL_PIECES = None


def _put(state: dict, key: tuple[str, ...], value: Any) -> None:
    for part in key[:-1]:
        state = state.setdefault(part, {})
    state[key[-1]] = value
