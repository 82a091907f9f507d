"""What dtrain's layout-independent dropout costs a training step, beside torch's own dropout, in one launch.

GPT-2 small (124 M parameters, ``dtrain.models`` preset ``124m``), batch of ``--batch`` sequences of 1,024 tokens,
bf16 autocast, fused AdamW, one optimizer step a call, on this GPU, eager and with each block compiled (as
``dtrain train --compile`` compiles them). Variants, timed in rotating turns:

- ``none``: every dropout probability 0;
- ``torch``: 0.1 everywhere (embedding, attention probabilities, both residual branches) drawn by torch's
  generator (``nn.Dropout``, and the fused attention kernel's own dropout);
- ``dtrain``: 0.1 everywhere drawn by :mod:`dtrain.models.dropout` (a hash of the step, the site and each value's
  place in the global batch), the attention probabilities dropped inside dtrain's flash-attention kernel
  (:mod:`dtrain.models.attention_kernel`), as the model runs on a GPU;
- ``dtrain-written-out``: the same masks, the attention written out (``Attention.flash_dropout`` False: scores,
  softmax, the ``Dropout`` module, the product with the values), the path the kernel replaces and is checked
  against;
- ``dtrain-no-attention``: 0.1 on the embedding and residual branches, 0 on the attention probabilities, so the
  fused attention kernel runs.

Before timing it checks on this device that the CUDA masks are the CPU's, bit for bit, that the model on the
whole batch and on four pieces (each under its rows) gives the same logits, and how far the logits of the model
in float32 through the kernel are from those through the written-out attention. Rows: ms a step (median of
``--trials`` runs of ``--iters`` steps), tokens/s, peak memory, and each variant's time over ``torch``'s.

    python benchmarks/training/dropout_cost.py --out benchmarks/results/dropout_cost-h200x1.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import torch

from dtrain.models import dropout as dropouts
from dtrain.models import preset
from dtrain.models.decoder import Attention, Block, build

SEQ = 1024


def _model(p: float, attention: bool, device: torch.device, compiled: bool, flash: bool = True) -> torch.nn.Module:
    config = dataclasses.replace(
        preset("gpt2", "124m"), resid_pdrop=p, embd_pdrop=p, attn_pdrop=p if attention else 0.0, n_positions=SEQ
    )
    torch.manual_seed(0)
    model = build(config, device=device)
    for module in model.modules():
        if isinstance(module, Attention):
            module.flash_dropout = flash
    if compiled:
        for module in model.modules():
            if isinstance(module, Block):
                module.compile()
    return model


def _checks(device: torch.device) -> dict:
    dropouts.set_step(3, 7)
    shape = (4, 12, 256, 256)
    on_device = dropouts.keep_mask(shape, 0.1, 5, device, offsets=(0, 3)).cpu()
    on_cpu = dropouts.keep_mask(shape, 0.1, 5, "cpu", offsets=(0, 3))
    model = _model(0.1, True, device, False)
    x = torch.randint(0, model.config.vocab_size, (8, SEQ), device=device)
    with torch.no_grad():
        whole = model(x)
        pieces = []
        for i, piece in enumerate(x.chunk(4)):
            with dropouts.rows(2 * i):
                pieces.append(model(piece))
        written = _model(0.1, True, device, False, flash=False)(x)
    dropouts.untracked()
    return {
        "masks_equal_cpu": bool(torch.equal(on_device, on_cpu)),
        "kept": on_cpu.float().mean().item(),
        "pieces_max_abs_diff": (torch.cat(pieces) - whole).abs().max().item(),
        "written_out_max_abs_diff": (written - whole).abs().max().item(),
        "logits_max_abs": whole.abs().max().item(),
    }


def _step_fn(model, opt, x, y, tracked: bool, counter: list[int]):
    def step() -> None:
        if tracked:
            dropouts.set_step(0, counter[0])
        counter[0] += 1
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracked:
            dropouts.untracked()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", default="eager,compiled")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dropout_cost.py: needs a CUDA GPU")
    device = torch.device("cuda")
    machine = {
        "hostname": platform.node(),
        "device": torch.cuda.get_device_name(),
        "torch_version": torch.__version__,
        "batch": args.batch,
        "seq_len": SEQ,
    }
    rows = [{"kind": "check", **machine, **_checks(device)}]
    print(json.dumps(rows[0]), file=sys.stderr, flush=True)
    variants = {  # p, attention dropout, tracked, flash kernel
        "none": (0.0, True, False, True),
        "torch": (0.1, True, False, True),
        "dtrain": (0.1, True, True, True),
        "dtrain-written-out": (0.1, True, True, False),
        "dtrain-no-attention": (0.1, False, True, True),
    }
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (args.batch, SEQ + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for mode in args.modes.split(","):
        steps, models = {}, {}
        for name, (p, attention, tracked, flash) in variants.items():
            model = _model(p, attention, device, mode == "compiled", flash)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            models[name] = model
            steps[name] = _step_fn(model, opt, x, y, tracked, [0])
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            print(f"{mode} {name}: warm-up {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        names = list(steps)
        runs: dict[str, list[float]] = {n: [] for n in names}
        for trial in range(args.trials):
            for name in names[trial % len(names) :] + names[: trial % len(names)]:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.iters):
                    steps[name]()
                torch.cuda.synchronize()
                runs[name].append((time.perf_counter() - start) / args.iters)
        peaks = {}
        for name, step in steps.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated()
        torch_s = statistics.median(runs["torch"])
        for name in names:
            s = statistics.median(runs[name])
            row = {
                "kind": "step",
                **machine,
                "mode": mode,
                "variant": name,
                "step_ms": s * 1e3,
                "runs_ms": [r * 1e3 for r in runs[name]],
                "tokens_per_s": args.batch * SEQ / s,
                "peak_gib": peaks[name] / 2**30,
                "over_torch": s / torch_s,
            }
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("mode", "variant", "step_ms", "over_torch", "peak_gib")}), flush=True)
        del steps, models
        torch.cuda.empty_cache()
    with open(args.out, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
