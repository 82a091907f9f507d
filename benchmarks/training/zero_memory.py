"""Usage: python benchmarks/training/zero_memory.py --nproc 2 [--out FILE]

Peak memory of a rank on the CPU: plain data parallel against ZeRO stage 1 and stage 2, AdamW, one GPT-2.

    python benchmarks/training/zero_memory.py --nproc 2 --out benchmarks/results/zero_memory-cpu2.jsonl

There is no allocator high-water mark for CPU tensors, so each variant runs in its own launch (fresh
processes) and reports the process's peak resident set (``ru_maxrss``) after a few training steps, and its
increase over the resident set once the model and optimizer wrapper are built (the training state that grows
with the steps: gradients, optimizer moments, communication buffers, activations). Every variant trains the
same model from the same seed on the same batches; the final parameters of each are compared with the first
variant's, plain data parallel by default (``max_abs_param_diff_vs_first_variant``), which shows they did the
same work. The model is the GPT-2 ``tiny`` preset of :mod:`dtrain.models` resized (``--layers`` blocks of width
``--embd``, 8 heads, 64-token context, 256-token vocabulary) so that gradients and optimizer state dominate the
activations (ZeRO's regime); its batches are uniform random token ids, inputs and next-token targets from one
``(B, 65)`` draw of a generator seeded by step and rank (a step's cost does not depend on the text).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.launch import run_ranks
from dtrain.models import build, preset
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeroOptimizer

VOCAB = 256
VARIANTS = ("dp", "zero1", "zero2")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rank_main(args) -> dict:
    torch.manual_seed(0)
    shape = dict(n_positions=64, n_layer=args.layers, n_head=8, n_embd=args.embd)
    model = build(preset("gpt2", "tiny", vocab_size=VOCAB, **shape))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.variant == "dp":
        forward = DataParallel(model, None, bucket_bytes=args.bucket_mb * 2**20, algorithm=args.algorithm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        forward = model
        stage = int(args.variant[-1])
        extra = {"bucket_bytes": args.bucket_mb * 2**20} if args.zero_buckets else {}
        optimizer = ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, None, stage=stage, algorithm=args.algorithm, lr=1e-4, **extra
        )
    start_mb = _current_rss_mb()
    seconds = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(VOCAB, (args.batch_per_rank, 65), generator=gen)
        began = time.perf_counter()
        logits = forward(tokens[:, :-1])  # (B, T, V)
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - began)
    peak = torch.tensor([_rss_mb(), _rss_mb() - start_mb])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "variant": args.variant,
        "ranks": world,
        "parameters": params.numel(),
        "peak_rss_mb": peak[0].item(),
        "peak_rss_growth_mb": peak[1].item(),
        "step_s_median": sorted(seconds)[len(seconds) // 2],
        "params": params,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket-mb", type=int, default=25, help="bucket size of DataParallel and ZeRO")
    p.add_argument("--algorithm", default="auto", help="collective algorithm (auto, native, ring, ...)")
    p.add_argument(
        "--no-zero-buckets", dest="zero_buckets", action="store_false", help="for a ZeroOptimizer without them"
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    records, reference = [], None
    for variant in args.variants:
        args.variant = variant
        record = run_ranks(_rank_main, args.nproc, args) | {"bucket_mb": args.bucket_mb, "algorithm": args.algorithm}
        params = record.pop("params")
        reference = params if reference is None else reference
        record["max_abs_param_diff_vs_first_variant"] = (params - reference).abs().max().item()
        record |= {"machine": platform.node(), "cpu_count": torch.multiprocessing.cpu_count()}
        record |= {"torch_version": torch.__version__}
        records.append(record)
        print(json.dumps(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
