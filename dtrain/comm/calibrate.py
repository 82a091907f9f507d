"""Measure the cost model's parameters on the machine at hand.

alpha and beta come from a ping-pong between two ranks (Hockney's method, as in the OSU and Intel MPI
latency benchmarks): for each message size the median half round trip over ``repeats``, then a least-squares
fit ``t = alpha + beta * n``. gamma is the slope of the time to add ``n`` bytes into a buffer on the device
(``torch.add_``). Ranks 0 and 1 measure the intra-node link; with ``local_size`` given and more than one
node, ranks 0 and ``local_size`` measure the inter-node link. Rank 0 broadcasts the result as a float64
tensor (never a pickle), so every rank returns the same :class:`CostParams`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dtrain.comm.cost import CostParams, LinkCost

__all__ = ["DEFAULT_SIZES", "fit_line", "calibrate", "measure_gamma"]

#: Message sizes in bytes, 1 KiB to 16 MiB by factors of 4.
DEFAULT_SIZES: tuple[int, ...] = tuple(1024 * 4**i for i in range(8))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` on relative error (weights ``1 / y^2``), so that the small sizes that
    fix the start-up count as much as the large ones that fix the slope; both clamped at 0 (a negative
    start-up or slope is noise)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need at least two (x, y) points of equal count, got {len(xs)} and {len(ys)}")
    top = max(ys)
    if top <= 0:
        return 0.0, 0.0
    floor = top * 1e-6  # weights on times scaled to the largest, so that none overflows
    ws = [(top / max(y, floor)) ** 2 for y in ys]
    w, sx, sy = sum(ws), _dot(ws, xs), _dot(ws, ys)
    sxx, sxy = _dot(ws, [x * x for x in xs]), _dot(ws, [x * y for x, y in zip(xs, ys, strict=True)])
    det = w * sxx - sx * sx
    slope = (w * sxy - sx * sy) / det if det else 0.0
    return max(0.0, (sy - slope * sx) / w), max(0.0, slope)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first-touch allocation, connection set-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(peer: int, first: bool, nbytes: int, device, repeats: int, group) -> float:
    """Median half round trip of ``nbytes`` between this rank and global rank ``peer``."""
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def once() -> None:
        if first:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)

    return _median_seconds(once, device, repeats) / 2


def _measure_link(a: int, b: int, sizes, device, repeats: int, group) -> tuple[float, float] | None:
    """(alpha, beta) of the link between group ranks ``a`` and ``b``, on rank ``a`` only (None elsewhere)."""
    me = dist.get_rank(group)
    if me not in (a, b):
        return None
    peer = dist.get_global_rank(group, b if me == a else a) if group is not None else (b if me == a else a)
    times = [_ping_pong(peer, me == a, n, device, repeats, group) for n in sizes]
    return fit_line(sizes, times) if me == a else None


def measure_gamma(device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5) -> float:
    """Seconds per byte to add a received float32 buffer into another on ``device`` (slope of the fit)."""
    times = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        y = torch.ones_like(x)
        times.append(_median_seconds(lambda x=x, y=y: x.add_(y), device, repeats))
    return fit_line(sizes, times)[1]


def calibrate(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 10,
    local_size: int | None = None,
) -> CostParams:
    """Measure alpha, beta (intra and, with ``local_size``, inter) and gamma; every rank gets the same result.

    Call it on every rank of an initialized process group of at least two ranks. ``device`` defaults to the
    current CUDA device on NCCL, else the CPU.
    """
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"calibration needs at least two ranks, the group has {world}")
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"need at least two message sizes >= 1 byte, got {list(sizes)!r}")
    device = torch.device(device) if device is not None else _default_device(group)
    me = dist.get_rank(group)
    intra = _measure_link(0, 1, sizes, device, repeats, group)
    inter = None
    if local_size is not None and 1 <= local_size < world and world % local_size == 0:
        inter = _measure_link(0, local_size, sizes, device, repeats, group)
    values = torch.full((6,), -1.0, dtype=torch.float64, device=device)
    if me == 0:
        gamma = measure_gamma(device, sizes, repeats)
        row = [*intra, gamma, *(inter if inter is not None else (-1.0, -1.0)), gamma]
        values.copy_(torch.tensor(row, dtype=torch.float64))
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(values, root, group=group)
    return _params_from(values.cpu().tolist())


def _params_from(v: list[float]) -> CostParams:
    intra = LinkCost(alpha_s=v[0], beta_s_per_byte=v[1], gamma_s_per_byte=v[2])
    inter = None if v[3] < 0 else LinkCost(alpha_s=v[3], beta_s_per_byte=v[4], gamma_s_per_byte=v[5])
    return CostParams(intra=intra, inter=inter)


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
