"""Measure the cost model's parameters on the machine at hand.

alpha and beta come from a ping-pong between two ranks (Hockney's method, as in the OSU and Intel MPI
latency benchmarks): for each message size the median half round trip over ``repeats``, then a least-squares
fit ``t = alpha + beta * n``. gamma is the slope of the time to add ``n`` bytes into a buffer on the device
(``torch.add_``). Ranks 0 and 1 measure the intra-node link; with ``local_size`` given and more than one
node, ranks 0 and ``local_size`` measure the inter-node link.

alpha_peer, the start-up each further peer adds to a round (see :mod:`dtrain.comm.cost`), comes from two
rounds of the smallest size through the runtime's own transport (all of a round's messages started at once):
``t_all``, every rank of the first node exchanging with every other at once, and ``t_one``, ranks paired
``r <-> r ^ 1`` (an odd one out idles). In the model ``t_one = alpha + n beta`` and ``t_all = alpha +
(q-1)(alpha_peer + n beta) + n beta`` with ``q + 1`` ranks, so ``alpha_peer = (t_all - t_one) / (q-1) - n
beta``, clamped at 0. It needs three ranks in a node (else it stays None: the single-port model), and the
inter-node link keeps the single-port model.

Rank 0 broadcasts the result as a float64 tensor (never a pickle), so every rank returns the same
:class:`CostParams`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dtrain.comm.cost import CostParams, LinkCost
from dtrain.comm.transport import transport_for

__all__ = ["DEFAULT_SIZES", "GPU_SIZES", "fit_line", "calibrate", "measure_gamma", "measure_alpha_peer"]

#: Message sizes in bytes, 1 KiB to 16 MiB by factors of 4 (CPU).
DEFAULT_SIZES: tuple[int, ...] = tuple(1024 * 4**i for i in range(8))
#: On GPUs a 16 MiB message still takes about as long as the start-up: go to 256 MiB.
GPU_SIZES: tuple[int, ...] = tuple(1024 * 4**i for i in range(10))
#: Fewest repeats of each round that measures alpha_peer: it is a difference of two medians.
_PEER_REPEATS = 20


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Hockney's fit of ``y = a + b x``: the slope ``b`` by least squares over the larger half of the sizes
    (where the bytes, not the start-up, decide the time), then ``a`` as the median of ``y - b x`` over the
    smaller half. Both are clamped at 0 (a negative start-up or slope is noise).

    A single least-squares line over all sizes lets either end swamp the other: on GPUs a 50 us start-up
    hides a 16 MiB transfer, and on CPUs the largest sizes' noise moves the intercept by milliseconds.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need at least two (x, y) points of equal count, got {len(xs)} and {len(ys)}")
    points = sorted(zip(xs, ys, strict=True))
    half = len(points) // 2
    large = points[half:] if len(points) - half >= 2 else points
    mx = sum(x for x, _ in large) / len(large)
    my = sum(y for _, y in large) / len(large)
    sxx = sum((x - mx) ** 2 for x, _ in large)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in large) / sxx) if sxx else 0.0
    small = points[: max(1, half)]
    intercept = statistics.median(y - slope * x for x, y in small)
    return max(0.0, intercept), slope


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


def _exchange_seconds(peers: list[int], nbytes: int, device: torch.device, repeats: int, group) -> float:
    """Median seconds of one round in which this rank sends ``nbytes`` to and receives ``nbytes`` from each
    of ``peers`` (group ranks), all started at once through the runtime's transport; 0 with no peers."""
    if not peers:
        return 0.0
    transport = transport_for(group)
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    sends = [(peer, payload) for peer in peers]
    recvs = [(peer, torch.empty_like(payload)) for peer in peers]

    def once() -> None:
        for pending in transport.start(sends, recvs):
            pending.wait()

    return _median_seconds(once, device, repeats)


def measure_alpha_peer(
    ranks: int, nbytes: int, beta_s_per_byte: float, device: torch.device, repeats: int, group=None
) -> float | None:
    """Seconds each further peer adds to a round's start-up, measured among group ranks ``0 .. ranks-1``
    (the others idle); the estimate on rank 0, None on the others or with fewer than three ranks.

    Call it on every rank of the group. ``beta_s_per_byte`` removes the bytes the further peers add.
    """
    me = dist.get_rank(group)
    if ranks < 3:
        return None
    inside = me < ranks
    one = [me ^ 1] if inside and (me ^ 1) < ranks else []
    t_one = _exchange_seconds(one, nbytes, device, repeats, group)
    everyone = [r for r in range(ranks) if r != me] if inside else []
    t_all = _exchange_seconds(everyone, nbytes, device, repeats, group)
    if me != 0:
        return None
    return max(0.0, (t_all - t_one) / (ranks - 2) - nbytes * beta_s_per_byte)


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
    sizes: Sequence[int] | None = None,
    repeats: int = 10,
    local_size: int | None = None,
) -> CostParams:
    """Measure alpha, beta (intra and, with ``local_size``, inter), gamma and the intra alpha_peer; every rank
    gets the same result.

    Call it on every rank of an initialized process group of at least two ranks. ``device`` defaults to the
    current CUDA device on NCCL, else the CPU.
    """
    world = dist.get_world_size(group)
    device = torch.device(device) if device is not None else _default_device(group)
    if sizes is None:
        sizes = GPU_SIZES if device.type == "cuda" else DEFAULT_SIZES
    if world < 2:
        raise ValueError(f"calibration needs at least two ranks, the group has {world}")
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"need at least two message sizes >= 1 byte, got {list(sizes)!r}")
    me = dist.get_rank(group)
    intra = _measure_link(0, 1, sizes, device, repeats, group)
    inter = None
    several_nodes = local_size is not None and 1 <= local_size < world and world % local_size == 0
    if several_nodes:
        inter = _measure_link(0, local_size, sizes, device, repeats, group)
    node = local_size if several_nodes else world
    beta = intra[1] if intra is not None else 0.0  # known on rank 0, the only rank that uses it
    alpha_peer = measure_alpha_peer(node, min(sizes), beta, device, max(repeats, _PEER_REPEATS), group)
    values = torch.full((7,), -1.0, dtype=torch.float64, device=device)
    if me == 0:
        gamma = measure_gamma(device, sizes, repeats)
        row = [*intra, gamma, *(inter if inter is not None else (-1.0, -1.0)), gamma]
        row.append(-1.0 if alpha_peer is None else alpha_peer)
        values.copy_(torch.tensor(row, dtype=torch.float64))
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(values, root, group=group)
    return _params_from(values.cpu().tolist())


def _params_from(v: list[float]) -> CostParams:
    alpha_peer = None if v[6] < 0 else v[6]
    intra = LinkCost(alpha_s=v[0], beta_s_per_byte=v[1], gamma_s_per_byte=v[2], alpha_peer_s=alpha_peer)
    inter = None if v[3] < 0 else LinkCost(alpha_s=v[3], beta_s_per_byte=v[4], gamma_s_per_byte=v[5])
    return CostParams(intra=intra, inter=inter)


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
