"""``dtrain bench overlap``: how much a matrix product slows while a collective runs beside it on the same device,
and how much the collective slows beside the product.

Training overlaps communication with compute (data-parallel reductions under the backward, tensor-parallel
collectives under the weight gradients), and the two share the device: the collective's kernels hold
multiprocessors and memory bandwidth, and on a power-capped GPU every watt they draw lowers the clock the product
runs at. Rashidi et al. 2021 ("Enabling Compute-Communication Overlap in Distributed Deep Learning Training
Platforms", ISCA) measured such slowdowns; :mod:`dtrain.sim.step` prices them from what this command measures.

For each product kind (bf16, FP8 where the device has it) and collective (all-reduce, reduce-scatter,
all-gather of ``nbytes``), in ``rounds`` rounds:

- the product loop alone, then beside the collective loop: the collectives are issued first on a stream of their
  own and keep running past the products' end, so every product runs beside one (``product_slowdown``: beside /
  alone);
- the collective loop alone, then beside the product loop, which starts first and outlasts it
  (``collective_slowdown``).

Loop lengths are agreed across ranks (the largest rank's timing decides the counts), each time is the slowest
rank's, the reported factor the median over rounds. The products are one transformer layer's (forward, input and
weight gradients) of ``hidden`` on ``tp`` tensor-parallel ranks, ``tokens`` a micro-batch. On the CPU (Gloo) the
collectives run on Gloo's own thread, the products on the caller's, timed by the wall clock.

Where the collectives go through the network path (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``: NCCL's proxy and
its network transport, as between servers) each record's ``path`` says ``network``; with ``NCCL_P2P_DISABLE=1``
alone, ``shm`` (NCCL's shared-memory transport); else ``nvlink`` on GPUs and ``host`` on the CPU.
``--write-curves`` stores the median factors by path in the simulator's curve file.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.comm import native
from dtrain.launch import rank_device, run_ranks

__all__ = ["COLLECTIVES", "OverlapConfig", "layer_shapes", "path_name", "run", "overlap_on_rank", "factors"]

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


@dataclass(frozen=True)
class OverlapConfig:
    nproc: int = 2
    nbytes: int = 128 << 20
    hidden: int = 12288
    tp: int = 4
    tokens: int = 2048
    seconds: float = 0.5  # the shorter loop of each pair
    rounds: int = 3
    collectives: tuple[str, ...] = COLLECTIVES

    def __post_init__(self) -> None:
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise ValueError(f"--collectives: {', '.join(bad) or 'none given'}; choose from {', '.join(COLLECTIVES)}")
        twice = next((c for i, c in enumerate(self.collectives) if c in self.collectives[:i]), None)
        if twice is not None:
            raise ValueError(f"--collectives: {twice} given twice")
        for flag, value in (("--nproc", self.nproc), ("--bytes", self.nbytes), ("--hidden", self.hidden),
                            ("--tp", self.tp), ("--tokens", self.tokens), ("--rounds", self.rounds)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.nproc < 2:
            raise ValueError(f"--nproc must be >= 2 (a collective needs a peer), got {self.nproc}")
        if self.hidden % self.tp:
            raise ValueError(f"--hidden {self.hidden} must divide by --tp {self.tp}")
        if not 0 < self.seconds < math.inf:
            raise ValueError(f"--seconds must be a finite number > 0, got {self.seconds}")


def layer_shapes(hidden: int, tp: int, tokens: int) -> list[tuple[int, int, int]]:
    """The ``(m, n, k)`` products of one transformer layer on ``tp`` ranks: QKV, attention output and the MLP's
    two, each forward, input gradient and weight gradient."""
    out = []
    for n, k in ((3 * hidden // tp, hidden), (hidden, hidden // tp), (4 * hidden // tp, hidden),
                 (hidden, 4 * hidden // tp)):  # fmt: skip
        out += [(tokens, n, k), (tokens, k, n), (k, n, tokens)]
    return out


def path_name(device: torch.device) -> str:
    """Which way this job's collectives go: "host" (CPU), "network" (NCCL's peer and shared-memory transports
    off), "shm" (the peer transport alone off: NCCL's shared-memory transport), "nvlink"."""
    if device.type != "cuda":
        return "host"
    p2p_off, shm_off = (os.environ.get(name) == "1" for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"))
    if p2p_off:
        return "network" if shm_off else "shm"
    return "nvlink"


def _products(kind: str, shapes, device) -> Callable[[], None]:
    if kind == "bf16":
        pairs = [(torch.randn(m, k, device=device, dtype=torch.bfloat16),
                  torch.randn(k, n, device=device, dtype=torch.bfloat16)) for m, n, k in shapes]  # fmt: skip

        def run_bf16():
            for a, b in pairs:
                a @ b

        return run_bf16
    one = torch.ones((), device=device)
    fp8 = [(torch.randn(m, k, device=device).to(torch.float8_e4m3fn),
            torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()) for m, n, k in shapes]  # fmt: skip

    def run_fp8():
        for a, b in fp8:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return run_fp8


def _collective(name: str, nbytes: int, device, group) -> Callable[[], object]:
    world = dist.get_world_size(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elements = max(world, nbytes // torch.tensor([], dtype=dtype).element_size() // world * world)
    full = torch.randn(elements, device=device, dtype=dtype)
    shard = torch.empty(elements // world, device=device, dtype=dtype)
    if name == "all-reduce":
        return lambda: dist.all_reduce(full, group=group, async_op=True)
    if name == "reduce-scatter":
        return lambda: _reduce_scatter_single(shard, full, group=group, async_op=True)
    return lambda: _all_gather_single(full, shard, group=group, async_op=True)


_all_gather_single, _reduce_scatter_single = native.all_gather_single, native.reduce_scatter_single


class _Clock:
    """Spans of work issued on a stream (CUDA events) or run by the host (wall clock)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _largest(value: float, device, group) -> float:
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _sync(device, group) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)


def _loop_alone(fn, reps: int, clock: _Clock, stream, device, group, waits: bool) -> float:
    _sync(device, group)
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        start = clock.mark(stream)
        works = [fn() for _ in range(reps)]
        if waits:
            for w in works:
                w.wait()
        end = clock.mark(stream)
    seconds = clock.seconds(start, end)
    return _largest(seconds, device, group)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _beside(lead, lead_reps, follow, follow_reps, *, lead_is_collective, clock, streams, device, group):
    """Issue ``lead`` first (a head start of a tenth of its calls), then ``follow`` interleaved with the rest of
    ``lead``; ``lead``'s calls are spread so that it outlasts ``follow``. Returns the follower's span."""
    lead_stream, follow_stream = streams if lead_is_collective else streams[::-1]
    cuda = device.type == "cuda"
    _sync(device, group)
    works = []
    issued = 0

    def issue_lead(until):
        nonlocal issued
        with torch.cuda.stream(lead_stream) if cuda else _null():
            while issued < until:
                out = lead()
                if lead_is_collective:
                    works.append(out)
                issued += 1

    if cuda or lead_is_collective:
        # on the CPU every collective is queued on Gloo's thread at once; on a GPU a tenth leads
        issue_lead(max(1, lead_reps // 10) if cuda else lead_reps)
        with torch.cuda.stream(follow_stream) if cuda else _null():
            start = clock.mark(follow_stream)
        mine = []
        for i in range(follow_reps):
            with torch.cuda.stream(follow_stream) if cuda else _null():
                out = follow()
                if not lead_is_collective:
                    mine.append(out)
            if cuda:
                issue_lead(int((i + 1) * 0.7 * lead_reps / follow_reps))
        with torch.cuda.stream(follow_stream) if cuda else _null():
            for w in mine:  # the follower's stream waits for its collectives before its end mark
                w.wait()
            end = clock.mark(follow_stream)
        issue_lead(lead_reps)
        for w in works:
            w.wait()
        span = clock.seconds(start, end)
    else:
        # the CPU: the host runs the products, so the collectives are issued first, all of them, on Gloo's thread
        works = [follow() for _ in range(follow_reps)]
        ended: list[float] = []  # each collective's end, stamped by Gloo's thread as it completes
        for w in works:
            w.get_future().add_done_callback(lambda _: ended.append(time.perf_counter()))
        start = time.perf_counter()
        for _ in range(lead_reps):
            lead()
        for w in works:
            w.wait()
        settle = time.perf_counter() + 1.0  # a callback may run just after its wait() returns
        while len(ended) < len(works) and time.perf_counter() < settle:
            time.sleep(1e-4)
        last = max(ended) if len(ended) == len(works) else time.perf_counter()  # a callback missing: the wait's end
        span = max(0.0, last - start)
    if cuda:
        torch.cuda.synchronize(device)
    return _largest(span, device, group)


def overlap_on_rank(config: OverlapConfig, group=None) -> list[dict]:
    """Every rank of ``group`` (default: the default group) runs this; its rank 0 returns the records."""
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    clock = _Clock(device)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else (None, None)
    shapes = layer_shapes(config.hidden, config.tp, config.tokens)
    kinds = ["bf16"]
    from dtrain.bench.compute import has_fp8

    if device.type == "cuda" and has_fp8(torch, device):
        kinds.append("fp8")
    path = path_name(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
    records = []
    for kind in kinds:
        product = _products(kind, shapes, device)
        flops = sum(2.0 * m * n * k for m, n, k in shapes)
        one = _loop_alone(product, 2, clock, streams[1], device, group, False) / 2
        for coll in config.collectives:
            call = _collective(coll, config.nbytes, device, group)
            call().wait()
            c_one = _loop_alone(call, 2, clock, streams[0], device, group, True) / 2
            p_reps = max(1, round(config.seconds / one))
            c_reps = max(1, round(config.seconds / c_one))
            rounds = []
            for _ in range(config.rounds):
                p_alone = _loop_alone(product, p_reps, clock, streams[1], device, group, False)
                # the collectives outlast the products by half again
                where = {"clock": clock, "streams": streams, "device": device, "group": group}
                p_beside = _beside(call, max(2, round(1.5 * p_alone / c_one)), product, p_reps,
                                   lead_is_collective=True, **where)  # fmt: skip
                c_alone = _loop_alone(call, c_reps, clock, streams[0], device, group, True)
                c_beside = _beside(product, max(2, round(1.5 * c_alone / one)), call, c_reps,
                                   lead_is_collective=False, **where)  # fmt: skip
                rounds.append((p_alone, p_beside, c_alone, c_beside))
            p_alone, p_beside, c_alone, c_beside = (statistics.median(r[i] for r in rounds) for i in range(4))
            records.append({
                "device": name, "world": dist.get_world_size(group), "backend": dist.get_backend(group), "path": path,
                "nccl": nccl, "torch": torch.__version__, "product": kind, "collective": coll, "bytes": config.nbytes,
                "hidden": config.hidden, "tp": config.tp, "tokens": config.tokens, "rounds": config.rounds,
                "product_s": p_alone / p_reps, "product_tflops": flops * p_reps / p_alone / 1e12,
                "collective_s": c_alone / c_reps, "collective_gbps": config.nbytes * c_reps / c_alone / 1e9,
                "product_slowdown": statistics.median(r[1] / r[0] for r in rounds),
                "collective_slowdown": statistics.median(r[3] / r[2] for r in rounds),
            })  # fmt: skip
    return records if dist.get_rank(group) == 0 else []


def run(config: OverlapConfig) -> list[dict]:
    """Measure on ``config.nproc`` local ranks (or the torchrun job this process is in); rank 0's records."""
    from dtrain.bench.comm import check_fits, local_ranks

    check_fits("--bytes", config.nbytes, local_ranks(config.nproc), cpu=not torch.cuda.is_available())
    return run_ranks(overlap_on_rank, config.nproc, config)


def factors(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """The simulator's entry (:class:`dtrain.sim.compute.Beside`): by path and product precision, the median
    product and collective slowdown over the collectives measured."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for path, precision in sorted({(r["path"], r["product"]) for r in records}):
        rows = [r for r in records if r["path"] == path and r["product"] == precision]
        out.setdefault(path, {})[precision] = {
            "product": round(statistics.median(r["product_slowdown"] for r in rows), 4),
            "collective": round(statistics.median(r["collective_slowdown"] for r in rows), 4),
        }
    return out
