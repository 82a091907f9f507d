"""Usage: python benchmarks/training/sustained_products.py [--seconds 3] [--hidden H --ffn F --tokens T --tp P]
[--out FILE] [--write-curves PATH]

Does a GPU run a transformer layer's matrix products as fast for seconds on end as for one call? For the
products of one layer (by default GPT-3 175B's on tensor-parallel 4 with micro-batch 1 and sequence 2048, the
MLPerf Training layout; forward, input and weight gradients), in bf16 and, where the device has it, FP8
(``torch._scaled_mm`` on E4M3 operands), three timings side by side:

- ``device``: one call issued behind a sleep kernel, CUDA events around it (``dtrain bench compute``'s way);
- ``launch``: one call with events around it, issued while the GPU waits (the host's launch counted);
- ``sustained``: the layer's products one after another for ``--seconds`` (after as long again to warm up), the
  GPU never idle (each pass queued before the one before it is waited for), the mean per product over the last
  window: what a training step's back-to-back products get once the clocks have settled under the power cap.

Each row: the product, its FLOPs, the three times and the sustained time over the device one, and the SM clock
and power ``nvidia-smi`` reports at the end of the sustained window. ``--write-curves PATH`` (the simulator's
``dtrain/sim/compute_curves.json``) stores under the device's ``"sustained"`` entry, for each precision, the
layer's sustained time over what the device's curves in that file price the same products at
(:func:`sustained_factors`), which the simulator then multiplies its products' compute by.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from dtrain.bench.compute import _timer, has_fp8


def _shapes(hidden: int, ffn: int, tokens: int, tp: int) -> list[tuple[str, int, int, int]]:
    products = (("qkv", 3 * hidden // tp, hidden), ("out", hidden, hidden // tp), ("mlp-in", ffn // tp, hidden),
                ("mlp-out", hidden, ffn // tp))  # fmt: skip
    shapes = []
    for what, n, k in products:
        shapes += [(what, tokens, n, k), (what + "-dgrad", tokens, k, n), (what + "-wgrad", k, n, tokens)]
    return shapes


def _product(m: int, n: int, k: int, fp8: bool):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        return lambda: torch.mm(a, b.t())
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _single(fn, device_pace: bool, repeats: int = 7) -> float:
    """One call's time, the median of ``repeats``: at the device's pace or launch-timed (``dtrain bench
    compute``'s timer)."""
    return _timer(torch, torch.device("cuda"), "device" if device_pace else "launch")(fn, 1, repeats)


def _sustained(fns: list, seconds: float) -> tuple[list[float], str]:
    """Every product of ``fns`` in turn, back to back, for ``seconds`` after as long of warm-up: the mean time of
    each over the last window, timed with events around whole passes; and nvidia-smi's clock and power then."""
    passes, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:  # warm up to the steady clock
        for fn in fns:
            fn()
        passes += 1
        if passes % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    for fn in fns:  # an untimed pass first: the first timed product starts behind work, not on an idle GPU
        fn()
    times = [0.0] * len(fns)
    counted, t_end, pending = 0, time.perf_counter() + seconds, None
    while time.perf_counter() < t_end or pending is not None:
        events = None
        if time.perf_counter() < t_end:  # the next pass is queued before the last one is waited for: no gap
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
            events[0].record()
            for i, fn in enumerate(fns):
                fn()
                events[i + 1].record()
        if pending is not None:
            pending[-1].synchronize()
            for i in range(len(fns)):
                times[i] += pending[i].elapsed_time(pending[i + 1]) / 1e3
            counted += 1
        pending = events
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    return [t / counted for t in times], smi


def sustained_factors(rows: list[dict], device_key: str, curves_path: str) -> dict[str, float]:
    """By curve (``matmul``, ``matmul-fp8``): the summed sustained time of ``rows``' products over what
    ``device_key``'s curves in ``curves_path`` price them at (with no sustained factor)."""
    from dataclasses import replace

    from dtrain.sim.compute import DEVICE_COMPUTE, device_compute, load_curves

    spec = DEVICE_COMPUTE[device_key]
    device = device_compute(spec.peak_flops, spec.memory_bytes_per_s, curves=load_curves(curves_path))
    device = replace(device, sustained=1.0, fp8_sustained=1.0)
    factors = {}
    for precision, kind in (("bf16", "matmul"), ("fp8", "matmul-fp8")):
        mine = [r for r in rows if r["precision"] == precision]
        if mine:
            priced = sum(device.matmul_s(r["m"], r["n"], r["k"], fp8=precision == "fp8") for r in mine)
            factors[kind] = sum(r["sustained_s"] for r in mine) / priced
    return factors


def _store_mean(paths: list[str], curves_path: str | None) -> None:
    """Store in ``curves_path`` each precision's mean over the factors of the ``--out`` files ``paths`` (one
    layer each), for the device they name."""
    from dtrain.bench.compute import device_key, write_curves

    if not curves_path:
        raise SystemExit("sustained_products.py: --factors needs --write-curves PATH")
    runs = [[json.loads(line) for line in Path(path).read_text().splitlines()] for path in paths]
    keys = {device_key(rows[0]["device"]) for rows in runs}
    if len(keys) != 1:
        raise SystemExit(f"sustained_products.py: --factors files name several devices {sorted(keys)}")
    key = keys.pop()
    per = [sustained_factors(rows, key, curves_path) for rows in runs]
    factors = {kind: statistics.mean(f[kind] for f in per) for kind in per[0]}
    names = ", ".join(path.rsplit("/", 1)[-1] for path in paths)
    note = f"benchmarks/training/sustained_products.py, the mean over {len(paths)} layers ({names})"
    write_curves(curves_path, key, {"sustained": factors}, note)
    for path, f in zip(paths, per, strict=True):
        print(f"{path}: " + ", ".join(f"{k} x{v:.3f}" for k, v in f.items()))
    print("stored the mean: " + ", ".join(f"{k} x{v:.3f}" for k, v in factors.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--hidden", type=int, default=12288, help="the layer's width (default GPT-3 175B's)")
    ap.add_argument("--ffn", type=int, default=49152, help="the MLP's width")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a micro-batch (micro-batch x sequence)")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks the layer is split over")
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-curves", default=None, metavar="PATH", help="store the sustained factors in PATH")
    ap.add_argument("--factors", nargs="+", default=None, metavar="FILE",
                    help="measure nothing: store in --write-curves the mean of these --out files' factors")  # fmt: skip
    args = ap.parse_args()
    if args.factors:
        return _store_mean(args.factors, args.write_curves)
    name = torch.cuda.get_device_name()
    rows = []
    for fp8 in (False, True) if has_fp8(torch, torch.device("cuda")) else (False,):
        shapes = _shapes(args.hidden, args.ffn, args.tokens, args.tp)
        fns = [_product(m, n, k, fp8) for _, m, n, k in shapes]
        single = [(_single(fn, True), _single(fn, False)) for fn in fns]
        sustained, smi = _sustained(fns, args.seconds)
        for (what, m, n, k), (device, launch), kept in zip(shapes, single, sustained, strict=True):
            rows.append({"device": name, "precision": "fp8" if fp8 else "bf16", "op": what, "m": m, "n": n, "k": k,
                         "layer": {"hidden": args.hidden, "ffn": args.ffn, "tokens": args.tokens, "tp": args.tp},
                         "flops": 2.0 * m * n * k, "device_s": device, "launch_s": launch, "sustained_s": kept,
                         "sustained_over_device": kept / device, "smi_after_sustained": smi,
                         "sustained_seconds": args.seconds})  # fmt: skip
        total = [sum(r[key] for r in rows[-len(shapes) :]) for key in ("device_s", "launch_s", "sustained_s")]
        print(
            f"{'fp8' if fp8 else 'bf16'}: one layer's products {total[0] * 1e3:.3f} ms at the device's pace, "
            f"{total[1] * 1e3:.3f} launch-timed, {total[2] * 1e3:.3f} sustained for {args.seconds:.0f} s "
            f"(x{total[2] / total[0]:.3f}; clock, power then: {smi})",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.write_curves:
        from dtrain.bench.compute import device_key, write_curves

        key = device_key(name)
        factors = sustained_factors(rows, key, args.write_curves)
        note = f"benchmarks/training/sustained_products.py --seconds {args.seconds:g} on {name}"
        write_curves(args.write_curves, key, {"sustained": factors}, note)
        print("sustained factors: " + ", ".join(f"{k} x{v:.3f}" for k, v in factors.items()))


if __name__ == "__main__":
    main()
