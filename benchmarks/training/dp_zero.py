"""Usage: torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py [--sections dp zero] [--out F]  (CPU: --nproc 4)

Data parallel and ZeRO, ours against torch's DDP and ZeroRedundancyOptimizer, in one launch.

    torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --out runs/peers-dp-zero.jsonl   # GPUs, NCCL
    python benchmarks/training/dp_zero.py --nproc 4 --layers 2 --embd 64 ...                     # CPU, Gloo

The model: a GPT-2 (:mod:`dtrain.models`, the ``tiny`` preset resized by ``--layers``/``--embd``/``--heads``,
``--block``-token context, 256-token vocabulary); the batches: uniform random token ids from a generator seeded by
the rank, inputs and next-token targets from one ``(B, block + 1)`` draw (a step's speed does not depend on the
text).

**Scaling** (``--sizes 1 2 4``): for each k, ranks 0..k-1 train the model (``--block`` tokens, ``--batch-per-rank``
sequences a rank: weak scaling) with AdamW as :class:`DataParallel`
(``auto`` and ``native`` collectives) and as ``DistributedDataParallel``, timed in rotating turns
(:func:`timing.time_variants`). Scaling efficiency: tokens/s per rank over the 1-rank tokens/s.

**ZeRO** (every rank): plain data parallel (ours, DDP), ZeRO stage 1 and 2 (:class:`ZeroOptimizer`) and DDP with
torch's ``ZeroRedundancyOptimizer`` (its stage 1), one after another: step time and peak GPU memory of a step.

Every variant starts from the same weights and sees the same batches, so all must end with the same
parameters: the script checks each against DDP (``max_abs_param_diff_vs_ddp``).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import json
import os
from pathlib import Path

import timing as pt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from dtrain.launch import run_ranks
from dtrain.models import build, preset
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeroOptimizer

VOCAB = 256


def _model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(n_positions=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    return build(preset("gpt2", "tiny", vocab_size=VOCAB, **shape)).to(pt.device())


def _batch(args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(VOCAB, (args.batch_per_rank, args.block + 1), generator=gen).to(pt.device())
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) each


def _step_fn(model, optimizer, batch):
    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)  # (B, T, V)
        F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()

    return step


def _wrap(variant: str, base, group):
    model = copy.deepcopy(base)
    dev = pt.device()
    if variant == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant.startswith("ours-"):
        dp = DataParallel(model, group, algorithm=variant.removeprefix("ours-"))
        return dp, torch.optim.AdamW(dp.parameters(), lr=1e-4)
    ddp = DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None, process_group=group)
    if variant == "ddp+zero-torch":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, process_group=group, lr=1e-4)
    if variant in ("zero1-ours", "zero2-ours"):
        stage = int(variant[4])
        return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, group, stage=stage, lr=1e-4)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)


def _params(model) -> list[torch.Tensor]:
    inner = model.module if isinstance(model, DataParallel | DistributedDataParallel) else model
    return [p.detach().float().cpu() for p in inner.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _scaling(args, groups) -> list[dict]:
    records = []
    rank = dist.get_rank()
    # the largest group first: with the peer transport its window is then made before any subgroup's, so
    # every rank has made as many windows when it is (pytorch/pytorch#196082, see dtrain.comm.peer)
    for k, group in sorted(groups.items(), key=lambda kv: -kv[0]):
        dist.barrier()
        if rank >= k:
            continue
        base, batch = _model(args), _batch(args, rank)
        variants = ("single",) if k == 1 else ("ours-auto", "ours-native", "ddp")
        _arm(args, f"scaling on {k} ranks")
        built = {v: _wrap(v, base, group) for v in variants}
        steps = {v: _step_fn(*built[v], batch) for v in variants}
        seconds = pt.time_variants(steps, warmup=args.warmup, iters=args.iters, trials=args.trials, group=group)
        final = {v: _params(built[v][0]) for v in variants}
        for v in variants:
            diff = _max_diff(final[v], final["ddp"]) if k > 1 else None
            tokens = k * args.batch_per_rank * args.block
            records.append(
                {
                    "section": "dp",
                    "variant": v,
                    "ranks": k,
                    "step_s": seconds[v],
                    "tokens_per_s": tokens / seconds[v],
                    "max_abs_param_diff_vs_ddp": diff,
                }
            )
        del built, steps
    return records


def _zero(args) -> list[dict]:
    group, rank = dist.group.WORLD, dist.get_rank()
    base, batch = _model(args), _batch(args, rank)
    records, reference = [], None
    for v in ("ddp", "ours-auto", "zero1-ours", "zero2-ours", "ddp+zero-torch"):
        _arm(args, f"zero section, {v}")
        model, optimizer = _wrap(v, base, group)
        step = _step_fn(model, optimizer, batch)
        seconds = pt.time_variants({v: step}, warmup=args.warmup, iters=args.iters, trials=args.trials)[v]
        peak = pt.peak_memory(step)
        final = _params(model)
        reference = final if v == "ddp" else reference
        record = {
            "section": "zero",
            "variant": v,
            "ranks": dist.get_world_size(),
            "step_s": seconds,
            "peak_memory_bytes": peak,
            "max_abs_param_diff_vs_ddp": _max_diff(final, reference),
        }
        if isinstance(optimizer, ZeroOptimizer):
            report = optimizer.memory_report()
            record |= {
                "state_nbytes_ours": report.zero.total_nbytes,
                "state_nbytes_dp": report.data_parallel.total_nbytes,
            }
        records.append(record)
        del model, optimizer, step
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records


def _arm(args, what: str) -> None:
    """With ``--stall-s``: say what runs now, and if it is still running that long from now, print every
    thread's stack and end the process (a deadlocked collective never returns)."""
    if not args.stall_s:
        return
    if dist.get_rank() == 0:
        print(f"running: {what}", flush=True)
    faulthandler.dump_traceback_later(args.stall_s, exit=True)


def _rank_main(args) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = True
    groups = pt.subgroups(tuple(args.sizes))
    records = _scaling(args, groups) if "dp" in args.sections else []
    records += _zero(args) if "zero" in args.sections else []
    faulthandler.cancel_dump_traceback_later()
    params = sum(p.numel() for p in _model(args).parameters())
    one = {r["section"]: r["tokens_per_s"] for r in records if r["ranks"] == 1}
    ddp = {(r["section"], r["ranks"]): r["step_s"] for r in records if r["variant"] == "ddp"}
    for r in records:
        r["parameters"] = params
        r["ratio_vs_ddp"] = ddp[r["section"], r["ranks"]] / r["step_s"] if (r["section"], r["ranks"]) in ddp else None
        if r["section"] == "dp" and "dp" in one:
            r["scaling_efficiency"] = r["tokens_per_s"] / r["ranks"] / one["dp"]
        r |= pt.machine()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks (ignored under torchrun)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch-per-rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sections", nargs="+", choices=["dp", "zero"], default=["dp", "zero"])
    p.add_argument("--stall-s", type=float, default=0, help="dump every stack and exit after this long (0: never)")
    args = p.parse_args()
    records = run_ranks(_rank_main, args.nproc, args)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank returns the records; rank 0 reports
        return
    for r in records:
        print(json.dumps({k: v for k, v in r.items() if k not in ("hostname",)}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
