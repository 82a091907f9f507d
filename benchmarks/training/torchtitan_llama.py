"""Usage: torchrun --nproc-per-node N benchmarks/training/torchtitan_llama.py [--preset 1b] [--seq-len 2048]
       [--batch-per-gpu 4] [--steps 20] [--warmup 5] [--lr 3e-4] [--compile] [--out FILE] [-- TORCHTITAN_FLAGS]

torchtitan (Liang et al. 2024, "TorchTitan: One-stop PyTorch native solution for production ready LLM
pre-training", https://github.com/pytorch/torchtitan), PyTorch's reference LLM trainer, training its Llama 3 model
in the shape of a dtrain llama preset, for a side-by-side with ``benchmarks/training/llama.py``:

    torchrun --nproc-per-node 4 benchmarks/training/torchtitan_llama.py --out benchmarks/results/llama_1b-h100x4.jsonl
    torchrun --nproc-per-node 4 benchmarks/training/torchtitan_llama.py --compile --out ...

Written for torchtitan 0.2.2 (``pip install torchtitan==0.2.2``, with torchdata, tyro and datasets), whose code
runs on torch 2.11; torchtitan 0.3 needs FSDP APIs of later torch releases. Nothing is downloaded:

- the model is torchtitan's ``llama3`` ``Transformer`` with a flavor registered at run time from the dtrain preset
  (hidden size, layers, heads, key-value heads, the SwiGLU width, vocabulary, norm epsilon, RoPE theta and Llama 3
  RoPE scaling). torchtitan's Llama 3 has no tied embeddings: its output head is a separate weight (262 M more
  parameters than a tied 1B), the same matmul FLOPs;
- the text is synthetic (seeded pseudo-words, one document a line) in a local file, read by a dataset registered
  in torchtitan's dataset table, and tokenized on the fly by torchtitan's loader with a byte-level BPE that
  :meth:`dtrain.data.tokenizer.Tokenizer.train_bpe` trains on it (ids below the model's vocabulary; the speed of a
  step does not depend on which ids);
- the run is torchtitan's defaults for data parallel training: FSDP2 over every GPU (``dp_shard = N``), parameters
  gathered in bf16 and gradients reduce-scattered in float32, fused AdamW (weight decay 0.1, betas 0.9/0.95), clipping
  at global norm 1.0, here with ``--lr`` constant (no warmup, no decay), no activation checkpointing, no
  checkpoints, and with ``--compile`` torchtitan's ``torch.compile`` of each block and of the loss.

torchtitan logs every ``--log-freq`` steps (the host waits for the GPUs only there), each log over the steps since
the last; its metrics are read off in the launch and the logs after ``--warmup`` averaged: step time (wall time
over the steps, data loading included), tokens/s over all GPUs, model FLOPs utilisation
(:func:`dtrain.models.train_flops_per_token` over :func:`dtrain.train.metrics.peak_flops`, as ``llama.py`` counts
it, beside torchtitan's own), peak memory (torchtitan's peak of active bytes, close to
``torch.cuda.max_memory_allocated``, and its peak reserved), and the last loss. Rank 0 appends one JSON line to
``--out``. Arguments after ``--`` go to torchtitan's command line unchanged (e.g. ``-- --dataloader.num_workers 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

DATASET = "dtrain_synthetic"
SEED = 0


def flavor(config, seq_len: int) -> dict:
    """Keyword arguments of torchtitan's ``TransformerModelArgs`` for the dtrain ``LlamaConfig`` ``config``.

    torchtitan derives the SwiGLU width from ``4 * dim``: ``int(2 * 4 * dim / 3)``, times ``ffn_dim_multiplier``,
    rounded up to a multiple of ``multiple_of``; ``multiple_of = intermediate_size`` and the multiplier
    ``intermediate_size / int(8 * dim / 3)`` give exactly the preset's width.
    """
    if config.hidden_size % config.num_attention_heads or config.head_dim != (
        config.hidden_size // config.num_attention_heads
    ):
        raise ValueError(
            f"--preset: torchtitan's Llama 3 needs head_dim = hidden_size / num_attention_heads, got "
            f"{config.head_dim} for {config.hidden_size} / {config.num_attention_heads}"
        )
    if config.attention_bias or config.mlp_bias:
        raise ValueError("--preset: torchtitan's Llama 3 has no attention or MLP biases")
    base = int(2 * 4 * config.hidden_size / 3)
    scaling = config.rope_scaling or {}
    if scaling and scaling.get("rope_type") != "llama3":
        raise ValueError(f"--preset: torchtitan's Llama 3 takes llama3 RoPE scaling only, got {scaling!r}")
    return {
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "multiple_of": config.intermediate_size,
        "ffn_dim_multiplier": config.intermediate_size / base,
        "norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": {  # factor 1: frequencies unchanged (torchtitan always applies its scaling)
            "scaling_factor": float(scaling.get("factor", 1.0)),
            "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192)),
        },
        "max_seq_len": seq_len,
    }


def ffn_width(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan's Llama 3 ``FeedForward`` hidden width for ``hidden_dim = 4 * dim``."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def synthetic_corpus(documents: int, words: int, seed: int = SEED) -> list[str]:
    """``documents`` lines of ``words`` pseudo-words each (Zipf-like draws from 5000 seeded letter strings)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(1, 10))) for _ in range(5000)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    return [" ".join(rng.choices(lexicon, weights, k=words)) + "." for _ in range(documents)]


def write_assets(folder: Path, tokenizer_vocab: int) -> tuple[Path, Path]:
    """The corpus file and a tokenizer folder (``tokenizer.json``, ``tokenizer_config.json`` naming BOS/EOS)."""
    from dtrain.data.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    texts = synthetic_corpus(documents=2000, words=400)
    corpus = folder / "corpus.txt"
    _atomic_write(corpus, "\n".join(texts) + "\n")
    tokenizer = Tokenizer.train_bpe(texts, tokenizer_vocab, special_tokens=("<|begin_of_text|>", "<|end_of_text|>"))
    assets = folder / "tokenizer"
    assets.mkdir(exist_ok=True)
    tokenizer.save(assets / "tokenizer.json")
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    _atomic_write(assets / "tokenizer_config.json", json.dumps(special))
    return corpus, assets


def torchtitan_flags(args: argparse.Namespace, flavor_name: str, assets: Path, corpus: Path, dump: Path) -> list[str]:
    """torchtitan's command line for this run (its ``--section.key value`` flags)."""
    flags = [
        *("--job.dump_folder", str(dump)),
        *("--model.name", "llama3", "--model.flavor", flavor_name, "--model.hf_assets_path", str(assets)),
        *("--optimizer.name", "AdamW", "--optimizer.lr", str(args.lr), "--optimizer.implementation", "fused"),
        *("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"),
        *("--training.dataset", DATASET, "--training.dataset_path", str(corpus)),
        *("--training.local_batch_size", str(args.batch_per_gpu), "--training.seq_len", str(args.seq_len)),
        *("--training.steps", str(args.warmup + args.steps), "--training.max_norm", "1.0"),
        *("--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32"),
        *("--parallelism.data_parallel_shard_degree", "-1", "--parallelism.data_parallel_replicate_degree", "1"),
        *("--activation_checkpoint.mode", "none"),
        *("--metrics.log_freq", str(args.log_freq), "--metrics.disable_color_printing"),
        *("--debug.seed", str(SEED)),
    ]
    if args.compile:
        flags += ["--compile.enable", "--compile.components", "model,loss"]
    return flags + args.torchtitan


def summarize(steps: dict[int, dict], args: argparse.Namespace, world: int, config, peak: float | None) -> dict:
    """The record of a run from torchtitan's metrics (``{step: metrics}``, logged at step 1 and every
    ``--log-freq`` steps, each over the steps since the last log); the logs after ``--warmup`` are averaged."""
    from dtrain.models import train_flops_per_token

    timed = [steps[s] for s in sorted(steps) if s > args.warmup]
    if not timed:
        raise RuntimeError(f"torchtitan logged no step after the {args.warmup} warm-up steps (got {sorted(steps)})")
    step_s = sum(m["time_metrics/end_to_end(s)"] for m in timed) / len(timed)
    tokens_per_s = world * args.batch_per_gpu * args.seq_len / step_s
    flops = train_flops_per_token(config, args.seq_len)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / (world * peak) if peak else None,
        "torchtitan_mfu": sum(m["mfu(%)"] for m in timed) / len(timed) / 100,
        "torchtitan_tokens_per_s": world * sum(m["throughput(tps)"] for m in timed) / len(timed),
        "step_s": step_s,
        "data_loading_s": sum(m["time_metrics/data_loading(s)"] for m in timed) / len(timed),
        "peak_memory_gib": max(m["memory/max_active(GiB)"] for m in timed),
        "peak_reserved_gib": max(m["memory/max_reserved(GiB)"] for m in timed),
        "loss": timed[-1]["loss_metrics/global_avg_loss"],
        "timed_steps": len(timed) * args.log_freq,
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", help="a llama preset of dtrain.models.presets (default: 1b)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-per-gpu", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages (compilation included)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--log-freq", type=int, default=5, help="steps per torchtitan log (and host synchronisation; default 5)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks and the loss")
    parser.add_argument("--tokenizer-vocab", type=int, default=4096, help="size of the byte-level BPE (default 4096)")
    parser.add_argument("--out", default=None, help="JSON lines: one record appended per launch")
    if "--" in argv:
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        args.torchtitan = argv[split + 1 :]
    else:
        args = parser.parse_args(argv)
        args.torchtitan = []
    for name in ("seq_len", "batch_per_gpu", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.log_freq < 1 or args.warmup < args.log_freq or args.warmup % args.log_freq or args.steps % args.log_freq:
        parser.error(
            f"--warmup ({args.warmup}) and --steps ({args.steps}) must be positive multiples of --log-freq "
            f"({args.log_freq})"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)

    from dtrain.models import parameter_count, preset

    try:
        config = preset("llama", args.preset)
        spec = flavor(config, args.seq_len)
    except ValueError as exc:
        raise SystemExit(f"--preset: {exc}") from None
    if args.tokenizer_vocab > config.vocab_size:
        raise SystemExit(f"--tokenizer-vocab must be at most the model's vocabulary {config.vocab_size}")
    width = ffn_width(spec["dim"], spec["multiple_of"], spec["ffn_dim_multiplier"])
    if width != config.intermediate_size:  # torchtitan's rounding changed
        raise SystemExit(f"torchtitan FFN width {width} != preset intermediate_size {config.intermediate_size}")

    import torch
    import torchtitan
    from torchtitan.components import metrics as tt_metrics
    from torchtitan.config import ConfigManager
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    def load_lines(path: str):
        from datasets import Dataset

        return Dataset.from_dict({"text": Path(path).read_text(encoding="utf-8").splitlines()})

    DATASETS[DATASET] = DatasetConfig(path="", loader=load_lines, sample_processor=lambda sample: sample["text"])
    flavor_name = f"dtrain_{args.preset}"
    llama3_args[flavor_name] = TransformerModelArgs(
        **{k: v for k, v in spec.items() if k != "rope_scaling"},
        rope_scaling_args=RoPEScalingArgs(**spec["rope_scaling"]),
    )

    steps: dict[int, dict] = {}  # torchtitan's metrics of each logged step, caught where its logger writes them
    build_metric_logger = tt_metrics._build_metric_logger

    def catching_logger(*a, **k):
        inner = build_metric_logger(*a, **k)
        log = inner.log

        def record(metrics, step):
            steps[int(step)] = dict(metrics)
            log(metrics, step)

        inner.log = record
        return inner

    tt_metrics._build_metric_logger = catching_logger

    init_logger()
    logger.info(f"torchtitan {torchtitan.__version__}, torch {torch.__version__}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    with tempfile.TemporaryDirectory(prefix=f"torchtitan-rank{local_rank}-") as work:
        corpus, assets = write_assets(Path(work), args.tokenizer_vocab)
        config_tt = ConfigManager().parse_args(torchtitan_flags(args, flavor_name, assets, corpus, Path(work) / "dump"))
        trainer = None
        try:
            trainer = Trainer(config_tt)
            trainer.train()
        finally:
            if trainer is not None:
                trainer.close()

    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from dtrain.train.metrics import peak_flops

    result = summarize(steps, args, world, config, peak_flops(device))
    untied = preset("llama", args.preset, tie_word_embeddings=False)
    record = {
        "variant": "torchtitan-compile" if args.compile else "torchtitan",
        "preset": args.preset,
        "gpus": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "torchtitan": torchtitan.__version__,
        "seq_len": args.seq_len,
        "batch_per_gpu": args.batch_per_gpu,
        "parameters": parameter_count(untied),
        "tied_embeddings": False,
        **result,
    }
    if rank == 0:
        mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else "n/a"
        print(
            f"{record['variant']:20s} {result['step_s'] * 1e3:8.1f} ms/step {result['tokens_per_s']:10.0f} tok/s  "
            f"MFU {mfu} (torchtitan's {result['torchtitan_mfu']:.1%})  peak {result['peak_memory_gib']:.1f} GiB  "
            f"loss {result['loss']:.4f}",
            flush=True,
        )
        if args.out:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
