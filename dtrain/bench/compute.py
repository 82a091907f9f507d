"""``dtrain bench compute``: how fast this device runs the operations a transformer layer is made of, and the
efficiency curves :mod:`dtrain.sim.compute` prices them with.

Three kinds, each timed with CUDA events on a GPU (wall clock on the CPU) after warm-up, the median of repeats:

- bf16 matrix products ``(m, n, k)`` of transformer shapes: ``m`` the tokens of a micro-batch, ``n`` and ``k``
  the hidden width, the MLP width, QKV and a vocabulary slice, each split over tensor-parallel degrees 1-8;
- scaled-dot-product attention (causal; flash where torch has it) over sequence lengths and heads, forward and
  backward, its FLOPs ``4 b s^2 h`` forward halved for the mask, backward 2.5 times that;
- memory-bound operations over flat tensors: layer norm, RMS norm, GELU, SiLU, add, cross-entropy, a fused
  AdamW step; bytes are what each reads and writes once.

Each row: achieved FLOP/s or bytes/s and the efficiency against the device's datasheet peak
(:data:`dtrain.cluster.devices.DEVICES`; on the CPU against its own best matrix product, there being no sheet).
``--write-curves`` merges the device's curves (efficiency by size: the median of each power-of-two bin) into
the simulator's file.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["device_key", "grid", "run", "curves_from_rows", "write_curves"]

HIDDEN = (4096, 8192, 12288, 16384)
TOKENS = (2048, 4096, 8192)
TP = (1, 2, 4, 8)
QUICK_HIDDEN, QUICK_TOKENS, QUICK_TP = (64,), (32,), (1, 2)


def device_key(name: str) -> str:
    """The :data:`dtrain.cluster.devices.DEVICES` key of a CUDA device name ("cpu" for the CPU)."""
    lowered = name.lower()
    for needle, key in (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100-sxm4-40gb", "a100-40gb"),
                        ("a100 80gb pcie", "a100-pcie"), ("a100", "a100-sxm")):  # fmt: skip
        if needle in lowered:
            return key
    return "cpu" if lowered == "cpu" else lowered.replace(" ", "-")


def grid(quick: bool = False) -> list[tuple[str, int, int, int]]:
    """The matrix products of transformer layers: (what, m, n, k) over widths, tokens and tensor-parallel degrees,
    each forward shape and its two backward shapes."""
    shapes = set()
    for h in QUICK_HIDDEN if quick else HIDDEN:
        for tokens in QUICK_TOKENS if quick else TOKENS:
            for t in QUICK_TP if quick else TP:
                vocab = 256 if quick else 32768 // t
                products = (("qkv", 3 * h // t, h), ("out", h, h // t), ("mlp-in", 4 * h // t, h),
                            ("mlp-out", h, 4 * h // t), ("logits", vocab, h))  # fmt: skip
                for what, n, k in products:
                    shapes |= {(what, tokens, n, k), (what + "-dgrad", tokens, k, n), (what + "-wgrad", k, n, tokens)}
    return sorted(shapes, key=lambda s: (s[1] * s[2] * s[3], s))


def _timer(torch, device) -> Callable[[Callable[[], object], int, int], float]:
    def timed(fn, warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return timed


def run(*, device_name: str | None = None, quick: bool = False, repeats: int = 5, warmup: int = 2) -> list[dict]:
    """Time every operation on ``device_name`` (default: cuda if there is one, else cpu); one dict a row."""
    import torch
    import torch.nn.functional as F

    from dtrain.cluster.devices import DEVICES

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    key = device_key(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    spec = DEVICES.get(key)
    dtype = torch.bfloat16
    timed = _timer(torch, device)
    rows: list[dict] = []
    for what, m, n, k in grid(quick):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda a=a, b=b: a @ b, warmup, repeats)
        rows.append(
            {"kind": "matmul", "op": what, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "seconds": seconds}
        )
    for seq in (32, 64) if quick else (1024, 2048, 4096, 8192):
        for heads in (1,) if quick else (8, 16, 32):
            d = 16 if quick else 128
            q, kk, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

            def attention(q=q, kk=kk, v=v):
                out = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
                out.backward(torch.ones_like(out))

            flops = 4.0 * seq * seq * heads * d * 0.5 * 3.5  # forward, and backward at 2.5 times it
            rows.append({"kind": "attention", "op": "sdpa-causal", "seq": seq, "heads": heads, "head_dim": d,
                         "flops": flops, "seconds": timed(attention, warmup, repeats)})  # fmt: skip
    for elements in (1 << 12, 1 << 14) if quick else (1 << 22, 1 << 24, 1 << 26, 1 << 28):
        width = 64 if quick else 8192
        x = torch.randn(elements // width, width, device=device, dtype=dtype)
        y = torch.randn_like(x)
        weight = torch.ones(width, device=device, dtype=dtype)
        target = torch.zeros(elements // width, device=device, dtype=torch.long)
        ops = _memory_ops(F, x, y, weight, target, elements)
        for name, (fn, nbytes) in ops.items():
            rows.append({"kind": "memory", "op": name, "elements": elements, "bytes": float(nbytes),
                         "seconds": timed(fn, warmup, repeats)})  # fmt: skip
        params = [torch.zeros(elements, device=device, dtype=torch.float32, requires_grad=True)]
        params[0].grad = torch.ones_like(params[0])
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        adam = torch.optim.AdamW(params, lr=1e-4, **fused)
        rows.append({"kind": "memory", "op": "adamw", "elements": elements, "bytes": 28.0 * elements,
                     "seconds": timed(adam.step, warmup, repeats)})  # fmt: skip
    peak = spec.flops("bf16") if spec else max(r["flops"] / r["seconds"] for r in rows if r["kind"] == "matmul")
    bandwidth = spec.memory_bytes_per_s if spec else max(r["bytes"] / r["seconds"] for r in rows if "bytes" in r)
    for r in rows:
        r["device"] = key
        if "flops" in r:
            r["flops_per_s"] = r["flops"] / r["seconds"]
            r["efficiency"] = r["flops_per_s"] / peak
        else:
            r["bytes_per_s"] = r["bytes"] / r["seconds"]
            r["efficiency"] = r["bytes_per_s"] / bandwidth
    return rows


def _memory_ops(F, x, y, weight, target, elements: int) -> dict[str, tuple[Callable[[], object], int]]:
    """The memory-bound operations over ``x`` (rows of a width) and the bytes each reads and writes."""
    item, width = x.element_size(), x.shape[-1]
    return {
        "layer-norm": (lambda: F.layer_norm(x, (width,), weight), 2 * item * elements),
        "rms-norm": (lambda: F.rms_norm(x, (width,), weight), 2 * item * elements),
        "gelu": (lambda: F.gelu(x), 2 * item * elements),
        "silu": (lambda: F.silu(x), 2 * item * elements),
        "add": (lambda: x + y, 3 * item * elements),
        "cross-entropy": (lambda: F.cross_entropy(x, target), item * elements),
    }


def curves_from_rows(rows: list[dict]) -> dict[str, list[list[float]]]:
    """Efficiency by size for each kind: the median efficiency of each power-of-two size bin, at the bin's
    median size (``matmul`` and ``attention`` by FLOPs, ``memory`` by bytes)."""
    curves = {}
    for kind, size in (("matmul", "flops"), ("attention", "flops"), ("memory", "bytes")):
        bins: dict[int, list[tuple[float, float]]] = {}
        for r in rows:
            if r["kind"] == kind and r["efficiency"] > 0:
                bins.setdefault(int(math.log2(r[size])), []).append((r[size], r["efficiency"]))
        curves[kind] = [
            [statistics.median(s for s, _ in b), min(1.5, statistics.median(e for _, e in b))]
            for _, b in sorted(bins.items())
        ]
    return curves


def write_curves(path: str | os.PathLike, key: str, curves: dict, note: str) -> None:
    """Merge ``key``'s curves into the curve file at ``path`` (created if absent), atomically."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {"devices": {}}
    if not isinstance(data.get("devices"), dict):
        raise ValueError(f"{path}: not a compute-curve file (no 'devices' table)")
    data["devices"][key] = {**curves, "measured": note}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(f.name, path)
