"""Usage: torchrun --nproc-per-node N benchmarks/training/llama.py [--preset 1b] [--seq-len 2048]
       [--batch-per-gpu 4] [--steps 20] [--variants dtrain,ddp,fsdp2] [--compile] [--out FILE]

A Llama-family model in bf16 trained data parallel over every GPU: dtrain's
:class:`~dtrain.parallel.hybrid.HybridParallel` against torch's ``DistributedDataParallel`` and FSDP2
(``torch.distributed.fsdp.fully_shard``), the same model, batch and optimizer, each variant in a launch of its
own (below).

    torchrun --nproc-per-node 2 benchmarks/training/llama.py --out benchmarks/results/llama_1b_dp-h100x2.jsonl

Every variant starts from the same weights (built on each GPU from one seed) and trains on the same pre-drawn
token batches (uniform random ids: the speed of a step does not depend on the text), with float32 master weights
and AdamW (fused), gradients clipped to global norm 1.0, and bf16 compute:

- ``dtrain``: ``HybridParallel`` with ``dp = N`` as ``dtrain train`` runs it, ``torch.autocast(bf16)`` around
  forward and loss, gradients averaged in float32 by :class:`~dtrain.parallel.data_parallel.DataParallel`
  (buckets overlapped with backward, the all-reduce the backend's own: NCCL);
- ``dtrain-auto``: the same with the all-reduce algorithm chosen by dtrain's ``auto`` rule;
- ``dtrain-bf16-reduce``: ``dtrain`` with the gradients averaged in bf16;
- ``dtrain-zero1``, ``-zero2``, ``-zero3``: ``dtrain`` with ZeRO stage 1 (optimizer state sharded over the GPUs),
  2 (and gradients) or 3 (and parameters: each block a unit gathered in bf16 while it computes, float32 shards);
- ``ddp``: ``DistributedDataParallel`` (default 25 MiB buckets) with the same autocast;
- ``fsdp2``: ``fully_shard`` on each block and on the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=float32)`` (parameters gathered and computed in bf16, gradients reduce-scattered in float32).

The variants run one after another, each in its own launch (``--variants`` names one; ``--out`` gathers them:
each launch appends its record and prints every variant's ratio to DDP found in the file so far); each warms up
``--warmup`` steps,
then ``--steps`` steps are timed between CUDA synchronisations, the slowest rank's time counted. Reported per
variant: step time, tokens/s over all GPUs, model FLOPs utilisation (:func:`dtrain.models.train_flops_per_token`
over the devices' dense bf16 peak, :func:`dtrain.train.metrics.peak_flops`), peak memory, final loss, and the
ratio to DDP.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.models import build, parameter_count, preset, train_flops_per_token
from dtrain.models.decoder import Block
from dtrain.parallel.grid import ParallelDims, RankGrid
from dtrain.parallel.hybrid import HybridParallel
from dtrain.train.metrics import peak_flops
from dtrain.train.optim import adamw

VARIANTS = (
    "dtrain",
    "dtrain-auto",
    "dtrain-bf16-reduce",
    "dtrain-zero1",
    "dtrain-zero2",
    "dtrain-zero3",
    "ddp",
    "fsdp2",
)
SEED = 0


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


_compiled_loss = torch.compile(_loss)


def _config(args: argparse.Namespace):
    """The preset, with the head untied from the embedding on request (the shape torchtitan's Llama 3 trains)."""
    overrides = {"tie_word_embeddings": False} if args.untied else {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    return preset("llama", args.preset, **overrides)


def _model(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(SEED)
    model = build(_config(args), device=device)
    if args.activation_checkpointing != "none":
        from dtrain.parallel.recompute import checkpoint_activations

        model = checkpoint_activations(model, args.activation_checkpointing)
    if args.compile:  # each block on its own, before any wrapper, as torchtitan applies it
        for module in model.modules():
            if isinstance(module, Block):
                module.compile()
    return model


def _optimizer(named, lr: float):
    return adamw(named, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


class _Variant:
    """One way of training: ``step(x, y) -> loss`` on this rank's rows."""

    def __init__(self, name: str, args: argparse.Namespace, grid: RankGrid, device: torch.device) -> None:
        self.name = name
        self.loss = _compiled_loss if args.compile else _loss
        model = _model(args, device)
        bf16 = torch.bfloat16
        self.autocast = contextlib.nullcontext()
        if name.startswith("dtrain"):
            self.hybrid = HybridParallel(
                model,
                grid,
                lambda named: _optimizer(named, args.lr),
                device=device,
                autocast_dtype=bf16,
                reduce_dtype=bf16 if name == "dtrain-bf16-reduce" else None,
                algorithm="auto" if name == "dtrain-auto" else "native",
                zero_stage=int(name[-1]) if name.startswith("dtrain-zero") else 0,
            )
            return
        self.hybrid = None
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            self.autocast = torch.autocast(device.type, dtype=bf16)
        elif name == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
            for block in list(model)[1:-1]:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            self.model = model
        else:
            raise ValueError(f"--variants: unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        self.optimizer = _optimizer(list(model.named_parameters()), args.lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.hybrid is not None:
            return self.hybrid.train_step(x, y, self.loss, local=True, max_grad_norm=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.loss(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.detach()


def _time(variant: _Variant, batches, args: argparse.Namespace) -> dict:
    cuda = batches[0][0].is_cuda
    for x, y in batches[: args.warmup]:
        variant.step(x, y)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches[args.warmup :]:
        loss = variant.step(x, y)
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], device=x.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    loss = loss.float().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0], device=x.device, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"step_s": elapsed.item() / args.steps, "loss": loss.item(), "peak_memory_gib": peak.item() / 2**30}


def _profile(variant: _Variant, batches, path: str, rank: int) -> None:
    """Three steps under torch.profiler; rank 0 writes the operators and kernels by total device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if batches[0][0].is_cuda else [])
    with profile(activities=activities) as prof:
        for x, y in batches:
            variant.step(x, y)
        if batches[0][0].is_cuda:
            torch.cuda.synchronize()
    if rank == 0:
        key = "self_device_time_total" if batches[0][0].is_cuda else "self_cpu_time_total"
        with open(path, "a") as f:
            table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
            f.write(f"== {variant.name}{' compiled' if variant.loss is _compiled_loss else ''}\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", help="a llama preset of dtrain.models.presets (default: 1b)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-per-gpu", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--compile", action="store_true", help="torch.compile each block and the loss")
    parser.add_argument("--layers", type=int, default=None, help="the preset's width with this many blocks")
    parser.add_argument("--untied", action="store_true", help="a head of its own, not the embedding's weight")
    parser.add_argument(
        "--activation-checkpointing",
        default="none",
        choices=("none", "full", "selective"),
        help="recompute each block's activations in backward (dtrain.parallel.recompute), for every variant",
    )
    parser.add_argument("--profile", default=None, help="after timing, profile 3 steps; rank 0 writes the table here")
    parser.add_argument("--out", default=None, help="JSON lines, one per variant")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # a CPU check of the script itself (Gloo); its timings mean nothing for GPUs
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid.build(ParallelDims(world_size=world, dp=world, pp=1, tp=1))
    config = _config(args)
    gen = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(config.vocab_size, (world * args.batch_per_gpu, args.seq_len + 1), generator=gen)
        mine = tokens[rank * args.batch_per_gpu : (rank + 1) * args.batch_per_gpu].to(device)
        batches.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    tokens_per_step = world * args.batch_per_gpu * args.seq_len
    flops = train_flops_per_token(config, args.seq_len)
    peak = peak_flops(device)
    records = []
    for name in variants:
        variant = _Variant(name, args, grid, device)
        result = _time(variant, batches, args)
        if args.profile:
            _profile(variant, batches[-3:], args.profile, rank)
        del variant
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tokens_per_s = tokens_per_step / result["step_s"]
        record = {
            "variant": name,
            "preset": args.preset,
            "layers": config.num_hidden_layers,
            "parameters": parameter_count(config),
            "gpus": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "seq_len": args.seq_len,
            "batch_per_gpu": args.batch_per_gpu,
            "compile": args.compile,
            "tied_embeddings": config.tie_word_embeddings,
            "activation_checkpointing": args.activation_checkpointing,
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops / (world * peak) if peak else None,
            **result,
        }
        records.append(record)
        if rank == 0:
            mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else "n/a"
            print(
                f"{name:20s} {result['step_s'] * 1e3:8.1f} ms/step {tokens_per_s:10.0f} tok/s  MFU {mfu}  "
                f"peak {result['peak_memory_gib']:.1f} GiB  loss {result['loss']:.4f}",
                flush=True,
            )
    if rank == 0 and args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        everything = [json.loads(line) for line in path.read_text().splitlines()]
        for compiled in (False, True):
            same = [r for r in everything if r.get("compile", False) == compiled]
            # the latest DDP launch in the file: the one nearest in time to the launches it is compared with
            base = next((r["tokens_per_s"] for r in reversed(same) if r["variant"] == "ddp"), None)
            for r in same if base else ():
                label = r["variant"] + (" compiled" if compiled else "")
                print(f"{label:28s} {r['tokens_per_s'] / base:.3f}x DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
