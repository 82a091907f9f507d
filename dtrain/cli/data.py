"""``dtrain data prepare``: text, JSONL or Parquet files -> token shards for training (see
:mod:`dtrain.data.prepare`).

    dtrain data prepare corpus/ --out data/corpus --train-tokenizer 8192
    dtrain data prepare shard-*.parquet --out data/web --tokenizer llama/tokenizer.json --text-key content
"""

from __future__ import annotations

import argparse
import sys

from dtrain.cli.units import whole

__all__ = ["add_parser", "register", "run"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


#: The largest vocabulary --train-tokenizer trains (the trainer allocates by it; the largest in use are ~256K).
MAX_VOCAB = 1 << 24
#: The smallest: the 256 bytes and the end-of-text token.
MIN_VOCAB = 257
#: The largest --seed (numpy's generators take any, the dataset's meta.json keeps it as a 64-bit integer).
MAX_SEED = 2**63 - 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``dtrain data`` (subcommand ``prepare``) to the ``dtrain`` command's subparsers."""
    data = subparsers.add_parser("data", help="prepare token datasets for language models")
    commands = data.add_subparsers(dest="data_command", required=True)
    p = commands.add_parser(
        "prepare",
        help="tokenise text / JSONL / Parquet files into train and val token shards",
        description="Tokenise inputs into train-*.bin / val-*.bin shards, meta.json and tokenizer.json in --out. "
        "INPUT: .jsonl or .jsonl.gz (one document per line), .parquet (one per row), any other file (one document), "
        "or a directory (its files, sorted).",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    p.add_argument("--out", required=True, metavar="DIR", help="the dataset folder to write (new or a dataset)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json")
    source.add_argument(
        "--train-tokenizer",
        type=whole(1, MAX_VOCAB, "a vocabulary size"),
        metavar="VOCAB_SIZE",
        help=f"train a byte-level BPE on the inputs, of {MIN_VOCAB} to {MAX_VOCAB} (2**24) tokens",
    )
    p.add_argument(
        "--text-key",
        default=None,
        help="JSONL key / Parquet column of the text (default: text); other files are read whole",
    )
    p.add_argument("--val-fraction", type=float, default=0.005, help="documents held out (default: 0.005)")
    p.add_argument(
        "--shard-tokens", type=_positive_int, default=100_000_000, help="tokens per shard file (default: 100M)"
    )
    p.add_argument("--seed", type=whole(0, MAX_SEED), default=0,
                   help="seeds the choice of validation documents, 0 to 2**63 - 1 (default: 0)")  # fmt: skip
    p.set_defaults(handler=run)
    return data


register = add_parser  # the name dtrain.cli.main's feature modules use


def _prepare(args: argparse.Namespace) -> str:
    from pathlib import Path

    from dtrain.cli.paths import check_dir_out
    from dtrain.data.prepare import check_out_dir, has_records, input_files, prepare, sources_from_paths
    from dtrain.data.tokenizer import Tokenizer

    if not 0 <= args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.train_tokenizer is not None and args.train_tokenizer < MIN_VOCAB:
        raise ValueError(
            f"--train-tokenizer {args.train_tokenizer}: vocab_size must be an integer of at least {MIN_VOCAB} "
            "(256 bytes + 1 special token)"
        )
    check_dir_out("--out", args.out)
    check_out_dir(Path(args.out))
    if args.text_key is not None and not any(has_records(path) for path in input_files(args.inputs)):
        raise ValueError(
            f"--text-key {args.text_key}: no input is JSONL (.jsonl, .jsonl.gz) or Parquet (.parquet), the files it "
            "picks the text of; every other file is one document read whole"
        )
    text_key = "text" if args.text_key is None else args.text_key
    if args.tokenizer is not None:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        sources = sources_from_paths(args.inputs, text_key=text_key)
        tokenizer = Tokenizer.train_bpe((text for s in sources for text in s.documents()), args.train_tokenizer)
    info = prepare(
        args.inputs, tokenizer, args.out, text_key=text_key, val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens, seed=args.seed,
    )  # fmt: skip
    return info.summary()


def run(args: argparse.Namespace) -> int:
    """Run ``dtrain data prepare``; bad input is one line on stderr and exit status 2."""
    try:
        line = _prepare(args)
    except ValueError as exc:
        print(f"dtrain data prepare: {exc}", file=sys.stderr)
        return 2
    print(f"dtrain data prepare: {line}")
    return 0
