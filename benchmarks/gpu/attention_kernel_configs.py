"""Block shapes of dtrain's flash-attention kernel with dropout (:mod:`dtrain.models.attention_kernel`), swept on this
GPU beside torch's fused attention of the same shape, in one launch.

For each shape (GPT-2 small's attention, 8 x 12 heads x 1,024 tokens of 64; a Llama's, 2 x 32 heads x 2,048
tokens of 128) and 16-bit dtype, each kernel (the forward, the key-value gradients, the query gradients) is timed
with every block shape of :data:`CANDIDATES` whose blocks divide as the kernel needs, the other two kernels held at
their present shapes; attention dropout 0.1, causal, the inputs laid out as the model's attention passes them
(views of ``(B, T, H, D)``). Each time is the median of CUDA-event timings of the
forward op or the backward op (the backward op runs its three kernels: the row sums, the key-value gradients, the
query gradients, so a key-value or query shape's time is the whole backward's with that shape). Beside them, in
the same launch: torch's ``scaled_dot_product_attention`` (causal, no dropout; the backend torch picks) forward
and forward with backward at the same shape, and dtrain's kernel at the present shapes. A row a timing.

    python benchmarks/gpu/attention_kernel_configs.py --out benchmarks/results/attention_kernel_configs-h200x1.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics

import torch
import torch.nn.functional as F

from dtrain.models import attention_kernel as kernel
from dtrain.models import dropout as dropouts

SHAPES = {"gpt2-124m": (8, 12, 1024, 64), "llama": (2, 32, 2048, 128)}
BLOCKS = (16, 32, 64, 128)
CANDIDATES = [
    (m, n, warps, stages)
    for m, n in itertools.product(BLOCKS, BLOCKS)
    for warps in (4, 8)
    for stages in (2, 3)
    if not (m == n == 16) and m * n <= 128 * 64
]


def _fits(kind: str, m: int, n: int) -> bool:
    """The forward's and the query gradients' query blocks are multiples of their key blocks, the key-value
    gradients' key blocks of their query blocks."""
    return m % n == 0 if kind in ("forward", "q") else n % m == 0


def _median_ms(fn, iters: int, trials: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _inputs(shape: tuple[int, int, int, int], dtype: torch.dtype):
    """Queries, keys, values and the output's gradient ``(B, H, T, D)`` laid out as the model's attention has them:
    views of ``(B, T, H, D)`` tensors (each head's rows ``H * D`` elements apart)."""
    b, h, t, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(b, t, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2) for _ in range(4))
    return q, k, v, grad


def _torch_sdpa(q, k, v, grad, iters: int, trials: int) -> tuple[float, float]:
    """(forward, forward with backward) ms of torch's fused attention, causal, no dropout, the backend it picks."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return _median_ms(forward, iters, trials), _median_ms(step, iters, trials)


def _ours(q, k, v, grad, salt):
    """(forward, backward) callables of dtrain's kernel at its present shapes."""
    seen = dropouts.state(q.device).clone()
    cut, scale = dropouts.threshold(0.1), 1.0 / 0.9
    out, lse = torch.ops.dtrain.hash_dropout_flash_attention(q, k, v, seen, salt, cut, scale, 0)

    def forward():
        torch.ops.dtrain.hash_dropout_flash_attention(q, k, v, seen, salt, cut, scale, 0)

    def backward():
        torch.ops.dtrain.hash_dropout_flash_attention_backward(grad, q, k, v, out, lse, seen, salt, cut, scale, 0)

    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    dropouts.set_step(0, 1)
    salt = torch.tensor([dropouts.site_salt(1)], dtype=torch.int64, device="cuda")
    common = {
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "host": platform.node(),
        "iters": args.iters,
        "trials": args.trials,
    }
    rows = []

    def emit(row: dict) -> None:
        rows.append({**common, **row})
        print(json.dumps(row), flush=True)

    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    for (name, shape), dtype_name in itertools.product(shapes.items(), args.dtypes.split(",")):
        dtype = getattr(torch, dtype_name)
        q, k, v, grad = _inputs(shape, dtype)
        d = shape[3]
        base = {"shape": name, "b": shape[0], "h": shape[1], "t": shape[2], "d": d, "dtype": dtype_name}
        forward_ms, step_ms = _torch_sdpa(q, k, v, grad, args.iters, args.trials)
        emit({**base, "impl": "torch-sdpa", "pass": "forward", "ms": forward_ms})
        emit({**base, "impl": "torch-sdpa", "pass": "forward+backward", "ms": step_ms})
        present = {kind: kernel._config(kind, dtype, kernel._block_d(d)) for kind in ("forward", "kv", "q")}
        forward, backward = _ours(q, k, v, grad, salt)
        emit({**base, "impl": "dtrain", "pass": "forward", "config": present["forward"], "present": True,
              "ms": _median_ms(forward, args.iters, args.trials)})  # fmt: skip
        emit({**base, "impl": "dtrain", "pass": "backward", "config": [present["kv"], present["q"]], "present": True,
              "ms": _median_ms(backward, args.iters, args.trials)})  # fmt: skip
        key = 4 if dtype == torch.float32 else 2
        for kind in ("forward", "kv", "q"):
            table_key = (kind, key, max(kernel._block_d(d), 64))
            kept = kernel._CONFIGS[table_key]
            for config in CANDIDATES:
                if not _fits(kind, config[0], config[1]):
                    continue
                kernel._CONFIGS[table_key] = config
                try:
                    forward, backward = _ours(q, k, v, grad, salt)
                    ms = _median_ms(forward if kind == "forward" else backward, args.iters, args.trials)
                except Exception as exc:  # noqa: BLE001 (a shape the GPU cannot hold: out of shared memory)
                    emit({**base, "impl": "dtrain", "kernel": kind, "config": config, "error": str(exc)[:200]})
                    continue
                finally:
                    kernel._CONFIGS[table_key] = kept
                emit({**base, "impl": "dtrain", "kernel": kind, "config": config, "ms": ms})
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
