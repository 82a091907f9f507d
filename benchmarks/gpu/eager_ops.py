"""Usage: python benchmarks/gpu/eager_ops.py [--preset 1b] [--micro-batch 2] [--seq-len 2048] [--out FILE]

What one micro-batch of dtrain's eager decoder costs on one device, operation by operation: a block, and the
head with its loss, forward and backward under bf16 autocast with float32 weights (``dtrain train --precision
bf16``), as ``dtrain train`` runs them outside a CUDA graph. Three views of the same passes, one JSON line each:

- ``record: "ops"``: every aten operation the passes dispatch (a ``TorchDispatchMode``), with its inputs' and
  outputs' shapes and dtypes and the bytes it reads and writes, by pass (``F``, ``B``) and part (block, head);
- ``record: "kernels"``: ``torch.profiler``'s device time and calls per aten operation, a pass's mean over
  ``--repeat`` passes, for the forward alone (``F``) and the forward with its backward (``FB``);
- ``record: "timing"``: CUDA-event times of the forward and the backward, eager and replayed as CUDA graphs
  (the difference is the host's share), and the host's time to issue each eager pass, for each micro-batch of
  ``--timed``.

The simulator's ``kernels = "dtrain"`` operation set (``dtrain.sim.compute``) is checked against the ``ops``
record, and its prices against the other two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtrain.models.decoder import Block, Head
from dtrain.models.presets import preset


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _describe(tensors: list[torch.Tensor]) -> list[list]:
    return [[list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()] for t in tensors]


class Recorder(TorchDispatchMode):
    """Every aten operation dispatched, with what it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict] = []
        self.tag = ("", "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        if name not in ("detach", "view", "_unsafe_view", "t", "transpose", "expand", "permute", "alias", "split"):
            ins, outs = _tensors((args, kwargs)), _tensors(out)
            self.ops.append(
                {
                    "part": self.tag[0],
                    "pass": self.tag[1],
                    "op": str(func),
                    "inputs": _describe(ins),
                    "outputs": _describe(outs),
                }
            )
        return out


def passes(config, micro_batch: int, seq_len: int, device: torch.device):
    """The block's and the head's forward and backward, as closures over fresh float32 modules."""
    torch.manual_seed(0)
    block, head = Block(config).to(device), Head(config).to(device)
    x = torch.randn(micro_batch, seq_len, config.hidden_size, device=device, requires_grad=True)
    targets = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
    dtype = torch.bfloat16
    state: dict = {}

    def block_forward():
        with torch.autocast(device.type, dtype=dtype, cache_enabled=False):
            state["y"] = block(x)

    def block_backward():
        # the autograd graph ends with its pass, as in training: one kept alive into the next forward keeps its
        # gradient accumulators, which remember the stream they were made on, and a backward recorded as a CUDA
        # graph on another stream then has to wait on that one (torch's AccumulateGrad stream check), which the
        # capture refuses ("operation would make the legacy stream depend on a capturing blocking stream")
        y = state.pop("y")
        y.backward(torch.ones_like(y))

    def head_forward():
        with torch.autocast(device.type, dtype=dtype, cache_enabled=False):
            logits = head(x)
            state["loss"] = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    def head_backward():
        state.pop("loss").backward()

    return {"block": (block_forward, block_backward), "head": (head_forward, head_backward)}


def record_ops(parts) -> list[dict]:
    recorder = Recorder()
    for part, (forward, backward) in parts.items():
        with recorder:
            recorder.tag = (part, "F")
            forward()
            recorder.tag = (part, "B")
            backward()
    return recorder.ops


def kernel_times(parts, device: torch.device, repeat: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out: dict = {}
    for part, (forward, backward) in parts.items():
        for name, both in (("F", False), ("FB", True)):
            with profile(activities=activities) as prof:
                for _ in range(repeat):
                    forward()
                    if both:
                        backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            table = defaultdict(lambda: [0.0, 0])
            for event in prof.key_averages():
                us = getattr(event, "self_device_time_total", 0.0) or 0.0
                if us > 0:
                    table[event.key][0] += us / repeat
                    table[event.key][1] += event.count // repeat
            out[f"{part}-{name}"] = {k: [round(v[0], 2), v[1]] for k, v in sorted(table.items())}
    return out


def _graph_timings(part: str, forward, backward, repeat: int) -> dict:
    """The same passes as CUDA graphs: the device alone."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
        backward()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for fn in (forward, backward):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fwd, bwd = [], []
    for _ in range(repeat):
        marks[0].record()
        graphs[0].replay()
        marks[1].record()
        graphs[1].replay()
        marks[2].record()
        torch.cuda.synchronize()
        fwd.append(marks[0].elapsed_time(marks[1]))
        bwd.append(marks[1].elapsed_time(marks[2]))
    return {f"{part}-graph-F-ms": sorted(fwd)[repeat // 2], f"{part}-graph-B-ms": sorted(bwd)[repeat // 2]}


def timings(parts, device: torch.device, repeat: int) -> dict:
    if device.type != "cuda":
        return {}
    out: dict = {}
    for part, (forward, backward) in parts.items():
        for _ in range(3):
            forward()
            backward()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        fwd, bwd, host_f, host_b = [], [], [], []
        for _ in range(repeat):
            starts[0].record()
            issued = time.perf_counter()
            forward()
            host_f.append(1e3 * (time.perf_counter() - issued))
            starts[1].record()
            issued = time.perf_counter()
            backward()
            host_b.append(1e3 * (time.perf_counter() - issued))
            starts[2].record()
            torch.cuda.synchronize()
            fwd.append(starts[0].elapsed_time(starts[1]))
            bwd.append(starts[1].elapsed_time(starts[2]))
        out[f"{part}-eager-F-ms"] = sorted(fwd)[repeat // 2]
        out[f"{part}-eager-B-ms"] = sorted(bwd)[repeat // 2]
        # the host's time to issue each pass (the device may finish later): past the device's, the host sets the pace
        out[f"{part}-host-F-ms"] = sorted(host_f)[repeat // 2]
        out[f"{part}-host-B-ms"] = sorted(host_b)[repeat // 2]
        try:
            out |= _graph_timings(part, forward, backward, repeat)
        except RuntimeError as e:  # recorded, so that the eager figures still come back
            traceback.print_exc()
            out[f"{part}-graph-error"] = str(e).splitlines()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--micro-batch", type=int, default=2, help="of the ops and kernels records")
    parser.add_argument("--timed", default="1,2,4", help="micro-batches of the timing records")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset("llama", args.preset)
    started = time.perf_counter()
    head = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    sink = sys.stdout if args.out == "-" else open(args.out, "w")  # noqa: SIM115 (closed below)

    def write(line: dict) -> None:
        sink.write(json.dumps(head | line) + "\n")
        sink.flush()

    # every input drawn before any capture: a capture that fails can leave the generator unusable outside one
    timed = {b: passes(config, b, args.seq_len, device) for b in (int(b) for b in args.timed.split(","))}
    parts = passes(config, args.micro_batch, args.seq_len, device)
    write({"record": "ops", "micro_batch": args.micro_batch, "ops": record_ops(parts)})
    write({"record": "kernels", "micro_batch": args.micro_batch, "kernels": kernel_times(parts, device, args.repeat)})
    del parts
    for b, parts in timed.items():
        write({"record": "timing", "micro_batch": b, "timing": timings(parts, device, args.repeat)})
    if sink is not sys.stdout:
        sink.close()
    print(f"eager_ops: {args.preset} s{args.seq_len} in {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
