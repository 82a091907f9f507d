"""``dtrain generate``: continue a prompt with a model from a Hugging Face directory.

The directory is one :func:`dtrain.models.hf.save_pretrained` or ``transformers``' ``save_pretrained`` wrote:
``config.json``, ``model.safetensors`` (or shards) and a ``tokenizer.json`` (read with the ``tokenizers``
library). The prompt and its continuation are printed as one text. Generation stops after ``--max-new-tokens``
tokens or at the ``eos_token_id`` of ``generation_config.json``, where the directory has one, else of
``config.json`` (any of them where it lists several), as ``transformers``' ``generate`` stops. Bad input (a missing
directory or tokenizer, a bad config or weights, an unavailable device) is one line ``dtrain generate: ...`` and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

__all__ = ["add_parser", "register", "run"]

_PREFIX = "dtrain generate"

#: The largest --seed (dtrain.models.generate.MAX_SEED, without importing torch here).
MAX_SEED = 2**63 - 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``generate`` to ``subparsers`` (its handler, ``run``, set as ``handler``); returns the parser."""
    p = subparsers.add_parser("generate", help="continue a prompt with a model from a Hugging Face directory")
    p.add_argument("--model", required=True, help="a directory with config.json, model.safetensors, tokenizer.json")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="a finite number >= 0; 0: greedy; default 1.0")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (default: all; not with --temperature 0)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="for repeatable sampling: 0 to 2**63 - 1 (not with --temperature 0)")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu")
    p.set_defaults(handler=run)
    return p


def register(commands) -> None:
    """The feature-module hook of ``dtrain.cli.main``: adds ``generate`` to ``commands``."""
    add_parser(commands)


def _eos_ids(directory: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-text ids inside the vocabulary: ``generation_config.json``'s ``eos_token_id`` where the directory
    has one that sets it (what ``transformers``' ``generate`` stops at), else ``config.json``'s; one id or a list
    of them (Llama 3's configs name several, any of which ends the text). ValueError naming a
    ``generation_config.json`` that is not a JSON object."""
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    eos = raw.get("eos_token_id")
    generation = directory / "generation_config.json"
    if generation.is_file():
        try:
            settings = json.loads(generation.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{generation}: cannot be read ({' '.join(str(exc).split())})") from None
        if not isinstance(settings, dict):
            raise ValueError(f"{generation}: not a JSON object")
        if settings.get("eos_token_id") is not None:
            eos = settings["eos_token_id"]
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size)


def _check_finite(model, directory: Path) -> None:
    """ValueError naming the weights file where a loaded parameter holds NaN or an infinity (sampling from it
    would fail, or print noise)."""
    import torch

    from dtrain.models.hf import INDEX_NAME, WEIGHTS_NAME

    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            weights = directory / (WEIGHTS_NAME if (directory / WEIGHTS_NAME).is_file() else INDEX_NAME)
            raise ValueError(f"{weights}: the weights hold NaN or infinite values ({name})")


def _generate(args: argparse.Namespace) -> str:
    """The printed text; ValueError for bad input."""
    directory = Path(args.model)
    if not directory.is_dir():
        raise ValueError(f"--model: {directory}: no such directory")
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file}: no such file (the tokenizer the model was trained with)")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.temperature < math.inf:
        raise ValueError(f"--temperature: must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k: must be >= 1, got {args.top_k}")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed: must be a whole number from 0 to 2**63 - 1, got {args.seed}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a byte that is not UTF-8 arrives from argv as a lone surrogate
        code = ord(exc.object[exc.start])
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"{chr(code)!r}"
        raise ValueError(f"--prompt: not UTF-8 text ({what} at character {exc.start})") from None
    for flag, value in (("--top-k", args.top_k), ("--seed", args.seed)):
        if value is not None and args.temperature == 0:
            raise ValueError(f"{flag}: greedy decoding (--temperature 0) samples nothing, leave {flag} out")

    import torch
    from tokenizers import Tokenizer

    from dtrain.models.generate import generate
    from dtrain.models.hf import load_config, load_pretrained

    config = load_config(directory)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda is not available on this machine (use --device cpu)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ValueError(f"{tokenizer_file}: not a tokenizers file ({' '.join(str(exc).split())})") from None
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise ValueError("--prompt: encodes to no tokens")
    if max(ids) >= config.vocab_size:
        raise ValueError(
            f"{tokenizer_file}: token id {max(ids)} is outside the model's vocabulary of {config.vocab_size}"
        )
    eos_ids = _eos_ids(directory, config.vocab_size)
    model = load_pretrained(directory, device=device)
    _check_finite(model, directory)
    out = generate(
        model,
        torch.tensor(ids, dtype=torch.long, device=device)[None],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        eos_id=eos_ids or None,
    )
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    """``dtrain generate``: print the prompt and its continuation; 0, or 2 with one line for bad input."""
    try:
        text = _generate(args)
    except ValueError as exc:
        print(f"{_PREFIX}: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
