"""``dtrain bench compute``: how fast this device runs the operations a transformer layer is made of, and the
efficiency curves :mod:`dtrain.sim.compute` prices them with.

Five kinds, each timed with CUDA events on a GPU (wall clock on the CPU) after warm-up, the median of repeats.
On a GPU each call is issued while a sleep kernel (``torch.cuda._sleep``) holds the stream for twice as long as
the host took to issue it, so the events measure the device running the call's kernels back to back, not the
host's launches (the simulator prices a kernel's launch apart, ``DeviceCompute.kernel_s``):

- bf16 matrix products ``(m, n, k)`` of transformer shapes: ``m`` the tokens of a micro-batch, ``n`` and ``k``
  the hidden width, the MLP width, QKV and a vocabulary slice, each split over tensor-parallel degrees 1-8;
- the same products in 8-bit floating point where the device has it (compute capability 8.9 and up, and the
  CPU): ``torch._scaled_mm`` of E4M3 operands with per-tensor scales into bf16, the product Transformer Engine
  runs for a linear layer's FP8 GEMMs (kind ``matmul-fp8``);
- scaled-dot-product attention (causal) over sequence lengths and heads, forward and backward as one call, its
  FLOPs ``4 b s^2 h`` forward halved for the mask, backward 2.5 times that; and the same without a mask (kind
  ``attention-full``, ``4 b s^2 h`` forward), as a context-parallel ring runs its kernels on other ranks' keys.
  Each row names the kernel family that ran (``backend``: torch's own choice, ``torch._fused_sdp_choice``, or the
  one ``attention_backend`` forces: ``flash`` is FlashAttention-2 as torch carries it, ``cudnn`` cuDNN's fused
  attention, ``efficient`` the memory-efficient kernel, ``math`` the unfused one);
- memory-bound operations over flat tensors: layer norm, RMS norm, GELU, SiLU, add, cross-entropy, a fused
  AdamW step; bytes are what each reads and writes once.

Each row: achieved FLOP/s or bytes/s and the efficiency against the device's datasheet peak
(:data:`dtrain.cluster.devices.DEVICES`, FP8 products against its FP8 peak; on the CPU against its own best
matrix product of the same kind, there being no sheet).
``--write-curves`` merges the device's curves (efficiency by size: the median of each power-of-two bin) into
the simulator's file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "ATTENTION_BACKENDS",
    "device_key",
    "grid",
    "has_fp8",
    "run",
    "curves_from_rows",
    "read_curves",
    "write_curves",
]

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


#: Cycles a second the GPU's sleep kernel is reckoned at when it is sized (a high clock: on a slower one the sleep
#: only lasts longer, which is safe).
SLEEP_CYCLES_PER_S = 2.0e9


#: How a GPU call is timed: ``device`` (issued behind a sleep kernel: the device's pace) or ``launch`` (events
#: around a call the host launches while the GPU waits: its launches counted, for comparison)
TIMINGS = ("device", "launch")


def _timer(torch, device, timing: str = "device") -> Callable[[Callable[[], object], int, int], float]:
    def timed(fn, warmup: int, repeats: int) -> float:
        host = 0.0  # the host's time to issue one call: the last warm-up's (the first may set up libraries)
        for _ in range(max(warmup, 1) if device.type == "cuda" else warmup):
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                # the device's time, not the host's: the call is issued while a sleep kernel holds the stream (twice
                # as long as issuing it took), so the events around it see the device run it back to back
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if timing == "device":
                    torch.cuda._sleep(int(min(0.05, 2 * host + 20e-6) * SLEEP_CYCLES_PER_S))
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


#: The kinds of operation timed, each a curve of the simulator's file.
KINDS = ("matmul", "matmul-fp8", "attention", "attention-full", "memory")

#: Attention kernel families ``run`` can force, by torch's ``SDPBackend`` member; ``default`` lets torch choose.
ATTENTION_BACKENDS = {"default": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                      "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}  # fmt: skip


def _attention_backend(torch, backend: str, q, causal: bool) -> str:
    """The name (a key of :data:`ATTENTION_BACKENDS`) of the kernel family scaled-dot-product attention runs on
    ``q`` as its keys and values: ``backend`` where one is forced, else the one torch picks."""
    if backend != "default":
        return backend
    from torch.nn.attention import SDPBackend

    chosen = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=causal)).name
    return next((k for k, v in ATTENTION_BACKENDS.items() if v == chosen), chosen.lower())


def run(
    *,
    device_name: str | None = None,
    quick: bool = False,
    repeats: int = 5,
    warmup: int = 2,
    kinds: tuple[str, ...] = KINDS,
    timing: str = "device",
    attention_backend: str = "default",
) -> list[dict]:
    """Time every operation of ``kinds`` (:data:`KINDS`) on ``device_name`` (default: cuda if there is one, else
    cpu), a GPU's calls as ``timing`` says (:data:`TIMINGS`), attention on ``attention_backend``
    (:data:`ATTENTION_BACKENDS`); one dict a row. FP8 products' efficiency is against the device's FP8 peak (on the
    CPU, its best FP8 product)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds: {', '.join(unknown) or 'none given'}; choose from {', '.join(KINDS)}")
    if timing not in TIMINGS:
        raise ValueError(f"--timing {timing}: choose from {', '.join(TIMINGS)}")
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {attention_backend}: choose from {', '.join(ATTENTION_BACKENDS)}")
    import torch
    import torch.nn.functional as F

    from dtrain.cluster.devices import DEVICES

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    key = device_key(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    spec = DEVICES.get(key)
    dtype = torch.bfloat16
    timed = _timer(torch, device, timing)
    rows: list[dict] = []
    for what, m, n, k in grid(quick) if "matmul" in kinds else ():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda a=a, b=b: a @ b, warmup, repeats)
        rows.append(
            {"kind": "matmul", "op": what, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "seconds": seconds}
        )
    if "matmul-fp8" in kinds and has_fp8(torch, device):
        fp8 = torch.float8_e4m3fn
        one = torch.ones((), device=device, dtype=torch.float32)
        for what, m, n, k in grid(quick):
            a = torch.randn(m, k, device=device).to(fp8)
            b = torch.randn(n, k, device=device).to(fp8).t()  # column-major, as the FP8 GEMM takes it

            def product(a=a, b=b):
                return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=dtype)

            rows.append({"kind": "matmul-fp8", "op": what, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
                         "seconds": timed(product, warmup, repeats)})  # fmt: skip
    masks = [(kind, kind == "attention") for kind in ("attention", "attention-full") if kind in kinds]
    forced = contextlib.nullcontext
    if ATTENTION_BACKENDS[attention_backend] is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        forced = functools.partial(sdpa_kernel, getattr(SDPBackend, ATTENTION_BACKENDS[attention_backend]))
    for (kind, causal), seq in ((m, s) for m in masks for s in ((32, 64) if quick else (1024, 2048, 4096, 8192))):
        for heads in (1,) if quick else (8, 16, 32):
            d = 16 if quick else 128
            q, kk, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad_out = torch.ones(1, heads, seq, d, device=device, dtype=dtype)

            def attention(q=q, kk=kk, v=v, grad_out=grad_out, causal=causal):
                # the gradients returned, not accumulated into .grad: the kernels of attention's forward and
                # backward alone
                with forced():
                    out = F.scaled_dot_product_attention(q, kk, v, is_causal=causal)
                    torch.autograd.grad(out, (q, kk, v), grad_out)

            try:
                seconds = timed(attention, warmup, repeats)
            except RuntimeError as e:
                why = str(e).splitlines()[0]
                raise ValueError(f"--attention-backend {attention_backend}: torch cannot run it here for "
                                 f"{seq} tokens of {heads} heads of {d} ({why})") from None  # fmt: skip
            # forward (halved under the mask), and backward at 2.5 times it
            flops = 4.0 * seq * seq * heads * d * (0.5 if causal else 1.0) * 3.5
            rows.append({"kind": kind, "op": "sdpa-causal" if causal else "sdpa", "seq": seq, "heads": heads,
                         "head_dim": d, "backend": _attention_backend(torch, attention_backend, q, causal),
                         "flops": flops, "seconds": seconds})  # fmt: skip
    sizes = (1 << 12, 1 << 14) if quick else (1 << 22, 1 << 24, 1 << 26, 1 << 28)
    for elements in sizes if "memory" in kinds else ():
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
    peaks = {}
    for kind, precision in (("matmul", "bf16"), ("matmul-fp8", "fp8")):
        if spec and spec.has(precision):
            peaks[kind] = spec.flops(precision)
        elif any(r["kind"] == kind for r in rows):
            peaks[kind] = max(r["flops"] / r["seconds"] for r in rows if r["kind"] == kind)
    if any(r["kind"] == "attention" for r in rows) and "matmul" not in peaks:
        peaks["matmul"] = max(r["flops"] / r["seconds"] for r in rows if r["kind"] == "attention")
    bytes_rows = [r["bytes"] / r["seconds"] for r in rows if "bytes" in r]
    bandwidth = spec.memory_bytes_per_s if spec else max(bytes_rows, default=1.0)
    for r in rows:
        r["device"] = key
        if device.type == "cuda":
            r["timing"] = timing
        if "flops" in r:
            r["flops_per_s"] = r["flops"] / r["seconds"]
            r["efficiency"] = r["flops_per_s"] / peaks.get(r["kind"], peaks.get("matmul", 1.0))
        else:
            r["bytes_per_s"] = r["bytes"] / r["seconds"]
            r["efficiency"] = r["bytes_per_s"] / bandwidth
    return rows


def has_fp8(torch, device) -> bool:
    """Whether ``device`` runs 8-bit floating-point products: the CPU, or a GPU of compute capability 8.9 and up
    (Ada, Hopper and later)."""
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


def _memory_ops(F, x, y, weight, target, elements: int) -> dict[str, tuple[Callable[[], object], int]]:
    """The memory-bound operations over ``x`` (rows of a width) and the bytes each reads and writes."""
    item, width = x.element_size(), x.shape[-1]
    return {
        "layer-norm": (lambda: F.layer_norm(x, (width,), weight), 2 * item * elements),
        "rms-norm": (lambda: F.rms_norm(x, (width,), weight), 2 * item * elements),
        "gelu": (lambda: F.gelu(x), 2 * item * elements),
        "silu": (lambda: F.silu(x), 2 * item * elements),
        "add": (lambda: x + y, 3 * item * elements),
        # the log-softmax reads the logits and writes their log-probabilities; the loss reads one a row
        "cross-entropy": (lambda: F.cross_entropy(x, target), 2 * item * elements),
    }


#: The simulator's attention kernel family (:data:`dtrain.sim.compute.ATTENTION_KERNELS`) of each torch backend
#: that has one.
FAMILY_OF_BACKEND = {"cudnn": "cudnn", "flash": "fa2"}


def curves_from_rows(rows: list[dict]) -> dict[str, list[list[float]] | str]:
    """Efficiency by size for each kind: the median efficiency of each power-of-two size bin, at the bin's
    median size (``matmul``, ``matmul-fp8``, ``attention`` and ``attention-full`` by FLOPs, ``memory`` by bytes); a
    kind with no rows has no curve. Attention rows that name their backend go by kernel family
    (:data:`FAMILY_OF_BACKEND`; the memory-efficient and math kernels have none and make no curve): the device's own
    family, cuDNN's where it was timed, else the one family timed, makes ``attention`` and ``attention-full`` and is
    named under ``attention_kernel``; another makes ``attention-FAMILY`` and ``attention-full-FAMILY``. The CPU's
    kernels are no GPU family: its rows make its own curves whatever their backend."""
    rows = [{k: v for k, v in r.items() if k != "backend"} if r.get("device") == "cpu" else r for r in rows]
    families = {FAMILY_OF_BACKEND.get(r["backend"]) for r in rows if "backend" in r} - {None}
    own = "cudnn" if "cudnn" in families else min(families, default=None)

    def kind_of(r: dict) -> str | None:
        if "backend" not in r:
            return r["kind"]
        family = FAMILY_OF_BACKEND.get(r["backend"])
        return None if family is None else r["kind"] if family == own else f"{r['kind']}-{family}"

    curves: dict[str, list[list[float]] | str] = {}
    sizes = [("matmul", "flops"), ("matmul-fp8", "flops"), ("memory", "bytes")]
    sizes += [(f"{kind}{f'-{family}' if family != own else ''}", "flops") for kind in ("attention", "attention-full")
              for family in sorted(families | {own})]  # fmt: skip
    for kind, size in sizes:
        bins: dict[int, list[tuple[float, float]]] = {}
        for r in rows:
            if kind_of(r) == kind and r["efficiency"] > 0:
                bins.setdefault(int(math.log2(r[size])), []).append((r[size], r["efficiency"]))
        if bins:
            curves[kind] = [
                [statistics.median(s for s, _ in b), min(1.5, statistics.median(e for _, e in b))]
                for _, b in sorted(bins.items())
            ]
    if own is not None and any(kind.startswith("attention") for kind in curves):
        curves["attention_kernel"] = own
    return curves


def read_curves(path: str | os.PathLike, flag: str = "") -> dict:
    """The curve file at ``path`` (an empty one where there is none); ValueError, naming ``flag`` and ``path``, where
    it is not JSON or not a curve file (an object with a ``devices`` table of objects)."""
    where = f"{flag} {path}" if flag else str(path)
    path = Path(path)
    if not path.exists():
        return {"devices": {}}
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{where}: not a compute-curve file (no 'devices' table)")
    bad = next((key for key, entry in data["devices"].items() if not isinstance(entry, dict)), None)
    if bad is not None:
        raise ValueError(f"{where}: not a compute-curve file (devices.{bad} is not a table)")
    return data


def write_curves(path: str | os.PathLike, key: str, curves: dict, note: str) -> None:
    """Merge ``key``'s curves into the curve file at ``path`` (created if absent), atomically: each kind in
    ``curves`` replaces that kind's curve, the device's other curves stay; ``measured`` names, by kind, what
    measured each curve."""
    path = Path(path)
    data = read_curves(path)
    entry = dict(data["devices"].get(key, {}))
    measured = entry.pop("measured", {})
    if isinstance(measured, str):  # one note for every curve already there
        measured = {kind: measured for kind in entry}
    entry.update(curves)
    data["devices"][key] = {**entry, "measured": {**measured, **{kind: note for kind in curves}}}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(f.name, path)
