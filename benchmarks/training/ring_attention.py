"""A context-parallel rank's attention kernels, timed on this GPU beside what the simulator prices them at.

With context parallelism of degree ``cp`` (``dtrain.sim.model.Layout.cp``; Transformer Engine's ring attention,
Megatron-Core's ``cp_comm_type`` "p2p") a rank holds two pieces of each sequence of ``s`` tokens, one from each
end (``s / (2 cp)`` tokens each), and runs its attention as ``cp`` kernels a pass, one on each rank's keys and
values as they come round the ring: on its own, the causal kernel of its ``s / cp`` queries and keys; on rank
``c'``'s, where ``c' < c``, all its queries over the first of the two key pieces, and where ``c' > c``, the second
of its query pieces over both key pieces, neither masked. Every kernel does a ``cp``-th of the rank's work,
which is a ``cp``-th of the sequence's. The simulator prices each as a flash-attention call of its FLOPs on the
device's measured (causal) attention curve (``dtrain.sim.compute.layer_ops``).

This script times, for each shape, sequence length and ``cp``, the three kernels (forward and backward, as
``dtrain bench compute`` times its attention curve: ``scaled_dot_product_attention`` and the gradients of
query, key and value, each call issued while a sleep kernel holds the stream) and adds up a pass of the first
rank (its own kernel, then ``cp - 1`` of the second kind) and of the last (the third kind), against the
simulator's price of the pass (its curve's price, the sustained-clock factor aside, as for a short timing).

    python benchmarks/training/ring_attention.py --out benchmarks/results/ring_attention-h200x1.jsonl
"""

from __future__ import annotations

import platform
import statistics
import time

import gpu_rows

HEAD_DIM = 128
#: (name, attention heads a rank): Llama 3 8B's 32 heads on one rank, Llama 3 70B's 64 on tp 8
SHAPES = (("llama3-8b-tp1", 32), ("llama3-70b-tp8", 8))
SEQUENCES = (16384, 32768, 65536)
DEGREES = (1, 2, 4, 8)
PRESET_OF = {"h200-sxm": "h200-4gpu", "h100-sxm": "h100-node"}


def kernels(s: int, cp: int) -> dict[str, tuple[int, int, bool]]:
    """The kernels of a ring pass as (queries, keys, causal): the rank's own, and the two kinds on another's."""
    local, piece = s // cp, s // (2 * cp)
    out = {"own": (local, local, True)}
    if cp > 1:
        out["later"] = (piece, local, False)  # on a rank after it (c' > c): its second query piece, both key pieces
        out["earlier"] = (local, piece, False)  # on a rank before it (c' < c): all its queries, the first key piece
    return out


def _priced(device_key: str):
    from dtrain.cluster.presets import preset
    from dtrain.sim.compute import device_compute

    if device_key not in PRESET_OF:
        raise SystemExit(f"ring_attention.py: no preset prices a {device_key}; known: {', '.join(PRESET_OF)}")
    device = preset(PRESET_OF[device_key]).devices()[0]
    return device_compute(device.peak_flops, device.memory_bytes_per_s)


def priced_pass_s(device, heads: int, s: int, cp: int) -> float:
    """The simulator's seconds of a context-parallel rank's attention, forward and backward, one layer and one
    sequence of ``s`` tokens (``heads`` heads of :data:`HEAD_DIM` on the rank)."""
    from dtrain.sim.compute import layer_ops, price
    from dtrain.sim.model import Layout, ModelSpec

    hidden = heads * HEAD_DIM
    model = ModelSpec(parameters=12.0 * hidden * hidden, layers=1, hidden=hidden, heads=heads, sequence=s)
    layout = Layout(cp=cp, attention="flash")
    return sum(price(op, device) for op in layer_ops(model, layout) if op.kind == "attention")


def run(repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from dtrain.bench.compute import SLEEP_CYCLES_PER_S, _timer, device_key

    dev = torch.device("cuda")
    key = device_key(torch.cuda.get_device_name(dev))
    device = _priced(key)
    timed = _timer(torch, dev, "device")
    stamp = {"device": torch.cuda.get_device_name(dev), "device_key": key, "torch": torch.__version__,
             "cuda": torch.version.cuda, "repeats": repeats, "machine": platform.node() or "?",
             "sleep_cycles_per_s": SLEEP_CYCLES_PER_S,
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    rows = []
    for name, heads in SHAPES:
        for s in SEQUENCES:
            for cp in DEGREES:
                seconds = {}
                for kind, (queries, keys, causal) in kernels(s, cp).items():
                    q = torch.randn(1, heads, queries, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    k, v = (torch.randn(1, heads, keys, HEAD_DIM, device=dev, dtype=torch.bfloat16,
                                        requires_grad=True) for _ in range(2))  # fmt: skip
                    grad = torch.ones(1, heads, queries, HEAD_DIM, device=dev, dtype=torch.bfloat16)

                    def attention(q=q, k=k, v=v, grad=grad, causal=causal):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        torch.autograd.grad(out, (q, k, v), grad)

                    seconds[kind] = timed(attention, 2, repeats)
                    del q, k, v, grad
                first = seconds["own"] + (cp - 1) * seconds.get("later", 0.0)
                last = seconds["own"] + (cp - 1) * seconds.get("earlier", 0.0)
                priced = priced_pass_s(device, heads, s, cp)
                rows.append({"shape": name, "heads": heads, "head_dim": HEAD_DIM, "sequence": s, "cp": cp,
                             **{f"{kind}_s": v for kind, v in seconds.items()}, "first_rank_s": first,
                             "last_rank_s": last, "priced_s": priced, "first_over_priced": first / priced,
                             "last_over_priced": last / priced, **stamp})  # fmt: skip
                print(f"{name} s {s:6} cp {cp}: first rank {first * 1e3:8.2f} ms, last {last * 1e3:8.2f} ms, priced "
                      f"{priced * 1e3:8.2f} ms ({first / priced:.3f}, {last / priced:.3f})", flush=True)  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    lines = []
    for cp in DEGREES:
        part = [r[f"{rank}_over_priced"] for r in rows if r["cp"] == cp for rank in ("first", "last")]
        if part:
            lines.append(f"cp {cp}: measured / priced median {statistics.median(part):.3f}, "
                         f"range {min(part):.3f}-{max(part):.3f}")  # fmt: skip
    for r in rows:
        if r["cp"] > 1:
            one = next(o for o in rows if (o["shape"], o["sequence"], o["cp"]) == (r["shape"], r["sequence"], 1))
            lines.append(f"{r['shape']} s {r['sequence']} cp {r['cp']}: a rank's pass x cp over one GPU's "
                         f"{max(r['first_rank_s'], r['last_rank_s']) * r['cp'] / one['first_rank_s']:.3f} "
                         f"(priced {r['priced_s'] * r['cp'] / one['priced_s']:.3f})")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    gpu_rows.main("ring_attention.py", __doc__, run, report, repeats=10, counted="a kernel")


if __name__ == "__main__":
    main()
