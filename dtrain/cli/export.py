"""``dtrain export``: a checkpoint's model as a Hugging Face directory (config.json, safetensors, tokenizer.json),
whatever layout wrote it (see :mod:`dtrain.train.checkpoint`).

    dtrain export runs/tiny-cpu --out runs/tiny-cpu/model-step-100 --step 100
    dtrain export runs/tiny-cpu/checkpoints/step-00000100 --out model
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "register", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``dtrain export`` to the ``dtrain`` command's subparsers."""
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model as a Hugging Face directory",
        description="Read the model of a checkpoint (a run's output directory: its last complete checkpoint, or "
        "--step; or a checkpoints/step-N directory) and write config.json, model.safetensors and tokenizer.json.",
    )
    p.add_argument("checkpoint", metavar="PATH", help="a run's output directory or a checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the Hugging Face directory to write: new, empty, or a model directory (replaced)")  # fmt: skip
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the last complete one)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: the run's)")
    p.set_defaults(handler=run)
    return p


register = add_parser  # the name dtrain.cli.main's feature modules use


def _check_tokenizer(path: str) -> None:
    """``--tokenizer``: a file the ``tokenizers`` library reads as a tokenizer (ValueError naming the flag if not)."""
    import os

    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {path}: no such file")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        reason = " ".join(str(exc).split())[:200]
        raise ValueError(f"--tokenizer {path}: not a tokenizers tokenizer.json ({reason})") from None


def _check_out(out: str, checkpoint: str) -> None:
    """``--out`` is replaced whole by the export: it must be new, an empty directory or a Hugging Face model
    directory (one with a ``config.json``), and neither the checkpoint read nor a directory holding it."""
    from pathlib import Path

    target, source = Path(out).resolve(), Path(checkpoint).resolve()
    if target == source or target in source.parents:
        raise ValueError(f"--out {out}: holds the checkpoint {checkpoint} (choose another --out)")
    if target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file():
        raise ValueError(
            f"--out {out}: exists and is not a Hugging Face model directory, which the export would replace "
            "(choose a new --out or remove it)"
        )


def _export(args: argparse.Namespace) -> str:
    from pathlib import Path

    from dtrain.cli.paths import check_dir_out
    from dtrain.train.checkpoint import checkpoint_dir, export_checkpoint, latest_complete_step

    check_dir_out("--out", args.out)
    _check_out(args.out, args.checkpoint)
    if args.tokenizer is not None:
        _check_tokenizer(args.tokenizer)
    path = Path(args.checkpoint)
    if (path / ".metadata").is_file():
        if args.step is not None:
            raise ValueError(f"--step: {path} is one checkpoint already; give its run directory to choose a step")
        directory = path
    else:
        step = args.step if args.step is not None else latest_complete_step(path)
        if step is None:
            raise ValueError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
        directory = checkpoint_dir(path, step)
    written = export_checkpoint(directory, args.out, tokenizer=args.tokenizer)
    return f"wrote {written} from {directory}"


def run(args: argparse.Namespace) -> int:
    """Run ``dtrain export``; bad input is one line on stderr and exit status 2."""
    try:
        line = _export(args)
    except ValueError as exc:
        print(f"dtrain export: {exc}", file=sys.stderr)
        return 2
    print(f"dtrain export: {line}")
    return 0
