"""Measure the cost model's parameters on the machine at hand.

alpha is the larger of the ping-pong's start-up and what one round of our runtime costs at the smallest
size (:func:`measure_round_alpha`): the model prices the runtime's rounds, host time included. The
per-pair ``beta_peer`` comes from a ping-pong between two ranks (Hockney's method, as in the OSU
and Intel MPI latency benchmarks): for each message size the median half round trip over ``repeats``, then a
fit ``t = alpha + beta_peer * n`` (:func:`fit_line`). A ping-pong measures one pair of ranks only, and a rank
that talks to several peers at once moves more in total than one pair does (on 4 H200s over NCCL about 305
GB/s against 130-160): the rank's ``beta`` is the least-squares slope of the time of a round in which every
rank of the first node exchanges ``n`` bytes with every other at once (through the runtime's transport),
against the ``(q-1) n`` bytes each rank moves, over the larger half of the sizes. With two ranks in a node the
two are the same link: ``beta`` is the ping-pong's slope and ``beta_peer`` None. gamma is the slope of the
time to add ``n`` bytes into a buffer on the device (``torch.add_``). Ranks 0 and 1 measure the intra-node
link; with ``local_size`` given and more than one node, ranks 0 and ``local_size`` measure the inter-node
link (its ping-pong slope is its ``beta``; it keeps no per-pair limit and the single-port model).

alpha_peer, the start-up each further peer adds to a round (see :mod:`dtrain.comm.cost.model`), comes from two
rounds of the smallest size through the runtime's own transport (all of a round's messages started at once):
``t_all``, every rank of the first node exchanging with every other at once, and ``t_one``, ranks paired
``r <-> r ^ 1`` (an odd one out idles). In the model ``t_one = alpha + wire(n, n)`` and ``t_all = alpha +
(q-1) alpha_peer + wire(q n, n)`` with ``q + 1`` ranks and ``wire(m, m_pair) = max(beta m, beta_peer
m_pair)``, so ``alpha_peer = (t_all - t_one - wire(q n, n) + wire(n, n)) / (q-1)``, clamped at 0. It needs
three ranks in a node (else it stays None: the single-port model).

Rank 0 broadcasts the result as a float64 tensor (never a pickle), so every rank returns the same
:class:`CostParams`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dtrain.comm.cost.model import CostParams, LinkCost
from dtrain.comm.p2p.transport import transport_for

__all__ = [
    "DEFAULT_SIZES",
    "GPU_SIZES",
    "fit_line",
    "calibrate",
    "measure_gamma",
    "measure_alpha_peer",
    "measure_rank_beta",
    "measure_round_alpha",
]

#: Message sizes in bytes, 1 KiB to 16 MiB by factors of 4 (CPU).
DEFAULT_SIZES: tuple[int, ...] = tuple(1024 * 4**i for i in range(8))
#: On GPUs a 16 MiB message still takes about as long as the start-up: go to 64 MiB. Larger messages switch
#: NCCL to another regime (a different protocol and chunking) that the same line does not fit.
GPU_SIZES: tuple[int, ...] = tuple(1024 * 4**i for i in range(9))
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
    slope = _slope(_larger_half(points))
    small = points[: max(1, half)]
    intercept = statistics.median(y - slope * x for x, y in small)
    return max(0.0, intercept), slope


def _larger_half(items: Sequence) -> list:
    """The larger half of ``items``, in ascending order; all of them where that half is a single one."""
    items = sorted(items)
    half = len(items) // 2
    return items[half:] if len(items) - half >= 2 else items


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``y`` against ``x``, clamped at 0 (0 where every ``x`` is the same)."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0


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


def _everyone_else(ranks: int, me: int) -> list[int]:
    """Group ranks ``0 .. ranks-1`` other than ``me``; none when ``me`` is not among them (it idles)."""
    return [r for r in range(ranks) if r != me] if me < ranks else []


def measure_alpha_peer(
    ranks: int,
    nbytes: int,
    beta_s_per_byte: float,
    device: torch.device,
    repeats: int,
    group=None,
    *,
    beta_peer_s_per_byte: float | None = None,
) -> float | None:
    """Seconds each further peer adds to a round's start-up, measured among group ranks ``0 .. ranks-1``
    (the others idle); the estimate on rank 0, None on the others or with fewer than three ranks.

    Call it on every rank of the group. ``beta_s_per_byte`` and ``beta_peer_s_per_byte`` (the rank's and one
    pair's, as in :class:`LinkCost`) remove the bytes the further peers add.
    """
    me = dist.get_rank(group)
    if ranks < 3:
        return None
    one = [me ^ 1] if me < ranks and (me ^ 1) < ranks else []
    t_one = _exchange_seconds(one, nbytes, device, repeats, group)
    t_all = _exchange_seconds(_everyone_else(ranks, me), nbytes, device, repeats, group)
    if me != 0:
        return None
    link = LinkCost(
        alpha_s=0.0, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=0.0, beta_peer_s_per_byte=beta_peer_s_per_byte
    )
    extra_bytes_s = link.wire_s((ranks - 1) * nbytes, nbytes) - link.wire_s(nbytes, nbytes)
    return max(0.0, (t_all - t_one - extra_bytes_s) / (ranks - 2))


def measure_rank_beta(ranks: int, sizes: Sequence[int], device: torch.device, repeats: int, group=None) -> float | None:
    """Seconds per byte a rank moves to and from all its peers together: the least-squares slope of the time
    of a round in which each of group ranks ``0 .. ranks-1`` exchanges ``n`` bytes with every other at once,
    against the ``(ranks-1) n`` bytes each moves, over the larger half of ``sizes``. The estimate on rank 0,
    None on the others or with fewer than three ranks (then one pair is the whole of a rank's traffic).

    Call it on every rank of the group; ranks from ``ranks`` on idle.
    """
    me = dist.get_rank(group)
    if ranks < 3:
        return None
    peers = _everyone_else(ranks, me)
    points = [((ranks - 1) * n, _exchange_seconds(peers, n, device, repeats, group)) for n in _larger_half(sizes)]
    return _slope(points) if me == 0 else None


def measure_gamma(device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5) -> float:
    """Seconds per byte to add a received float32 buffer into another on ``device`` (slope of the fit)."""
    times = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        y = torch.ones_like(x)
        times.append(_median_seconds(lambda x=x, y=y: x.add_(y), device, repeats))
    return fit_line(sizes, times)[1]


def measure_round_alpha(device: torch.device, repeats: int, group) -> float:
    """Seconds one round of *our runtime* costs at the smallest size: a one-element ring all-reduce
    (2(p-1) one-peer rounds) timed back to back as nccl-tests does, divided by its rounds.

    This is the start-up the model must price: it holds the transport's latency and the host time of a
    round (plan lookup, the process group's bookkeeping, the reduction's launch), which a bare ping-pong
    leaves out. Every rank takes part and returns the same value.
    """
    from dtrain import comm

    world = dist.get_world_size(group)
    x = torch.ones(1, device=device)
    for _ in range(3):
        comm.all_reduce(x, group=group, algorithm="ring")
    iters = max(repeats, 10)
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x, group=group, algorithm="ring")
    _sync(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return seconds.item() / (2 * (world - 1))


def calibrate(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    sizes: Sequence[int] | None = None,
    repeats: int = 10,
    local_size: int | None = None,
) -> CostParams:
    """Measure alpha, beta (intra and, with ``local_size``, inter), gamma and the intra alpha_peer and
    beta_peer; every rank gets the same result.

    Call it on every rank of an initialized process group of at least two ranks. ``device`` defaults to the
    current CUDA device on NCCL, else the CPU.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"calibrate: repeats must be a whole number >= 1, got {repeats!r}")
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
    rank_beta = measure_rank_beta(node, sizes, device, repeats, group)
    # known on rank 0, the only rank that uses them; with no rank measure the pair is the rank's whole link
    alpha, pair_beta = intra if intra is not None else (0.0, 0.0)
    # a round of the runtime costs more than the ping-pong's bare message: price the round
    alpha = max(alpha, measure_round_alpha(device, repeats, group))
    beta, beta_peer = (pair_beta, None) if rank_beta is None else (rank_beta, pair_beta)
    peer_repeats = max(repeats, _PEER_REPEATS)
    alpha_peer = measure_alpha_peer(node, min(sizes), beta, device, peer_repeats, group, beta_peer_s_per_byte=beta_peer)
    values = torch.full((8,), -1.0, dtype=torch.float64, device=device)
    if me == 0:
        gamma = measure_gamma(device, sizes, repeats)
        row = [alpha, beta, gamma, *(inter if inter is not None else (-1.0, -1.0)), gamma]
        row += [-1.0 if alpha_peer is None else alpha_peer, -1.0 if beta_peer is None else beta_peer]
        values.copy_(torch.tensor(row, dtype=torch.float64))
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(values, root, group=group)
    return _params_from(values.cpu().tolist())


def _params_from(v: list[float]) -> CostParams:
    """CostParams from the broadcast vector: intra alpha, beta, gamma; inter alpha, beta, gamma (-1: no
    inter link); intra alpha_peer, beta_peer (-1: None)."""
    alpha_peer, beta_peer = (None if x < 0 else x for x in v[6:8])
    intra = LinkCost(alpha_s=v[0], beta_s_per_byte=v[1], gamma_s_per_byte=v[2])
    intra = dataclasses.replace(intra, alpha_peer_s=alpha_peer, beta_peer_s_per_byte=beta_peer)
    inter = None if v[3] < 0 else LinkCost(alpha_s=v[3], beta_s_per_byte=v[4], gamma_s_per_byte=v[5])
    return CostParams(intra=intra, inter=inter)


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
