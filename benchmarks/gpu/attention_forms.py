"""Usage: python benchmarks/gpu/attention_forms.py [--preset 1b] [--seq-len 2048] [--timed 1,2,4] [--out FILE]

What three choices in dtrain.models' block cost on one device, for one decoder block of a preset (Llama 3.2 1B
by default: 32 query heads sharing 8 key-value heads), forward and backward under bf16 autocast with float32
weights, as ``dtrain train --precision bf16`` runs it:

- the rotary tables: ``cos`` and ``sin`` of the positions' angles computed in every layer's every forward
  (``tables="each-call"``: seven kernels a layer), or once a sequence length and kept (``"kept"``);
- grouped-query attention: the key-value heads repeated to every query head before the attention
  (``groups="repeated"``: two copies of keys and values each forward, kept for backward, and their gradients
  summed back), or handed to ``scaled_dot_product_attention`` as they are (``"grouped"``, ``enable_gqa``);
- the inputs' casts: autocast casting the 32-bit input of each product apart (``casts="each"``: q, k, v, gate
  and up, each keeping its own 16-bit copy for backward), or attention and the MLP casting theirs once
  (``"shared"``, ``dtrain.models.decoder.autocast_input``).

Each form against the block as dtrain.models builds it (``form: "model"``), in the same process: CUDA-event times
of the forward and backward (median of ``--repeat``), the host's time to issue each, the same passes replayed as a
CUDA graph where they capture (the device alone), the bytes the forward leaves allocated for backward, the
attention kernel the pass ran, and the largest difference of the output and the input's gradient from the
model's. One JSON line a (form, micro-batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from dtrain.models.decoder import Attention, Block, _rotate_half, autocast_input
from dtrain.models.presets import preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_ops import _graph_timings  # noqa: E402 (this directory's script)

FORMS = {  # name: (tables, groups, casts); "model" is the block as built
    "model": None,
    "each-call+repeated+each": ("each-call", "repeated", "each"),
    "each-call+grouped+each": ("each-call", "grouped", "each"),
    "each-call+repeated+shared": ("each-call", "repeated", "shared"),
    "each-call+grouped+shared": ("each-call", "grouped", "shared"),
    "kept+grouped+shared": ("kept", "grouped", "shared"),
}


def _forward(attention: Attention, x: torch.Tensor, tables: str, groups: str, casts: str, kept: dict) -> torch.Tensor:
    b, t, _ = x.shape
    if casts == "shared":
        x = autocast_input(x)
    q = attention.q_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    key = (t, q.device, q.dtype)
    if tables == "each-call" or key not in kept:
        angles = torch.outer(torch.arange(t, device=q.device, dtype=torch.float32), attention.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        kept[key] = (angles.cos().to(q.dtype), angles.sin().to(q.dtype))
    cos, sin = kept[key]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    grouped = k.shape[1] != q.shape[1]
    if grouped and groups == "repeated":
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        grouped = False
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    return attention.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def block_of(config, form: str, device: torch.device) -> Block:
    torch.manual_seed(0)
    block = Block(config).to(device)
    if FORMS[form] is not None:
        tables, groups, casts = FORMS[form]
        kept: dict = {}
        block.attn.forward = lambda x: _forward(block.attn, x, tables, groups, casts, kept)
        mlp = block.mlp
        if casts == "each":  # autocast casts the input for gate and for up apart
            mlp.forward = lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return block


def _attention_kernel(forward, backward) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
        backward()
    names = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key and "backward" not in e.key}
    return ", ".join(sorted(names - {"aten::scaled_dot_product_attention"})) or "none"


def measure(config, form: str, micro_batch: int, seq_len: int, repeat: int, reference: dict | None) -> dict:
    device = torch.device("cuda")
    block = block_of(config, form, device)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(micro_batch, seq_len, config.hidden_size, device=device, generator=generator, requires_grad=True)
    grad = torch.randn(micro_batch, seq_len, config.hidden_size, device=device, generator=generator)
    state: dict = {}

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            state["y"] = block(x)

    def backward():
        # the autograd graph ends with its pass, as in training (eager_ops.passes says why)
        y = state.pop("y")
        y.backward(grad)
        state["out"] = y.detach()

    out: dict = {"form": form, "micro_batch": micro_batch}
    x.grad = None
    forward()
    backward()
    torch.cuda.synchronize()
    y, dx = state["out"].float(), x.grad.detach().clone()
    if reference is not None:
        out["max_abs_diff_y"] = (y - reference["y"]).abs().max().item()
        out["max_abs_diff_dx"] = (dx - reference["dx"]).abs().max().item()
    out["attention_kernel"] = _attention_kernel(forward, backward)
    state.clear()  # no output of an earlier pass counted in or out
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    forward()
    torch.cuda.synchronize()
    out["saved_bytes"] = torch.cuda.memory_allocated() - before - state["y"].numel() * state["y"].element_size()
    backward()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fwd, bwd, host_f, host_b = [], [], [], []
    for _ in range(3):
        forward()
        backward()
    torch.cuda.synchronize()
    for _ in range(repeat):
        marks[0].record()
        issued = time.perf_counter()
        forward()
        host_f.append(1e3 * (time.perf_counter() - issued))
        marks[1].record()
        issued = time.perf_counter()
        backward()
        host_b.append(1e3 * (time.perf_counter() - issued))
        marks[2].record()
        torch.cuda.synchronize()
        fwd.append(marks[0].elapsed_time(marks[1]))
        bwd.append(marks[1].elapsed_time(marks[2]))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    out |= {"eager_F_ms": med(fwd), "eager_B_ms": med(bwd), "host_F_ms": med(host_f), "host_B_ms": med(host_b)}
    try:
        graph = _graph_timings("block", forward, backward, repeat)
        out |= {"graph_F_ms": graph["block-graph-F-ms"], "graph_B_ms": graph["block-graph-B-ms"]}
    except RuntimeError as e:  # recorded, so that the eager figures still come back
        traceback.print_exc()
        out["graph_error"] = str(e).splitlines()[0]
    if reference is None:
        out["_reference"] = {"y": y, "dx": dx}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--timed", default="1,2,4", help="micro-batches")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the forms, interleaved")
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_forms.py: needs a CUDA device")
    config = preset("llama", args.preset)
    head = {"preset": args.preset, "seq_len": args.seq_len, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__}  # fmt: skip
    sink = sys.stdout if args.out == "-" else open(args.out, "w")  # noqa: SIM115 (closed below)
    for round_ in range(args.rounds):
        for b in (int(b) for b in args.timed.split(",")):
            reference = None
            for form in FORMS:
                row = measure(config, form, b, args.seq_len, args.repeat, reference)
                reference = row.pop("_reference", reference)
                sink.write(json.dumps(head | {"round": round_} | row) + "\n")
                sink.flush()
                torch.cuda.empty_cache()
    if sink is not sys.stdout:
        sink.close()


if __name__ == "__main__":
    main()
