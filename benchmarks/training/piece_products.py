"""The matrix products of one GPT-3 175B layer at tensor-parallel degree 4 as Transformer Engine's userbuffers cut
them, timed on this GPU beside what the simulator prices them at.

MLPerf's GPT-3 175B (hidden 12,288, MLP 49,152, sequence 2,048, tp 4, sequence parallelism) runs each product
beside a tensor-parallel collective in pieces (``dtrain.sim.step.UB_OVERLAPS``): ``tp`` row blocks of the
micro-batch's tokens for the ring-exchange all-gathers, 4 for the reduce-scatter pipelines, a piece ``i`` on
compute stream ``i mod 3``. The simulator prices a product from its FLOPs on the device's measured efficiency
curve (``dtrain.sim.compute.DeviceCompute.matmul_s``) and a piece as the product of its rows, three pieces at
once as a third of a product of three pieces' rows. This script times, in bf16 and in FP8
(``torch._scaled_mm``, E4M3 operands, per-tensor scales, bf16 output):

- each of the layer's twelve products (QKV, attention output, MLP in and out; forward, input and weight
  gradients) at 512, 1,024, 2,048 and 4,096 tokens: a piece and a whole micro-batch of one and of two sequences;
- four pieces of 512 tokens one after another on one stream, and dealt over three streams as Transformer
  Engine deals them, against the whole product of 2,048 tokens.

Each call is issued while a sleep kernel holds the stream (``dtrain bench compute``'s ``device`` timing), the
median of ``--repeats``. A row carries the simulator's price for this device (its curves of
``dtrain/sim/compute_curves.json``, without the sustained-clock factor, which a short timing does not reach) and
measured / priced.

    python benchmarks/training/piece_products.py --out benchmarks/results/piece_products-h200x1.jsonl
"""

from __future__ import annotations

import platform
import statistics
import time

import gpu_rows

HIDDEN, FFN, TP = 12288, 49152, 4
TOKENS = (512, 1024, 2048, 4096)
PIECES, STREAMS = 4, 3


def products(tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of the layer's products on one tensor-parallel rank for ``tokens`` rows."""
    out = []
    for what, n, k in (("qkv", 3 * HIDDEN // TP, HIDDEN), ("out", HIDDEN, HIDDEN // TP), ("fc1", FFN // TP, HIDDEN),
                       ("fc2", HIDDEN, FFN // TP)):  # fmt: skip
        out += [(what, tokens, n, k), (what + "-dgrad", tokens, k, n), (what + "-wgrad", k, n, tokens)]
    return out


#: a topology preset holding each device this script prices, as the simulator builds it
PRESET_OF = {"h200-sxm": "h200-4gpu", "h100-sxm": "h100-node"}


def _priced(device_key: str):
    """The simulator's compute model of device ``device_key``."""
    from dtrain.cluster.presets import preset
    from dtrain.sim.compute import device_compute

    if device_key not in PRESET_OF:
        raise SystemExit(f"piece_products.py: no preset prices a {device_key}; known: {', '.join(PRESET_OF)}")
    device = preset(PRESET_OF[device_key]).devices()[0]
    return device_compute(device.peak_flops, device.memory_bytes_per_s)


def run(repeats: int) -> list[dict]:
    import torch

    from dtrain.bench.compute import SLEEP_CYCLES_PER_S, _timer, device_key

    dev = torch.device("cuda")
    key = device_key(torch.cuda.get_device_name(dev))
    model = _priced(key)
    timed = _timer(torch, dev, "device")
    streams = [torch.cuda.Stream(dev) for _ in range(STREAMS)]
    rows = []
    for fp8 in (False, True):
        rows += _precision(torch, dev, model, timed, streams, fp8, repeats)
    stamp = {"device": torch.cuda.get_device_name(dev), "device_key": key, "torch": torch.__version__,
             "cuda": torch.version.cuda, "repeats": repeats, "machine": platform.node() or "?",
             "sleep_cycles_per_s": SLEEP_CYCLES_PER_S,
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    return [{**r, **stamp} for r in rows]


def _precision(torch, dev, model, timed, streams, fp8: bool, repeats: int) -> list[dict]:
    """The rows of one precision: every product at every token count, then the pieces."""
    one = torch.ones((), device=dev, dtype=torch.float32)
    held = model.fp8_sustained if fp8 else model.sustained
    precision = "fp8" if fp8 else "bf16"

    def operands(m, n, k):
        if fp8:
            return (torch.randn(m, k, device=dev).to(torch.float8_e4m3fn),
                    torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t())  # fmt: skip
        return torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(k, n, device=dev, dtype=torch.bfloat16)

    def product(a, b):
        if fp8:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return a @ b

    def priced(m, n, k):  # at the device's pace: the sustained-clock factor taken out
        return model.matmul_s(m, n, k, fp8=fp8) / held

    rows = []
    for tokens in TOKENS:
        for what, m, n, k in products(tokens):
            a, b = operands(m, n, k)
            seconds = timed(lambda a=a, b=b: product(a, b), 2, repeats)
            rows.append({"kind": "product", "precision": precision, "op": what, "tokens": tokens, "m": m, "n": n,
                         "k": k, "flops": 2.0 * m * n * k, "seconds": seconds, "priced_s": priced(m, n, k),
                         "measured_over_priced": seconds / priced(m, n, k)})  # fmt: skip
    # four pieces of 512 rows: in turn on one stream, and over three streams as Transformer Engine deals them
    for what, m, n, k in products(2048 // PIECES):
        if what.endswith("-wgrad"):
            continue  # weight gradients run whole (bulk overlaps)
        pieces = [operands(m, n, k) for _ in range(PIECES)]

        def in_turn(pieces=pieces):
            for a, b in pieces:
                product(a, b)

        def dealt(pieces=pieces):
            main = torch.cuda.current_stream(dev)
            for s in streams:
                s.wait_stream(main)
            for i, (a, b) in enumerate(pieces):
                with torch.cuda.stream(streams[i % STREAMS]):
                    product(a, b)
            for s in streams:
                main.wait_stream(s)

        whole = operands(PIECES * m, n, k)
        times = {"in_turn": timed(in_turn, 2, repeats), "dealt": timed(dealt, 2, repeats),
                 "whole": timed(lambda w=whole: product(*w), 2, repeats)}  # fmt: skip
        # the simulator: pieces 1-3 at once as a third of a product of three pieces' rows each, the 4th alone
        rows.append({"kind": "pieces", "precision": precision, "op": what, "pieces": PIECES, "streams": STREAMS,
                     "m": m, "n": n, "k": k, **{f"{name}_s": v for name, v in times.items()},
                     "priced_dealt_s": priced(STREAMS * m, n, k) + priced(m, n, k),
                     "priced_in_turn_s": PIECES * priced(m, n, k),
                     "priced_whole_s": priced(PIECES * m, n, k)})  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    lines = []
    for precision in ("bf16", "fp8"):
        for tokens in TOKENS:
            part = [r["measured_over_priced"] for r in rows
                    if r["kind"] == "product" and r["precision"] == precision and r["tokens"] == tokens]  # fmt: skip
            if part:
                lines.append(f"{precision} {tokens:5} tokens: measured / priced median {statistics.median(part):.3f}, "
                             f"range {min(part):.3f}-{max(part):.3f}")  # fmt: skip
        for r in rows:
            if r["kind"] == "pieces" and r["precision"] == precision:
                lines.append(f"{precision} {r['op']:10} 4 x {r['m']}: in turn {r['in_turn_s'] * 1e3:.3f} ms "
                             f"(priced {r['priced_in_turn_s'] * 1e3:.3f}), over 3 streams {r['dealt_s'] * 1e3:.3f} "
                             f"(priced {r['priced_dealt_s'] * 1e3:.3f}), whole {r['whole_s'] * 1e3:.3f} "
                             f"(priced {r['priced_whole_s'] * 1e3:.3f})")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    gpu_rows.main("piece_products.py", __doc__, run, report, repeats=20, counted="a row")


if __name__ == "__main__":
    main()
