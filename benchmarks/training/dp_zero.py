"""Usage: torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py [--sections dp zero] [--out F] [--profile DIR]

Data parallel and ZeRO, ours against torch's DDP and ZeroRedundancyOptimizer, in one launch.

    torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections dp --batch-per-rank 16 32 \
        --out benchmarks/results/dp_zero-h100x4.jsonl                                            # GPUs, NCCL
    python benchmarks/training/dp_zero.py --nproc 2 --layers 2 --embd 64 --heads 2 --vocab 256 --block 32 ...  # CPU

The model (:class:`GPT`): GPT-2 (Radford et al. 2019) as nanoGPT writes it, pre-norm blocks of causal
self-attention (``scaled_dot_product_attention``) and a 4x GELU MLP, learned positions, and a vocabulary head
of its own (not tied to the token embedding). The defaults, 12 layers, width 768, 12 heads, a 32768-token
vocabulary and 512-token context, make 135.8 M parameters (each record's ``parameters``). The forward runs in
``torch.autocast`` bf16 (``--autocast none``: float32); parameters, gradients and AdamW's state are float32.
The batches: uniform random token ids from a generator seeded by the rank, inputs and next-token targets from
one ``(B, block + 1)`` draw (a step's speed does not depend on the text).

**Scaling** (``--sizes 1 2 4``): for each k and each of ``--batch-per-rank`` (sequences a rank: weak scaling),
ranks 0..k-1 train the model with AdamW as :class:`DataParallel` with its defaults (``ours-auto``) and with
``algorithm="native"`` (``ours-native``), with its defaults and AdamW stepped inside backward
(``ours-overlap``: :meth:`DataParallel.overlap_optimizer`, every bucket's parameters but the last's stepped
while the last bucket is reduced), as ``DistributedDataParallel`` with its defaults (``ddp``:
``gradient_as_bucket_view=False``) and with ``gradient_as_bucket_view=True`` (``ddp-view``), with the buckets
moved by copy engines through peer channels (``ours-copy-engine``: ``DataParallel(exchange="copy-engine")``),
and as the plain
module on each rank with no communication at all (``local``: every GPU trains its own copy, so its scaling is
what the host allows any data parallel with these GPUs and processes), timed in rotating turns
(:func:`timing.time_variants`). Scaling efficiency: tokens/s per rank over the 1-rank tokens/s of the same
batch; ``ratio_vs_ddp``: DDP's step time (its defaults) over the variant's.

**ZeRO** (every rank, the first ``--batch-per-rank``): plain data parallel (ours, DDP), ZeRO stage 1 and 2
(:class:`ZeroOptimizer`) and DDP with torch's ``ZeroRedundancyOptimizer`` (its stage 1), one after another:
step time and peak GPU memory of a step.

``--graphs`` (GPUs) adds each way of training with forward, loss and backward recorded as one CUDA graph at the
third step and replayed (:class:`~dtrain.parallel.step_graph.GraphedStep`; the optimizer steps eagerly after each
replay): ``ours-graph`` (:class:`DataParallel` with its defaults, whose bucket all-reduces run inside the recorded
backward), ``ours-copy-engine-graph``, ``local-graph`` and, on one GPU, ``single-graph``, against which the recorded
variants' scaling is taken (``scaling_vs_eager_single``: against ``single``); and the same with a capturable AdamW
stepped inside the recording (``-graph-whole``: ``ours-graph-whole`` and ``ours-copy-engine-graph-whole`` step it
within backward, every bucket's parameters but the last's while the last bucket is reduced,
:meth:`DataParallel.overlap_optimizer`), taken against ``single-graph-whole``.

``--optimizer fused`` gives every variant (ZeRO's aside) AdamW's one-kernel implementation (``fused=True``)
instead of torch's multi-tensor default (``foreach``); each record names the one it ran.

Every variant starts from the same weights and sees the same batches, so all must end with the same
parameters: the script checks each against DDP (``max_abs_param_diff_vs_ddp``), ``local`` aside.

``--profile DIR``: after the scaling section's timing, ``--profile-steps`` steps of ``single`` (1 rank) and of
``ours-auto``, ``ours-overlap`` and ``ddp`` (every rank of the largest size) run under ``torch.profiler``, and
rank 0 writes ``DIR/<variant>-<k>ranks-b<batch>.txt``: the host's time to enqueue a step beside the step's, the
host's Python functions by their own time (cProfile), where the device time goes (:mod:`trace_summary`: busy,
compute, communication and how much of it is exposed, idle) and the operators' table by device time;
``--profile-trace`` keeps the Chrome trace beside it.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import timing as pt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from dtrain.launch import run_ranks
from dtrain.parallel import step_graph
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeroOptimizer


class GPT(nn.Module):
    """GPT-2 with an untied vocabulary head: ``layers`` blocks of width ``embd`` with ``heads`` heads."""

    def __init__(self, vocab: int, block: int, layers: int, embd: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, embd)
        self.wpe = nn.Embedding(block, embd)
        self.blocks = nn.ModuleList(Block(embd, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Block(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(embd), nn.LayerNorm(embd)
        self.qkv, self.proj = nn.Linear(embd, 3 * embd), nn.Linear(embd, embd)
        self.fc, self.out = nn.Linear(embd, 4 * embd), nn.Linear(4 * embd, embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


def _model(args, device: torch.device | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(args.vocab, args.block, args.layers, args.embd, args.heads).to(device or pt.device())


def _batch(args, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(args.vocab, (batch, args.block + 1), generator=gen).to(pt.device())
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) each


def _step_fn(model, optimizer, batch, args):
    x, y = batch
    dev = pt.device()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), y.reshape(-1))
        loss.backward()
        optimizer.step()

    return step


def _graphed_step_fn(model, optimizer, batch, args, whole: bool = False):
    """As :func:`_step_fn`, with forward, loss and backward (and DataParallel's bucket all-reduces, which run
    inside backward) recorded as one CUDA graph at the third call (:class:`GraphedStep`); the optimizer steps
    eagerly after each replay, as in every other variant. ``whole``: the optimizer (capturable) steps inside the
    recording too, within backward where DataParallel overlaps it (:meth:`DataParallel.overlap_optimizer`), after
    backward otherwise."""
    x, y = batch
    dev = pt.device()
    autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16")  # noqa: E731
    params = [q for q in model.parameters() if q.requires_grad]
    inside = whole and not isinstance(model, DataParallel)  # DataParallel steps it inside backward itself

    def forward_backward(x, y, *, recording: bool) -> torch.Tensor:
        context = (lambda: step_graph.uncached_within(autocast, params[0])) if recording else autocast
        with context():
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), y.reshape(-1))
        loss.backward()
        if inside:
            optimizer.step()
        return loss.detach()

    graphed = step_graph.GraphedStep(forward_backward, params, dev)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        graphed(x, y)
        if not whole:
            optimizer.step()

    return step


def _adamw(params, args, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW as ``--optimizer`` implements it (torch's multi-tensor ``foreach`` or its single ``fused`` kernel),
    every variant alike; ``capturable``: steppable inside a CUDA graph recording."""
    fused = args.optimizer == "fused"
    return torch.optim.AdamW(params, lr=1e-4, capturable=capturable, fused=fused or None, foreach=not fused or None)


def _wrap(variant: str, base, group, args):
    model = copy.deepcopy(base).to(pt.device())
    dev = pt.device()
    if variant in ("single", "local", "single-graph", "local-graph"):
        return model, _adamw(model.parameters(), args)
    if variant in ("single-graph-whole", "local-graph-whole"):
        return model, _adamw(model.parameters(), args, capturable=True)
    if variant in ("ours-graph-whole", "ours-copy-engine-graph-whole"):
        exchange = "copy-engine" if "copy-engine" in variant else "collective"
        dp = DataParallel(model, group, exchange=exchange)
        optimizer = _adamw(dp.parameters(), args, capturable=True)
        dp.overlap_optimizer(optimizer)
        return dp, optimizer
    if variant == "ours-overlap":
        dp = DataParallel(model, group)
        optimizer = _adamw(dp.parameters(), args)
        dp.overlap_optimizer(optimizer)
        return dp, optimizer
    if variant in ("ours-copy-engine", "ours-copy-engine-graph"):
        dp = DataParallel(model, group, exchange="copy-engine")
        return dp, _adamw(dp.parameters(), args)
    if variant.startswith("ours-"):
        dp = DataParallel(model, group, algorithm="auto" if variant == "ours-graph" else variant.removeprefix("ours-"))
        return dp, _adamw(dp.parameters(), args)
    ddp = DistributedDataParallel(
        model,
        device_ids=[dev] if dev.type == "cuda" else None,
        process_group=group,
        gradient_as_bucket_view=variant == "ddp-view",
    )
    if variant == "ddp+zero-torch":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, process_group=group, lr=1e-4)
    if variant in ("zero1-ours", "zero2-ours"):
        stage = int(variant[4])
        return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, group, stage=stage, lr=1e-4)
    return ddp, _adamw(ddp.parameters(), args)


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
        for per_rank in args.batch_per_rank:
            dist.barrier()
            if rank >= k:
                continue
            base, batch = _model(args), _batch(args, rank, per_rank)
            multi = ("ours-auto", "ours-overlap", "ours-native", "ours-copy-engine", "ddp", "ddp-view", "local")
            one = ("single",)
            if args.graphs:
                multi = (*multi, "ours-graph", "ours-copy-engine-graph", "local-graph", "ours-graph-whole")
                multi = (*multi, "ours-copy-engine-graph-whole", "local-graph-whole")
                one = (*one, "single-graph", "single-graph-whole")
            variants = one if k == 1 else multi
            if args.variants:  # DDP stays: every variant's parameters are checked against it
                variants = tuple(v for v in variants if v in args.variants or v in ("ddp", "single"))
            _arm(args, f"scaling on {k} ranks, {per_rank} sequences a rank")
            built = {v: _wrap(v, base, group, args) for v in variants}
            steps = {
                v: _graphed_step_fn(*built[v], batch, args, whole=v.endswith("-whole"))
                if "-graph" in v
                else _step_fn(*built[v], batch, args)
                for v in variants
            }
            seconds = pt.time_variants(steps, warmup=args.warmup, iters=args.iters, trials=args.trials, group=group)
            final = {v: _params(built[v][0]) for v in variants}
            if args.profile and (k == 1 or k == max(groups)):
                for v in (
                    [v for v in ("single", "single-graph") if v in variants]
                    if k == 1
                    else [
                        v
                        for v in (
                            "ours-auto",
                            "ours-overlap",
                            "ddp",
                            "ours-graph",
                            "ours-copy-engine-graph",
                            "local-graph",
                        )
                        if v in variants
                    ]
                ):
                    _profile(steps[v], args, f"{v}-{k}ranks-b{per_rank}", group)
            for v in variants:
                diff = _max_diff(final[v], final["ddp"]) if k > 1 and not v.startswith("local") else None
                tokens = k * per_rank * args.block
                records.append(
                    {
                        "section": "dp",
                        "variant": v,
                        "ranks": k,
                        "batch_per_rank": per_rank,
                        "step_s": seconds[v],
                        "tokens_per_s": tokens / seconds[v],
                        "max_abs_param_diff_vs_ddp": diff,
                    }
                )
            del built, steps, final
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return records


def _profile(step, args, name: str, group) -> None:
    """Run ``--profile-steps`` calls of ``step`` under torch.profiler on every rank of ``group``; rank 0 writes the
    operators' table and the device-time summary (:mod:`trace_summary`) under ``--profile``, with the host's
    time to enqueue a step (the step's Python returning, with the device still running) beside the step's time
    (with ``--profile-trace``, the Chrome trace too). Each file is written under a temporary name, then renamed."""
    from torch.profiler import ProfilerActivity, profile
    from trace_summary import format_summary, summarize

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    host = []
    pt.sync()
    dist.barrier(group=group)
    for _ in range(args.profile_steps):  # unprofiled: the host's enqueue time and the step's time
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        pt.sync()
        host.append(time.perf_counter() - start)
    import cProfile
    import io
    import pstats

    host_profile = cProfile.Profile()
    pt.sync()
    host_profile.enable()
    for _ in range(args.profile_steps):
        step()
    pt.sync()
    host_profile.disable()
    pt.sync()
    dist.barrier(group=group)
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        pt.sync()
    if dist.get_rank() != 0:
        return
    args.profile.mkdir(parents=True, exist_ok=True)
    trace = args.profile / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace) + ".tmp")
    events = json.loads(Path(str(trace) + ".tmp").read_text())["traceEvents"]
    if args.profile_trace:
        os.replace(str(trace) + ".tmp", trace)
    else:
        os.remove(str(trace) + ".tmp")
    enqueue, whole = statistics.median(host[0::2]), statistics.median(host[1::2])
    text = (
        f"{name}: {args.profile_steps} steps on rank 0; unprofiled, the host enqueues a step in "
        f"{enqueue * 1e3:.2f} ms of its {whole * 1e3:.2f} ms (median)\n"
    )
    functions = io.StringIO()
    pstats.Stats(host_profile, stream=functions).sort_stats("tottime").print_stats(20)
    text += "host functions (cProfile, tottime):\n" + functions.getvalue().split("\n\n", 1)[-1].strip() + "\n"
    if torch.cuda.is_available():
        operators = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        text += format_summary(name, summarize(events, args.profile_steps)) + "\n" + operators
    (args.profile / f"{name}.txt.tmp").write_text(text + "\n")
    os.replace(args.profile / f"{name}.txt.tmp", args.profile / f"{name}.txt")
    print(text.split("\n    ")[0], file=sys.stderr, flush=True)


def _zero(args) -> list[dict]:
    group, rank = dist.group.WORLD, dist.get_rank()
    # the template on the host: a variant's peak counts its own copy, not one every variant is made from
    base, batch = _model(args, torch.device("cpu")), _batch(args, rank, args.batch_per_rank[0])
    records, reference = [], None
    for v in ("ddp", "ours-auto", "zero1-ours", "zero2-ours", "ddp+zero-torch"):
        _arm(args, f"zero section, {v}")
        model, optimizer = _wrap(v, base, group, args)
        step = _step_fn(model, optimizer, batch, args)
        seconds = pt.time_variants({v: step}, warmup=args.warmup, iters=args.iters, trials=args.trials)[v]
        peak = pt.peak_memory(step)
        final = _params(model)
        reference = final if v == "ddp" else reference
        record = {
            "section": "zero",
            "variant": v,
            "ranks": dist.get_world_size(),
            "batch_per_rank": args.batch_per_rank[0],
            "step_s": seconds,
            "peak_memory_bytes": peak,
            "peak_memory_scope": "variant",
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


def _kind(variant: str) -> str:
    """How a variant runs its step: "" eagerly, "-graph" recorded, "-graph-whole" recorded with its optimizer."""
    return next((k for k in ("-graph-whole", "-graph") if variant.endswith(k)), "")


def _rank_main(args) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = True
    groups = pt.subgroups(tuple(args.sizes))
    records = _scaling(args, groups) if "dp" in args.sections else []
    records += _zero(args) if "zero" in args.sections else []
    faulthandler.cancel_dump_traceback_later()
    params = sum(p.numel() for p in _model(args).parameters())
    # scaling against one GPU run the same way: a recorded variant against single-graph (single-graph-whole where
    # the optimizer is recorded too), the others against single
    one = {
        (r["batch_per_rank"], _kind(r["variant"])): r["tokens_per_s"]
        for r in records
        if r["section"] == "dp" and r["ranks"] == 1
    }
    ddp = {(r["section"], r["ranks"], r["batch_per_rank"]): r["step_s"] for r in records if r["variant"] == "ddp"}
    for r in records:
        key = (r["section"], r["ranks"], r["batch_per_rank"])
        r |= {
            "parameters": params,
            "vocab": args.vocab,
            "block": args.block,
            "autocast": args.autocast,
            "optimizer": args.optimizer,
        }
        r["ratio_vs_ddp"] = ddp[key] / r["step_s"] if key in ddp else None
        if r["section"] == "dp" and (r["batch_per_rank"], _kind(r["variant"])) in one:
            per_gpu = r["tokens_per_s"] / r["ranks"]
            r["scaling_efficiency"] = per_gpu / one[r["batch_per_rank"], _kind(r["variant"])]
            if (r["batch_per_rank"], "") in one:  # against one GPU run eagerly, the plain loop
                r["scaling_vs_eager_single"] = per_gpu / one[r["batch_per_rank"], ""]
        r |= pt.machine()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks (ignored under torchrun)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--block", type=int, default=512, help="context (tokens a sequence)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch-per-rank", type=int, nargs="+", default=[16, 32], help="sequences a rank (each timed)")
    p.add_argument("--autocast", choices=["bf16", "none"], default="bf16", help="the forward's autocast dtype")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sections", nargs="+", choices=["dp", "zero"], default=["dp", "zero"])
    p.add_argument("--variants", nargs="+", default=None, help="time only these (ddp and single always)")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time each step recorded as one CUDA graph (ours-graph, local-graph, single-graph; GPUs only)",
    )
    p.add_argument(
        "--optimizer",
        choices=["foreach", "fused"],
        default="foreach",
        help="AdamW for every variant (ZeRO's aside): multi-tensor (torch's default) or one fused kernel",
    )
    p.add_argument("--stall-s", type=float, default=0, help="dump every stack and exit after this long (0: never)")
    p.add_argument("--profile", type=Path, default=None, help="write torch.profiler traces of ours and DDP here")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-trace", action="store_true", help="keep the Chrome traces beside the summaries")
    args = p.parse_args()
    small = {k: getattr(args, k) for k in ("layers", "embd", "heads", "block", "vocab", "profile_steps")}
    if min(small.values()) < 1 or min(args.batch_per_rank) < 1 or args.embd % args.heads:
        p.error(
            f"--layers/--embd/--heads/--block/--vocab/--batch-per-rank/--profile-steps must be >= 1 and --heads "
            f"must divide --embd; got {small} and --batch-per-rank {args.batch_per_rank}"
        )
    if args.graphs and not torch.cuda.is_available():
        p.error("--graphs records CUDA graphs; this machine has no GPU")
    if args.profile is not None and args.profile.exists() and not args.profile.is_dir():
        p.error(f"--profile {args.profile}: exists and is not a directory")
    records = run_ranks(_rank_main, args.nproc, args)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank returns the records; rank 0 reports
        return
    for r in records:
        print(json.dumps({k: v for k, v in r.items() if k not in ("hostname",)}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
