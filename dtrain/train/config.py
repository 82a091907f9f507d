"""The configuration of one ``dtrain train`` run, and the command-line flags derived from it.

:class:`TrainConfig` is the single declaration of every option: each field's metadata carries its help text (and
``choices`` or a ``flag`` name where it has one), and :func:`add_arguments` turns the fields into ``argparse``
flags (``batch_size`` -> ``--batch-size``; a ``bool`` field is a switch). A new option is one new field. This
module imports nothing heavy, so building the command's parser stays fast; validation that needs the model
table or the collectives imports them when a config is made.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "TrainConfig", "add_arguments", "flag_name", "from_arguments"]

_MODELS = ("gpt", "mlp")
_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # the keys of dtrain.parallel.pipeline_schedules.SCHEDULES


def _option(default: Any, help: str, **metadata: Any) -> Any:
    return field(default=default, metadata={"help": help, **metadata})


class ConfigError(ValueError):
    """A bad value for one option; the message starts with its flag (``--steps: ...``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{flag_name(key)}: {message}")


@dataclass(kw_only=True)
class TrainConfig:
    """One training run; each field is a ``dtrain train`` flag (see :func:`add_arguments`)."""

    model: str = _option("gpt", "gpt (on pydoc_data text) or mlp (on synthetic classification)", choices=_MODELS)
    preset: str = _option("debug", "model size: debug (laptop CPU, a minute) or small (gpt)")
    steps: int = _option(20, "total optimizer steps (a resumed run continues up to this count)")
    batch_size: int = _option(16, "global batch size, split over dp ranks, then into micro-batches")
    seed: int = _option(0, "model initialisation and data order")
    dp: int = _option(1, "data-parallel degree")
    pp: int = _option(1, "pipeline stages")
    tp: int = _option(1, "tensor-parallel degree (gpt only; divides its heads)")
    schedule: str = _option(
        "1f1b",
        "pipeline schedule (interleaved-1f1b: 2 model chunks a stage, micro-batches a multiple of --pp)",
        choices=_SCHEDULES,
    )
    microbatches: int = _option(1, "micro-batches per pipeline step (pp > 1 only)")
    lr: float = _option(3e-3, "AdamW learning rate")
    weight_decay: float = _option(0.01, "AdamW weight decay")
    checkpoint_every: int = _option(0, "steps between checkpoints (0: only after the last step)")
    resume: bool = _option(False, "continue from the last complete checkpoint in --out")
    algorithm: str = _option("auto", "all-reduce algorithm for the gradients (see dtrain.comm.algorithms)")
    out: str = _option("runs/train", "metrics.jsonl, checkpoints/, pipeline trace and Gantt PNG")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "dp", "pp", "tp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive int, got {value!r}")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        from dtrain.comm import algorithms
        from dtrain.train.models import PRESETS

        if (self.model, self.preset) not in PRESETS:
            known = ", ".join(p for m, p in PRESETS if m == self.model)
            raise ConfigError("preset", f"no preset {self.preset!r} for model {self.model!r}; known: {known}")
        known = algorithms("all_reduce")
        if self.algorithm not in known:
            raise ConfigError(
                "algorithm", f"unknown all-reduce algorithm {self.algorithm!r}; known: {', '.join(known)}"
            )


def flag_name(key: str) -> str:
    """The command-line flag of config key ``key``: ``batch_size`` -> ``--batch-size``."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if key in fields and "flag" in fields[key].metadata:
        return fields[key].metadata["flag"]
    return "--" + key.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`TrainConfig` field to ``parser`` (``dest`` is the field name)."""
    for f in dataclasses.fields(TrainConfig):
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            if "choices" in f.metadata:
                kwargs["choices"] = list(f.metadata["choices"])
            if kwargs["help"] is not None and not isinstance(f.default, bool):
                kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(flag_name(f.name), **kwargs)


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed flags (:func:`add_arguments`)."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
