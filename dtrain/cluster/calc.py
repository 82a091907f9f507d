"""Back-of-the-envelope bandwidth figures of data-parallel training, from first principles and for any variant.

A 175e9-parameter model (GPT-3's size, Brown et al. 2020) in 32-bit floats makes 175e9 x 4 bytes = 700 GB of
gradients per data-parallel replica per iteration; averaging 3 replicas by gathering them to one place moves
700 GB x (3 - 1) = 1.4 TB into it, and broadcasting the average back another 1.4 TB out; 1 TB over a 200 Gb/s
link (25 GB/s) takes at least 1e12 / 25e9 = 40 s. A ring all-reduce (a reduce-scatter then an all-gather,
Thakur, Rabenseifner and Gropp 2005) spreads that traffic over every replica instead: each sends and receives
2 (N-1)/N of the gradients. A ToR whose servers can send more than its uplinks carry is oversubscribed (two
servers at 10 Gb/s into one 10 Gb/s uplink: 1:2; Al-Fares et al., SIGCOMM 2008).

Every time here is ``latency + bytes / rate`` on one link, or for a collective the alpha-beta-gamma closed form
of :mod:`dtrain.comm.cost.forms` with alpha the link's latency and beta its seconds per byte.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dtrain.cluster import units
from dtrain.cluster.catalogue import link_spec
from dtrain.comm.cost.forms import CLOSED_FORMS
from dtrain.comm.cost.model import CostParams, LinkCost, predict
from dtrain.comm.ir.schedule import Collective

__all__ = [
    "Rate",
    "Averaging",
    "AllReduceTime",
    "rate",
    "gradient_bytes",
    "transfer_seconds",
    "averaging",
    "oversubscription_ratio",
    "all_reduce_times",
]


@dataclass(frozen=True, kw_only=True)
class Rate:
    """A link to compute on: one direction's ``bytes_per_s``, one message's ``latency_s``, and what it is."""

    label: str
    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or not self.latency_s >= 0:
            raise ValueError(f"link {self.label}: rate must be > 0 and latency >= 0, got {self.bytes_per_s!r}, "
                             f"{self.latency_s!r}")  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self) | {"gbit_per_s": units.bytes_per_s_to_gbit_per_s(self.bytes_per_s)}


def rate(
    kind: str | None = None,
    *,
    count: int = 1,
    gbit_per_s: float | None = None,
    gbyte_per_s: float | None = None,
    latency_s: float | None = None,
) -> Rate:
    """A :class:`Rate` from a catalogue link ``kind`` (``count`` of them together), or from a rate given in Gb/s
    (bits) or GB/s (bytes); exactly one of the three."""
    given = [name for name, value in (("kind", kind), ("gbit_per_s", gbit_per_s), ("gbyte_per_s", gbyte_per_s))
             if value is not None]  # fmt: skip
    if len(given) != 1:
        raise ValueError(f"give exactly one of a link kind, gbit_per_s or gbyte_per_s; got {given or 'none'}")
    if count < 1:
        raise ValueError(f"link count must be >= 1, got {count}")
    if kind is not None:
        spec = link_spec(kind)
        label = spec.key if count == 1 else f"{count} x {spec.key}"
        latency = spec.latency_s if latency_s is None else latency_s
        return Rate(label=label, bytes_per_s=count * spec.bytes_per_s, latency_s=latency)
    if gbit_per_s is not None:
        bytes_per_s, label = units.gbit_per_s_to_bytes_per_s(gbit_per_s), f"{gbit_per_s:g} Gb/s"
    else:
        bytes_per_s, label = units.gbyte_per_s_to_bytes_per_s(gbyte_per_s), f"{gbyte_per_s:g} GB/s"
    return Rate(label=label, bytes_per_s=bytes_per_s, latency_s=latency_s or 0.0)


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def gradient_bytes(params: float, bytes_per_param: float) -> float:
    """One replica's gradients per iteration: ``params x bytes_per_param`` (175e9 x 4 = 700 GB)."""
    return _positive(params, "params") * _positive(bytes_per_param, "bytes_per_param")


def transfer_seconds(nbytes: float, link: Rate) -> float:
    """``latency + nbytes / rate``: 1 TB over 200 Gb/s (25e9 B/s) is 40 s."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return link.latency_s + nbytes / link.bytes_per_s


@dataclass(frozen=True, kw_only=True)
class Averaging:
    """Averaging ``replicas`` gradients of ``gradient_bytes`` each, one way: the bytes on the wire in total,
    the most one replica sends or receives (one direction of its link), and the time on ``link``."""

    method: str
    replicas: int
    gradient_bytes: float
    total_bytes: float
    busiest_replica_bytes: float
    seconds: float


def averaging(gradient_nbytes: float, replicas: int, link: Rate) -> list[Averaging]:
    """Two ways to average: ``gather-broadcast`` (the N-1 other replicas send to one, which
    sends the average back: (N-1) G in and (N-1) G out of its one link) and ``ring all-reduce``
    (reduce-scatter then all-gather: every replica sends and receives 2 (N-1)/N G, the total still 2 (N-1) G)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    g, n = _positive(gradient_nbytes, "gradient_bytes"), replicas
    alpha = link.latency_s if n > 1 else 0.0
    gather = (n - 1) * g  # into the root, then as much out of it again
    ring = 2 * (n - 1) / n * g
    return [
        Averaging(method="gather-broadcast", replicas=n, gradient_bytes=g, total_bytes=2 * gather,
                  busiest_replica_bytes=gather, seconds=2 * alpha + 2 * gather / link.bytes_per_s),
        Averaging(method="ring all-reduce", replicas=n, gradient_bytes=g, total_bytes=n * ring,
                  busiest_replica_bytes=ring, seconds=2 * (n - 1) * alpha + ring / link.bytes_per_s),
    ]  # fmt: skip


def oversubscription_ratio(servers: int, server_bytes_per_s: float, uplink_bytes_per_s: float) -> float:
    """What the servers under a ToR can send at once over what its uplinks carry (2.0 is 1:2)."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    down = servers * _positive(server_bytes_per_s, "server rate")
    return down / _positive(uplink_bytes_per_s, "uplink rate")


@dataclass(frozen=True, kw_only=True)
class AllReduceTime:
    """One all-reduce algorithm's predicted time, and its closed form's docstring (the formula)."""

    algorithm: str
    seconds: float
    formula: str


def all_reduce_times(
    nbytes: float,
    ranks: int,
    link: Rate,
    *,
    reduce_bytes_per_s: float | None = None,
    local_size: int | None = None,
    intra: Rate | None = None,
) -> list[AllReduceTime]:
    """Every all-reduce algorithm with a closed form, fastest first: alpha = ``link.latency_s``, beta = 1 /
    ``link.bytes_per_s``, gamma = 1 / ``reduce_bytes_per_s`` (None: reductions free). With ``local_size``
    ranks per node joined by ``intra``, ``link`` is between nodes and the hierarchical algorithm is priced too."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    gamma = 0.0 if reduce_bytes_per_s is None else 1 / _positive(reduce_bytes_per_s, "reduce_bytes_per_s")
    inter = LinkCost(alpha_s=link.latency_s, beta_s_per_byte=1 / link.bytes_per_s, gamma_s_per_byte=gamma)
    params = CostParams(intra=inter)
    if local_size is not None:
        if intra is None:
            raise ValueError("local_size needs the link inside a node (intra)")
        inside = LinkCost(alpha_s=intra.latency_s, beta_s_per_byte=1 / intra.bytes_per_s, gamma_s_per_byte=gamma)
        params = CostParams(intra=inside, inter=inter)
    times = []
    for (collective, algorithm), form in CLOSED_FORMS.items():
        if collective != Collective.ALL_REDUCE or (form.needs_local_size and local_size in (None, 1, ranks)):
            continue
        seconds = predict(collective, algorithm, round(nbytes), ranks, params, local_size=local_size)
        formula = " ".join((form.seconds.__doc__ or "").split())
        times.append(AllReduceTime(algorithm=algorithm, seconds=seconds, formula=formula))
    return sorted(times, key=lambda t: t.seconds)
