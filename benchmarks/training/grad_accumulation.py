"""Usage: python benchmarks/training/grad_accumulation.py [--width 4096] [--rows 64,256,1024,4096] [--iters 50]
[--out FILE]

One linear layer's weight gradient accumulated over micro-batches, on one GPU, two ways:

- ``autograd``: the product made in a temporary, then added into ``.grad`` by a second pass (what autograd's
  gradient accumulator does; under bf16 autocast the bf16 product is cast to float32 first, as the cast's
  backward does);
- ``fused``: the product added into ``.grad`` by the GEMM itself, beta = 1
  (:func:`dtrain.parallel.weight_gradients._fused_accumulate`: ``addmm_``, or ``addmm`` with ``out_dtype`` for
  16-bit operands into a float32 gradient).

For each operand dtype (float32; bf16 into a float32 gradient) and micro-batch rows, the median microseconds of
one accumulation (``--iters`` back to back between two synchronizations, five rounds, the two ways alternating),
the ratio, and the largest difference of the fused result from a float64 reference beside the autograd one's.
Rank 0 prints a line a row and appends JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dtrain.parallel.weight_gradients import _fused_accumulate


def _timed(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rows", type=lambda t: [int(x) for x in t.split(",")], default=[64, 256, 1024, 4096])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    n = args.width
    weight = torch.nn.Parameter(torch.zeros(n, n, device=device))
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            gen = torch.Generator(device="cpu").manual_seed(rows)
            x = (torch.randn(rows, n, generator=gen) / n**0.5).to(device, dtype)
            g = (torch.randn(rows, n, generator=gen) / n**0.5).to(device, dtype)
            start = torch.randn(n, n, generator=gen).to(device)

            def autograd_way(x=x, g=g) -> None:  # noqa: ANN001
                weight.grad += (g.t() @ x).to(torch.float32)

            def fused_way(x=x, g=g, dtype=dtype) -> None:  # noqa: ANN001
                if not _fused_accumulate(weight, x, g):
                    raise RuntimeError(f"no fused accumulation for {dtype} operands into a float32 gradient")

            errors = {}
            want = start.double() + g.t().double() @ x.double()
            for name, fn in (("autograd", autograd_way), ("fused", fused_way)):
                weight.grad = start.clone()
                fn()
                errors[name] = (weight.grad.double() - want).abs().max().item()
            times: dict[str, list[float]] = {"autograd": [], "fused": []}
            weight.grad = start.clone()
            for _ in range(5):
                for name, fn in (("autograd", autograd_way), ("fused", fused_way)):
                    times[name].append(_timed(fn, args.iters))
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "grad_dtype": "float32",
                "rows": rows,
                "width": n,
                "autograd_us": round(statistics.median(times["autograd"]), 2),
                "fused_us": round(statistics.median(times["fused"]), 2),
                "autograd_max_error": errors["autograd"],
                "fused_max_error": errors["fused"],
                "device": torch.cuda.get_device_name(device),
                "torch_version": torch.__version__,
            }
            row["speedup"] = round(row["autograd_us"] / row["fused_us"], 3)
            print(
                f"{row['dtype']:>8} -> float32, {rows:>5} rows x {n}: autograd {row['autograd_us']:8.1f} us, fused "
                f"{row['fused_us']:8.1f} us ({row['speedup']:.2f}x); max error {errors['autograd']:.2e} / "
                f"{errors['fused']:.2e}",
                flush=True,
            )
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
