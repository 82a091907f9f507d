"""``dtrain bench compute``: the rates one device reaches on the operations a transformer step is made of, as a
profile the simulator prices a step with (:class:`dtrain.sim.compute.ComputeProfile`).

Measured on the current device (the first GPU, else the CPU), in bf16 on a GPU and float32 on the CPU:

- matrix products ``(m, k) x (k, n)`` over a grid of the sizes transformer layers produce (``m`` tokens a
  micro-batch, ``n`` and ``k`` hidden, MLP and vocabulary widths and their tensor-parallel splits);
- causal flash attention (``torch.nn.functional.scaled_dot_product_attention``) forward, and forward with
  backward, over sequence lengths and head sizes;
- a copy of a large tensor (the memory bandwidth the element-wise work sees);
- the fused AdamW step over float32 parameters (the optimizer's rate in parameters a second).

Each time is the median of repeats after warm-up, between device synchronisations, on CUDA with events.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["measure", "run"]

MATMUL_M = (1024, 2048, 4096, 8192, 16384)
MATMUL_NK = (512, 1024, 2048, 4096, 8192, 16384, 131072)
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192)
ATTENTION_HEAD_DIM = (64, 128)
MAX_FLOPS = 4e13  # the largest product timed (about 50 ms on an H100)
MAX_BYTES = 6 * 2**30  # the most memory the operands of one product may take


def _timer(device) -> Callable[[Callable[[], Any], float], float]:
    """``time(fn, budget_s)``: the median seconds of ``fn`` over repeats filling about ``budget_s``."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_it(fn: Callable[[], Any], budget_s: float) -> float:
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        once = max(time.perf_counter() - start, 1e-6)
        repeats = max(3, min(50, int(budget_s / once)))
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return time_it


def measure(device=None, *, quick: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the current device; the profile as a dict (:meth:`ComputeProfile.from_dict` reads it) with every
    timed row under ``rows``. ``quick``: a few small shapes (a check of the tool, not a profile to plan with)."""
    import torch
    import torch.nn.functional as F

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    time_it = _timer(device)
    budget = 0.005 if quick else 0.05
    rows: list[dict[str, Any]] = []
    ms, nks = ((64, 256), (64, 256)) if quick else (MATMUL_M, MATMUL_NK)
    matmul = []
    for m, n, k in itertools.product(ms, nks, nks):
        flops = 2.0 * m * n * k
        if flops > MAX_FLOPS or (m * k + k * n + m * n) * 2 > MAX_BYTES:
            continue
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = time_it(lambda a=a, b=b: a @ b, budget)
        matmul.append({"m": m, "n": n, "k": k, "flops_per_s": flops / seconds})
        rows.append({"op": "matmul", "m": m, "n": n, "k": k, "s": seconds, "flops_per_s": flops / seconds})
        del a, b
    if log:
        log(f"{len(matmul)} matrix products, best {max(r['flops_per_s'] for r in matmul) / 1e12:.1f} TFLOP/s")
    attention = []
    seqs, dims = ((64, 128), (16,)) if quick else (ATTENTION_SEQ, ATTENTION_HEAD_DIM)
    for seq, head_dim in itertools.product(seqs, dims):
        heads = 16
        batch = max(1, (256 if quick else 16384) // seq)
        q, k, v = (
            torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

        def forward(q=q, k=k, v=v):
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v, grad=grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)

        forward_s = time_it(forward, budget)
        both_s = time_it(both, budget)
        flops = 2.0 * batch * heads * seq * seq * head_dim  # causal: half of the 4 b h s^2 d
        backward_s = max(both_s - forward_s, 1e-9)
        attention.append(
            {
                "seq": seq,
                "head_dim": head_dim,
                "forward_flops_per_s": flops / forward_s,
                "backward_flops_per_s": 2.5 * flops / backward_s,
            }
        )
        rows.append({"op": "attention", "seq": seq, "head_dim": head_dim, "heads": heads, "batch": batch,
                     "forward_s": forward_s, "forward_backward_s": both_s})  # fmt: skip
        del q, k, v, grad
    numel = (2**20 if quick else 2**28) // 2
    x = torch.randn(numel, device=device, dtype=dtype)
    y = torch.empty_like(x)
    copy_s = time_it(lambda x=x, y=y: y.copy_(x), budget)
    copy = 2 * numel * x.element_size() / copy_s
    rows.append({"op": "copy", "bytes": 2 * numel * x.element_size(), "s": copy_s, "bytes_per_s": copy})
    del x, y
    count = 2**16 if quick else 2**23
    params = [torch.zeros(count, device=device, dtype=torch.float32, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=1e-4, **fused)
    adam_s = time_it(optimizer.step, budget)
    adam = 8 * count / adam_s
    rows.append({"op": "adamw", "params": 8 * count, "s": adam_s, "params_per_s": adam})
    if log:
        log(f"copy {copy / 1e9:.0f} GB/s, AdamW {adam / 1e9:.2f} G parameters/s")
    return {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "matmul": matmul,
        "attention": attention,
        "copy_bytes_per_s": copy,
        "adam_params_per_s": adam,
        "rows": rows,
    }


def run(out: str | None, profile_out: str | None, *, quick: bool = False) -> dict[str, Any]:
    """Measure, write every row to ``out`` (JSON lines) and the profile to ``profile_out`` (JSON), both
    atomically; print a summary."""
    from dtrain.sim.compute import ComputeProfile

    for flag, path in (("--out", out), ("--profile-out", profile_out)):
        if path and Path(path).is_dir():
            raise ValueError(f"{flag}: {path} is a directory; give a file name")
    result = measure(quick=quick, log=lambda line: print(f"dtrain bench compute: {line}", flush=True))
    profile = ComputeProfile.from_dict(result)  # checks what was measured
    for path, text in (
        (out, "".join(json.dumps({"device": result["device"], **r}) + "\n" for r in result["rows"])),
        (profile_out, json.dumps(profile.to_dict() | {"torch": result["torch"]}, indent=1) + "\n"),
    ):
        if path:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(target)
    best = max(r[3] for r in profile.matmul)
    print(
        f"dtrain bench compute: {result['device']}: matrix products up to {best / 1e12:.1f} TFLOP/s, "
        f"attention up to {max(r[2] for r in profile.attention) / 1e12:.1f} TFLOP/s forward, "
        f"copy {profile.copy_bytes_per_s / 1e9:.0f} GB/s"
        + (f"; profile in {profile_out}" if profile_out else "")
    )
    return result
