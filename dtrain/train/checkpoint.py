"""Checkpoints that reshard: the training state in canonical names through ``torch.distributed.checkpoint`` (DCP),
written at one layout and loaded at any other (dp x tp x pp x ZeRO stage, any world size).

A checkpoint of step ``s`` is the directory ``<out>/checkpoints/step-<s>/`` (eight digits) holding DCP's files
(one ``.distcp`` file per writing rank and ``.metadata``) and ``meta.json`` (the step, the layout that wrote it,
the model's ``config.json`` contents, the sequence length, the tokenizer, and the dataset with its fingerprint and
end-of-text id).
The state (:func:`training_state`) is the model and the optimizer state sharded in canonical names
(:func:`dtrain.parallel.state.sharded_state_dict`), the data position, the torch RNG state (rank 0's), the step
and the fp16 loss scale.

Writing is atomic at the level of the directory: every rank writes into ``.step-<s>.tmp/``; after all ranks
finished and a barrier, rank 0 writes ``meta.json`` and renames the directory into place (``os.replace``, then
an fsync of ``checkpoints/``). A crash in between leaves only a temporary directory that resume ignores and the
next save of that step removes; the previous checkpoints stay whole. With ``async_save`` DCP writes in a
background thread (``dcp.async_save``) on a process group of its own, after copying the state, so training goes
on; the rename happens when the next save (or :meth:`Checkpointer.wait`) collects it. ``keep`` > 0 deletes all
but the newest ``keep`` complete checkpoints after each save.

Reading checks before it loads (:func:`check_files`): ``.metadata`` must unpickle, and every file it lists must be
there with at least the bytes it lists, so a deleted or truncated shard is one line naming the file. A file that
is there but cannot be read (damaged in place) is a ``ValueError`` naming the directory too: bad input, which no
restart of the ranks mends (:mod:`dtrain.launch`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Checkpointer",
    "check_files",
    "checkpoint_dir",
    "complete_steps",
    "export_checkpoint",
    "latest_complete_step",
    "load_model_state",
    "read_meta",
    "restore_training_state",
    "saved_data_fingerprint",
    "training_state",
]

META = "meta.json"
_STEP_DIR = re.compile(r"step-(\d+)")


def checkpoint_dir(out: str | Path, step: int) -> Path:
    """``<out>/checkpoints/step-<step>`` (eight digits)."""
    return Path(out) / "checkpoints" / f"step-{step:08d}"


def _tmp_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f".step-{step:08d}.tmp"


def _is_complete(directory: Path) -> bool:
    return (directory / ".metadata").is_file() and (directory / META).is_file()


def complete_steps(out: str | Path) -> list[int]:
    """The steps with a complete checkpoint under ``out``, largest first (temporary directories never count)."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return []
    found = (int(m.group(1)) for d in root.iterdir() if (m := _STEP_DIR.fullmatch(d.name)) and _is_complete(d))
    return sorted(found, reverse=True)


def latest_complete_step(out: str | Path) -> int | None:
    """The largest step with a complete checkpoint under ``out``, or None."""
    steps = complete_steps(out)
    return steps[0] if steps else None


def read_meta(directory: str | Path) -> dict[str, Any]:
    """A checkpoint directory's ``meta.json``; ValueError naming the file if it is missing, unreadable or not a JSON
    object."""
    file = Path(directory) / META
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable checkpoint description ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: not a checkpoint description (a JSON object), holds a {type(meta).__name__}")
    return meta


def _reason(exc: BaseException) -> str:
    """An exception in a few words: an OSError's file and reason, else its type and first sentence (cut short)."""
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or type(exc).__name__}"
    lines = str(exc).strip().splitlines()
    text = lines[0].split(". ")[0].rstrip(".") if lines else ""
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_files(directory: str | Path):
    """The DCP metadata of checkpoint ``directory`` (``.metadata``), once every file it lists is there and holds
    at least the bytes it lists; ValueError naming the file otherwise (an unreadable ``.metadata``, a deleted or
    truncated ``.distcp`` file). Reads no tensor."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    index = directory / ".metadata"
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as exc:  # pickle's errors, an EOF, a foreign object: the index is damaged
        raise ValueError(f"{index}: not a readable checkpoint index ({_reason(exc)})") from None
    for name, end in sorted(ends.items()):
        file = directory / name
        if not file.is_file():
            raise ValueError(f"{file}: missing (listed in {index})")
        size = file.stat().st_size
        if size < end:
            raise ValueError(f"{file}: {size} bytes, but {index} lists {end}: the file is truncated")
    return metadata


def _unreadable(directory: Path, exc: BaseException) -> ValueError:
    """The one line for a checkpoint DCP failed to read: its ``CheckpointException`` holds each rank's failure, a
    local one (a read or a plan; a peer lost in between fails the collective itself, not this)."""
    failures = getattr(exc, "failures", None) or {}
    first = failures[min(failures)][0] if failures else exc
    return ValueError(f"{directory}: a file of the checkpoint cannot be read, it is damaged ({_reason(first)})")


#: DCP's warning that a load without a process group runs in one process: what the loads that pass no_dist want.
_ONE_PROCESS_NOTE = "torch.distributed is disabled, unavailable or uninitialized"
#: DCP's planner's deprecation note for every ShardedTensor it loads into.
_SHARDED_TENSOR_NOTE = "Please use DTensor instead and we are deprecating ShardedTensor"


def saved_data_fingerprint(directory: str | Path) -> str | None:
    """The fingerprint of the dataset checkpoint ``directory`` was trained on: its ``meta.json``'s, or (a
    checkpoint that does not record it there) the one saved with the data position; None where neither is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    recorded = read_meta(directory).get("data_fingerprint")
    if isinstance(recorded, str):
        return recorded
    metadata = check_files(directory)
    if "data.fingerprint" not in metadata.state_dict_metadata:
        return None
    state: dict[str, Any] = {"data": {"fingerprint": ""}}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _ONE_PROCESS_NOTE)
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    except CheckpointException as exc:
        raise _unreadable(directory, exc) from None
    return str(state["data"]["fingerprint"])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(file: Path, data: dict) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def _copied(state: Any) -> Any:
    """``state`` with every tensor (and every ShardedTensor's local shards) copied: what an asynchronous save
    writes must not change while training goes on."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    from dtrain.parallel.state import _sharded_tensor

    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    if isinstance(state, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in state.local_shards()]
        return _sharded_tensor(shards, state.metadata(), state._process_group)
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


class _AlreadyCopied:
    """DCP's asynchronous stager for a state that :func:`_copied` made private already (DCP's default stager
    deep-copies ShardedTensors, process group included)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class Checkpointer:
    """Saves and loads checkpoints under ``<out>/checkpoints`` (module docstring). Every method is collective
    over ``process_group`` (default: a new Gloo group of the whole world, which every process must create
    together; DCP's own collectives then never interleave with training's, even from a background thread).

    ``async_save``: :meth:`save` returns once the state is copied; the files are written in the background and
    the checkpoint completed by the next :meth:`save` or :meth:`wait`. ``keep``: how many complete checkpoints
    to keep (0: all). ``on_complete``: called on every rank with the step of each checkpoint once it is complete
    (renamed into place; for an asynchronous save, at the next :meth:`save` or :meth:`wait`)."""

    def __init__(
        self,
        out: str | Path,
        *,
        process_group=None,
        async_save: bool = False,
        keep: int = 0,
        on_complete: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"checkpoint.keep: must be an int >= 0, got {keep!r}")
        self.out = Path(out)
        self._group = process_group
        self.async_save = async_save
        self.keep = keep
        self.on_complete = on_complete
        self._pending: tuple[Any, int, dict] | None = None

    @property
    def group(self):
        """The group DCP saves and loads over: the one given, else a Gloo group of the world made at the first
        save or load (every rank of the world saves and loads together, so making it then is collective too)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def _rank(self) -> int:
        return dist.get_rank(self.group)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write ``state`` (a DCP state dict, e.g. :func:`training_state`) as the checkpoint of ``step``;
        ``meta`` (JSON) becomes its ``meta.json``. Waits for the previous asynchronous save first."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        tmp = _tmp_dir(self.out, step)
        if self._rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # what a crashed save of this step left
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        if self.async_save:
            future = dcp.async_save(
                _copied(state), storage_writer=writer, process_group=self.group, async_stager=_AlreadyCopied()
            )
            self._pending = (future, step, dict(meta))
            return
        dcp.save(state, storage_writer=writer, process_group=self.group)
        self._complete(step, meta)

    def wait(self) -> None:
        """Finish the asynchronous save in flight, if any (its rename into place included)."""
        if self._pending is None:
            return
        future, step, meta = self._pending
        self._pending = None
        future.result()
        self._complete(step, meta)

    def _complete(self, step: int, meta: dict[str, Any]) -> None:
        dist.barrier(group=self.group)  # every rank's files are written
        if self._rank == 0:
            tmp, final = _tmp_dir(self.out, step), checkpoint_dir(self.out, step)
            _write_json(tmp / META, {**meta, "step": step})
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again: the new one replaces it
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
            _fsync_dir(final.parent)
            if self.keep:
                for old_step in complete_steps(self.out)[self.keep :]:
                    shutil.rmtree(checkpoint_dir(self.out, old_step))
        dist.barrier(group=self.group)
        if self.on_complete is not None:
            self.on_complete(step)

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Fill ``state`` (a DCP state dict for loading, e.g. ``training_state(..., for_load=True)``) from the
        checkpoint of ``step``, in place; top-level entries the checkpoint lacks are dropped from ``state``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        directory = checkpoint_dir(self.out, step)
        if not _is_complete(directory):
            raise ValueError(f"{directory}: not a complete checkpoint")
        metadata = check_files(directory)  # the same answer on every rank: they read the same files
        saved = {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
        for key in [k for k in state if k not in saved]:
            del state[key]
        try:
            with warnings.catch_warnings():  # the state is ShardedTensors by design (dtrain.parallel.state)
                warnings.filterwarnings("ignore", _SHARDED_TENSOR_NOTE, FutureWarning)
                dcp.load(state, storage_reader=dcp.FileSystemReader(directory), process_group=self.group)
        except CheckpointException as exc:  # gathered from every rank: each raises it, and the same line
            raise _unreadable(directory, exc) from None


def training_state(hybrid, *, step: int = 0, data=None, scaler=None, process_group=None, for_load: bool = False):
    """The DCP state dict of a training run on ``hybrid`` (a :class:`~dtrain.parallel.hybrid.HybridParallel`):
    ``model`` and ``optim`` (:func:`~dtrain.parallel.state.sharded_state_dict`), ``step``, ``rng`` (the torch
    RNG state), ``data`` (a :class:`~dtrain.data.loader.PackedBatches` position) and ``loss_scaler`` where
    given. ``for_load``: the views a load fills (then pass it to :func:`restore_training_state`)."""
    from dtrain.parallel.state import sharded_state_dict

    state = sharded_state_dict(hybrid, process_group=process_group, for_load=for_load)
    state["step"] = step
    state["rng"] = torch.get_rng_state()
    if data is not None:
        state["data"] = data.state_dict()
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    return state


def restore_training_state(state: dict[str, Any], *, data=None, scaler=None) -> int:
    """Apply the non-tensor parts of a loaded :func:`training_state` (the model and optimizer are filled in
    place already): the RNG state, the data position, the loss scale. Returns the step."""
    torch.set_rng_state(state["rng"])
    if data is not None:
        data.load_state_dict(state["data"])
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])
    return int(state["step"])


def load_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint directory in canonical names (the unparallelized model's state dict, a
    tied weight once), read in this one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    if not _is_complete(directory):
        raise ValueError(f"{directory}: not a complete checkpoint (no .metadata or {META})")
    metadata = check_files(directory).state_dict_metadata
    try:
        model = {
            fqn.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for fqn, m in metadata.items()
            if fqn.startswith("model.")
        }
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{directory / '.metadata'}: not a checkpoint of a model ({_reason(exc)})") from None
    if not model:
        raise ValueError(f"{directory / '.metadata'}: holds no model tensors")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _ONE_PROCESS_NOTE)
            dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    except CheckpointException as exc:
        raise _unreadable(directory, exc) from None
    return model


def export_checkpoint(directory: str | Path, dest: str | Path, *, tokenizer: str | Path | None = None) -> Path:
    """Write the model of checkpoint ``directory`` as a Hugging Face directory ``dest`` (config.json,
    safetensors, tokenizer.json: ``tokenizer`` or the one the run trained with, where it still exists). The
    config's ``eos_token_id`` is the end-of-text id the run's data was packed with (``meta.json``'s), or that of
    ``tokenizer`` where one is given."""
    from dtrain.data.tokenizer import Tokenizer
    from dtrain.models import hf

    meta = read_meta(directory)
    if not isinstance(meta.get("tokenizer"), str | None):
        raise ValueError(f"{Path(directory) / META}: tokenizer: must be a path, got {meta['tokenizer']!r}")
    config = hf.config_from_dict(meta.get("model"), Path(directory) / META)
    eos = meta.get("eos_id") if tokenizer is None else None
    if tokenizer is None and meta.get("tokenizer") and Path(meta["tokenizer"]).is_file():
        tokenizer = meta["tokenizer"]
    if eos is None and tokenizer is not None:
        eos = Tokenizer.load(tokenizer).eos_id
    if not (isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < config.vocab_size):
        eos = None
    return hf.save_pretrained(load_model_state(directory), config, dest, tokenizer=tokenizer, eos_token_id=eos)
