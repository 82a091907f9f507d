"""Measured choices for ``algorithm="auto"``: which path was fastest, by collective and size.

``auto`` never loses to the backend's own collective by construction: it follows a measurement, and with none
it is ``native``. The cost model prices our algorithms from a few calibrated figures, but it does not price
NCCL's or Gloo's own collectives, so it cannot show a win over them; measured on 4 H100s, the model's picks ran
at 0.24-0.96x NCCL's speed. A rules file records what a sweep measured instead, as Open MPI's tuned collectives
read a dynamic rules file (``coll_tuned_dynamic_rules_filename``): for each collective, from which buffer size
which path was fastest, ``native`` among the candidates. ``dtrain bench comm --rules-out`` writes one from its
sweep; ``auto`` reads it first, then the built-in rules (:data:`BUILT_IN`, measured on the machines
docs/results.md names); a rule naming :data:`MODEL` hands the choice among our algorithms to the cost model,
and a call no rule covers runs ``native``.

A rule holds between measured sizes up to their geometric midpoint; below the smallest measured size the
smallest one's winner holds, above the largest the largest's. The file is JSON::

    {"kind": "cuda-peer", "world_size": 4, "local_size": null,
     "rules": {"all_reduce": [[0, "native"], [50331648, "ring"]]}, "meta": {...}}

A rule may name an algorithm with the transport to run it on, ``"ring@peer"`` or ``"ring@p2p"``: a group whose
``DTRAIN_COMM_TRANSPORT`` is ``auto`` then runs that size band on that transport (on the CPU, the /dev/shm peer
transport where it measured faster than Gloo's messages), whatever the group's default transport.

Where ``auto`` looks (:func:`lookup_paths`): ``$DTRAIN_COMM_RULES`` if set; else the per-machine cache that
``dtrain bench calibrate --rules`` (or ``DTRAIN_COMM_AUTOTUNE=1``) writes, :func:`cache_path`, keyed by host name,
kind, group size, transport setting and torch version under ``$XDG_CACHE_HOME/dtrain`` (default
``~/.cache/dtrain``); else ``~/.cache/dtrain/rules-{kind}.json`` (``dtrain bench comm --rules-out``). A cache file
that cannot be read, or that was measured for another host, group size or torch, is skipped with a one-line
warning (:func:`load_cached`): ``auto`` is then ``native``.

Rank 0 of a group decides: :mod:`dtrain.comm.api` sends rank 0's rules to every rank of the group at its first
``auto`` call, so that every rank chooses alike (ranks choosing differently would wait for each other forever).

Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.env import comm_env

__all__ = [
    "MODEL",
    "NATIVE",
    "NATIVE_WIDE",
    "BUILT_IN",
    "TRANSPORTS",
    "Rules",
    "built_in",
    "from_records",
    "split",
    "rules_path",
    "cache_dir",
    "cache_path",
    "lookup_paths",
    "load_rules",
    "load_cached",
    "save_rules",
]

#: Transports a rule may name after an algorithm (``"ring@peer"``).
TRANSPORTS = ("p2p", "peer")


def _check_names(table: Mapping[str, tuple[tuple[int, str], ...]]) -> None:
    """Every collective a rule names is one, and every algorithm it names is one of that collective's (ours,
    ``native``, :data:`NATIVE_WIDE` or :data:`MODEL`, ours with a transport of :data:`TRANSPORTS`): a typo in a
    rules file would otherwise leave ``auto`` silently on ``native``."""
    from dtrain.comm.ir.algorithms import registry
    from dtrain.comm.ir.schedule import Collective

    for coll, steps in table.items():
        try:
            collective = Collective(coll)
        except ValueError:
            known = ", ".join(c.value for c in Collective)
            raise ValueError(f"rules: unknown collective {coll!r}; known: {known}") from None
        ours = registry.names(collective)
        for _, named in steps:
            name, via = split(named)
            plain = name in (NATIVE, NATIVE_WIDE, MODEL) and via is None
            if not (plain or (name in ours and (via is None or via in TRANSPORTS))):
                choices = ", ".join([NATIVE, NATIVE_WIDE, MODEL, *ours])
                raise ValueError(
                    f"rules: {coll} names {named!r}, not one of its algorithms ({choices}; ours may end in "
                    f"{' or '.join('@' + t for t in TRANSPORTS)})"
                )


def split(name: str) -> tuple[str, str | None]:
    """``"ring@peer"`` -> ("ring", "peer"); ``"ring"`` -> ("ring", None)."""
    algorithm, at, transport = str(name).partition("@")
    return algorithm, (transport if at else None)


@dataclass(frozen=True)
class Rules:
    """Measured winners for one kind of group: ``kind`` ("cuda", "cuda-peer", "cpu", "cpu-peer"), ``world_size``
    and ``local_size`` (ranks per node, None for one node or unknown)."""

    kind: str
    world_size: int
    local_size: int | None = None
    # collective -> ((from_bytes, algorithm), ...) with from_bytes ascending and the first 0
    table: Mapping[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    meta: Mapping[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"rules: kind must be a non-empty string, got {self.kind!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"rules: world_size must be a positive int, got {self.world_size!r}")
        if self.local_size is not None and (not isinstance(self.local_size, int) or self.local_size < 1):
            raise ValueError(f"rules: local_size must be a positive int or null, got {self.local_size!r}")
        for coll, steps in self.table.items():
            if not steps:
                raise ValueError(f"rules: {coll} has no rule")
            starts = [s for s, _ in steps]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
                raise ValueError(f"rules: {coll}'s sizes must start at 0 and rise, got {starts}")
            if not all(isinstance(a, str) and a for _, a in steps):
                raise ValueError(f"rules: {coll} names an algorithm that is not a string: {steps}")
        _check_names(self.table)

    def covers(self, kind: str, world_size: int, local_size: int | None) -> bool:
        return (kind, world_size, local_size) == (self.kind, self.world_size, self.local_size)

    def pick(self, collective: str, nbytes: int) -> str | None:
        """The measured winner for ``collective`` on a buffer of ``nbytes``, or None where there is no rule."""
        steps = self.table.get(str(collective))
        if not steps:
            return None
        chosen = steps[0][1]
        for start, algorithm in steps:
            if nbytes < start:
                break
            chosen = algorithm
        return chosen

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "world_size": self.world_size,
            "local_size": self.local_size,
            "rules": {c: [[s, a] for s, a in steps] for c, steps in self.table.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Rules:
        try:
            table = {
                str(c): tuple((int(s), str(a)) for s, a in steps) for c, steps in dict(data.get("rules", {})).items()
            }
            return cls(
                kind=data["kind"],
                world_size=data["world_size"],
                local_size=data.get("local_size"),
                table=table,
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as err:  # OverflowError: int() of Infinity
            if isinstance(err, ValueError) and str(err).startswith("rules:"):
                raise
            raise ValueError(f"rules: malformed rules data ({type(err).__name__}: {err})") from None


#: The name a rule gives to mean "ask the cost model" (built-in rules cover only what was measured).
MODEL = "model"

#: The backend's own collective (NCCL's, Gloo's): what ``auto`` runs where no rule covers a call.
NATIVE = "native"

#: The backend's own collective on the group's wide communicator (:func:`dtrain.comm.native.wide_group`: NCCL's
#: kernels on more CTAs than NCCL picks), where it measured faster than the default communicator's; ``native`` where
#: no wide communicator can be made or ``DTRAIN_COMM_WIDE=0``.
NATIVE_WIDE = "native_wide"

#: The all-reduce of a CUDA group on the peer transport (one host, NVLink): the one-shot kernels, then the exchange
#: kernel's two-shot form (``direct``), then NCCL's own (:mod:`dtrain.comm.peer.fused`). Side by side with
#: torch.distributed's own NCCL 2.28 call on 4 and 2 H100s (torch 2.11, NVLink multicast off, float32, calls back
#: to back, rounds interleaved; benchmarks/results/collectives_defaults*-h100x{4,2}.jsonl,
#: one_shot_ar*-h100x{4,2}.jsonl, two_shot*-h100x{4,2}.jsonl) the one-shot kernels ran at 1.07-2.32x NCCL's speed
#: from 8 KiB to 2 MiB, and over four to six launches the two-shot kernel at 1.28-2.18x at 1 MiB (the one-shot at
#: 1.21-1.81x) and 1.04-1.89x at 2 MiB on 4 GPUs, 0.95-1.34x at 4 MiB and 0.70-0.99x from 8 MiB; on 2 GPUs at
#: 1.28-2.13x from 1 to 4 MiB, 1.13-1.25x at 8, 0.95-1.12x at 16 and 0.91-1.01x at 32. A band ends at the
#: geometric midpoint between the last size won and the first lost or tied.
#: From 16 MiB, NCCL's own all-reduce on the wide communicator (:data:`NATIVE_WIDE`; below).
_PEER_ALL_REDUCE_2 = (
    (0, "one_shot"),
    (math.isqrt((512 << 10) * (1 << 20)) + 1, "direct"),
    (math.isqrt((8 << 20) * (16 << 20)) + 1, NATIVE_WIDE),
)
_PEER_ALL_REDUCE_4 = (
    (0, "one_shot"),
    (math.isqrt((512 << 10) * (1 << 20)) + 1, "direct"),
    (math.isqrt((2 << 20) * (4 << 20)) + 1, "native"),
    (math.isqrt((8 << 20) * (16 << 20)) + 1, NATIVE_WIDE),
)

#: The one-pass collectives of a CUDA group on the peer transport (:func:`dtrain.comm.peer.fused.one_pass`), each one
#: kernel that copies this rank's input into its window, passes one barrier on the signal pads and reads the
#: peers' windows (:func:`dtrain.comm.peer.kernels.exchange`): the all-gather, reduce-scatter and all-to-all
#: (``direct``) and the broadcast (``star``), where they ran faster than torch.distributed's own NCCL call, by full
#: buffer size (the all-gather's output, the others' input), up to the one pass's limit
#: (:data:`dtrain.comm.peer.fused.ONE_PASS_MAX_BYTES` a rank). Side by side on 2 and 4 H200s and H100s, same and
#: fresh tensors (benchmarks/results/one_pass{,_fresh}-h200x{4,2}.jsonl, one_pass_gather{,_fresh}-h100x4.jsonl,
#: one_pass_gather_fresh-h100x2.jsonl), from 8 KiB to 2 MiB every one at 1.4-2.3x NCCL's speed. The kernel alone
#: with its program count (64 on 4 GPUs, 128 on 2) beside NCCL's call, 1-32 MiB
#: (benchmarks/results/probe-exchange-programs-h100x{4,2}.txt): on 4 GPUs the all-gather at 1.22x at 16 MiB and
#: 1.08x at 32, the all-to-all at 1.15x and the reduce-scatter at 1.06x at 8 MiB (0.79-0.91x at 16), the
#: broadcast at 1.56x at 2 MiB and 0.92x at 4 (its readers share the root's links); on 2 GPUs every one at
#: 1.2-1.65x at 8 MiB, the all-gather at 1.46x at 16. A band ends at the geometric midpoint between the last size
#: won and the first lost, or at the one pass's limit. With these bands, `auto` beside torch.distributed's own call,
#: 1-32 MiB, same and fresh tensors (benchmarks/results/collectives_mid{,_fresh}-h100x{4,2}.jsonl): every one-pass
#: cell at 1.11-3.60x, every other cell NCCL's own call at 0.95-1.05x. On 4 GPUs the broadcast passes from the
#: star to the scatter-allgather (``scatter_allgather``: the root's links carry the buffer once) at 4 MiB, where it
#: ran at 0.92-1.57x and the star at 0.78-1.37x over five launches; at 8 MiB at 0.79-1.05x (two_shot*-h100x4.jsonl).
#: On 4 H200s in two leases the scatter-allgather took 37-41 us at 4 MiB and 46-47 at 6 MiB in both, while NCCL's
#: own broadcast took 31 us at 4 MiB in one lease and 52-61 in the other, 49-56 at 8 MiB in both
#: (broadcast_mid-lease1-h200x4.jsonl, broadcast_bands-*-lease2-h200x4.jsonl): 0.84x to 1.63x at 4 MiB by lease,
#: 1.08-1.17x at 6 MiB and 0.87-0.96x at 8; the bands stand.
#:
#: Past the one pass, NCCL's own call, and from where it measured faster, the same call on the group's wide
#: communicator (:data:`NATIVE_WIDE`, 64 CTAs): side by side with the default communicator on 4 and 2 H100s, rounds
#: interleaved, two launches on 4 (benchmarks/results/probe-nccl-ctas-h100x{4,4-run1,2}.txt), the all-reduce ran at
#: 1.02-1.06x from 16 MiB to 1 GiB on 4 (0.99x at 8 MiB) and 1.04-1.11x on 2 (1.01x at 8), the all-gather at
#: 1.08-1.10x and 1.07-1.26x, the reduce-scatter at 1.02-1.10x and 1.04-1.21x (0.92-0.96x at 8 MiB), the all-to-all
#: at 1.01-1.11x from 16 to 256 MiB on 4 and 0.98-0.99x at 1 GiB, on 2 at 1.08-1.15x from 64 MiB (0.99x at 32),
#: the broadcast at 0.99-1.00x (it stays ``native``). The ring broadcast as the direct chain of
#: :mod:`dtrain.comm.peer.direct` (one copy-engine copy between the callers' tensors) ran on 2 H200s at 1.01-1.04x
#: NCCL's broadcast from 64 MiB to 1 GiB in runs of calls back to back, but one call alone pays its host handshake
#: (65-125 us): 0.73-0.78x at 64 MiB, 0.86-0.94x at 256 MiB, 0.98-1.01x at 1 GiB on one host and 1.01-1.04x from
#: 256 MiB on another (probe-direct-broadcast{,-lone}-h200x2.txt, broadcast_ring_beside-h200x2.jsonl); and it keeps
#: its peers' allocations mapped, which CUDA leaves undefined should the peer free them. ``auto`` does not take it.
#: The ring reduce as the same chain (the root's kernel adding the peer's tensor read over NVLink) ran at
#: 0.95-1.00x NCCL's reduce from 64 MiB on 2 H200s (probe-direct-reduce-h200x2.txt): past the one pass, the
#: reduce is ``native``. The one-pass reduce (``star``: every rank's tensor into its window, one barrier, the
#: root's sum of the windows) ran on 2 H200s at 1.54-2.08x torch.distributed's NCCL call from 8 KiB to 4 MiB and
#: 1.19-1.25x at 8 MiB, same and fresh tensors (reduce_one_pass-h200x2.jsonl); on 4 H200s at 1.56-2.07x to 2 MiB,
#: 1.01x at 4 MiB and 0.55-0.60x at 8 MiB, where the root's port carries three windows (reduce_one_pass-h200x4.jsonl).
#: So do the gather and the scatter in one pass (``star``: every rank's input into its window and the root reading
#: them all; the root's input into its window and every rank reading its block), where torch.distributed's NCCL
#: calls are point-to-point messages: on 2 H200s the gather at 4.1-6.6x its speed from 8 KiB to 8 MiB and 2.7-3.0x
#: at 16 MiB (its output; 8 MiB a rank), the scatter at 3.5-5.0x to 8 MiB, same and fresh tensors
#: (gather_scatter_one_pass-h200x2.jsonl); past the one pass the star a round at a time ran the scatter at
#: 0.66-0.69x, so NCCL's runs there. On 4 H200s the gather ran at 2.3-6.7x to 32 MiB of output (8 MiB a rank), the
#: scatter at 4.0-5.3x to 8 MiB and 0.67-0.78x from 16 MiB (gather_scatter_one_pass-h200x4.jsonl).
#: Below 16 MiB the all-reduce keeps the default communicator: one H100 launch ran the 64-CTA one at 1.22x at 4 MiB
#: and 0.99x at 8, but two launches on 4 H200s ran it at 0.90-0.96x from 2 to 5 MiB and 0.96-1.03x from 6 to
#: 12 MiB (probe-nccl-ctas-ar-mid-h200x4-run{1,2}.txt).
_MIB = 1 << 20
_PEER_2 = {
    "all_gather": ((0, "direct"), (2 * 8 * _MIB + 1, NATIVE_WIDE)),
    "reduce_scatter": ((0, "direct"), (8 * _MIB + 1, NATIVE_WIDE)),
    "all_to_all": ((0, "direct"), (8 * _MIB + 1, NATIVE), (math.isqrt(32 * _MIB * 64 * _MIB) + 1, NATIVE_WIDE)),
    "broadcast": ((0, "star"), (8 * _MIB + 1, NATIVE)),
    "reduce": ((0, "star"), (8 * _MIB + 1, NATIVE)),
    "gather": ((0, "star"), (2 * 8 * _MIB + 1, NATIVE)),
    "scatter": ((0, "star"), (8 * _MIB + 1, NATIVE)),
}
_PEER_4 = {
    "all_gather": ((0, "direct"), (math.isqrt(16 * _MIB * 32 * _MIB) + 1, NATIVE_WIDE)),
    "reduce_scatter": ((0, "direct"), (math.isqrt(8 * _MIB * 16 * _MIB) + 1, NATIVE_WIDE)),
    "all_to_all": (
        (0, "direct"),
        (math.isqrt(8 * _MIB * 16 * _MIB) + 1, NATIVE_WIDE),
        (math.isqrt(256 * _MIB * 1024 * _MIB) + 1, NATIVE),
    ),
    "broadcast": (
        (0, "star"),
        (math.isqrt(2 * _MIB * 4 * _MIB) + 1, "scatter_allgather"),
        (math.isqrt(4 * _MIB * 8 * _MIB) + 1, NATIVE),
    ),
    "reduce": ((0, "star"), (math.isqrt(2 * _MIB * 4 * _MIB) + 1, NATIVE)),
    "gather": ((0, "star"), (4 * 8 * _MIB + 1, NATIVE)),
    "scatter": ((0, "star"), (8 * _MIB + 1, NATIVE)),
}

#: Built-in rules, used where no rules file covers a group: measured winners. Side by side with NCCL 2.28
#: (torch 2.11, NVLink multicast off, calls back to back in one process, rounds interleaved) on 2 and 4 H100s,
#: NCCL was faster than every schedule of ours run a round at a time, at every size from 8 KiB to 1 GiB for every
#: collective, but for the reduce-scatter from 64 MiB on 2, where the cost model's pick ran at 1.00-1.06x on the
#: same tensors every call and 0.90-0.94x on fresh ones; the one-kernel all-reduce and the one-pass
#: reduce-scatter and broadcast (above) beat it on small and medium sizes. A call these rules give to a one-kernel
#: or one-pass form that it cannot use (its dtype, reduction or layout) runs ``native``
#: (:mod:`dtrain.comm.api`). Everything else falls to ``native``, the default.
BUILT_IN: tuple[Rules, ...] = (
    Rules(
        kind="cuda-peer",
        world_size=2,
        table={"all_reduce": _PEER_ALL_REDUCE_2, **_PEER_2},
        meta={"from": "the five collectives against NCCL on 2 H100s and 2 H200s, 8 KiB-1 GiB"},
    ),
    Rules(
        kind="cuda-peer",
        world_size=4,
        table={"all_reduce": _PEER_ALL_REDUCE_4, **_PEER_4},
        meta={"from": "the five collectives against NCCL on 4 H100s and 4 H200s, 8 KiB-1 GiB"},
    ),
)


def built_in(kind: str, world_size: int, local_size: int | None) -> Rules | None:
    """The built-in rules for this kind of group, if any."""
    return next((r for r in BUILT_IN if r.covers(kind, world_size, local_size)), None)


def from_records(
    records: Iterable[Mapping],
    *,
    kind: str,
    local_size: int | None = None,
    meta: Mapping | None = None,
    margin: float = 0.0,
) -> Rules:
    """Rules from ``dtrain bench comm`` records: per collective and size, the fastest path, ``native`` or one of
    our own algorithms (not "auto" nor a "+graph" variant); sizes with one candidate only are skipped. Where
    ``native`` was measured, another path wins only if it was faster by more than ``margin`` (0.1: 10 %), so
    that a near tie, which the next run may reverse, stays with the backend's own collective."""
    if margin < 0:
        raise ValueError(f"rules: margin must be >= 0, got {margin}")
    times: dict[str, dict[int, dict[str, float]]] = {}
    worlds = set()
    for r in records:
        algorithm = str(r["algorithm"])
        if algorithm in ("auto", "torch") or "+" in algorithm or r.get("time_us") is None:
            continue  # "torch": torch.distributed's own call timed beside ours, the same path as "native"
        worlds.add(int(r["world_size"]))
        per_size = times.setdefault(str(r["collective"]), {}).setdefault(int(r["nbytes"]), {})
        per_size[algorithm] = min(float(r["time_us"]), per_size.get(algorithm, math.inf))
    if len(worlds) > 1:
        raise ValueError(f"rules: the records come from several group sizes {sorted(worlds)}; give one run's")
    if not worlds:
        raise ValueError("rules: no record of a collective's paths to learn from")
    table = {}
    for coll, sizes in times.items():
        winners = [(n, _winner(t, margin)) for n, t in sorted(sizes.items()) if len(t) > 1]
        if not winners:
            continue
        steps = [(0, winners[0][1])]
        for (lo, _), (hi, algorithm) in zip(winners, winners[1:], strict=False):
            if algorithm != steps[-1][1]:
                steps.append((math.isqrt(lo * hi) + 1, algorithm))
        table[coll] = tuple(steps)
    return Rules(kind=kind, world_size=worlds.pop(), local_size=local_size, table=table, meta=dict(meta or {}))


def _winner(times: Mapping[str, float], margin: float) -> str:
    best = min(times, key=times.get)
    native = times.get(NATIVE)
    if native is not None and best != NATIVE and times[best] * (1 + margin) >= native:
        return NATIVE
    return best


def rules_path(kind: str) -> Path:
    """``$DTRAIN_COMM_RULES`` if set, else ``~/.cache/dtrain/rules-{kind}.json``."""
    env = comm_env().rules
    if env is not None:
        return env
    return Path.home() / ".cache" / "dtrain" / f"rules-{kind}.json"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dtrain``, else ``~/.cache/dtrain``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtrain"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-_" else "_" for c in str(text))


def cache_path(kind: str, world_size: int, transport: str, torch_version: str, host: str | None = None) -> Path:
    """The per-machine rules cache: ``rules-{host}-{kind}-w{world_size}-{transport}-torch{version}.json`` in
    :func:`cache_dir`; ``transport`` is the ``DTRAIN_COMM_TRANSPORT`` setting the rules were measured under."""
    host = socket.gethostname() if host is None else host
    name = f"rules-{_safe(host)}-{_safe(kind)}-w{int(world_size)}-{_safe(transport)}-torch{_safe(torch_version)}.json"
    return cache_dir() / name


def lookup_paths(kind: str, world_size: int, transport: str, torch_version: str) -> list[tuple[Path, bool]]:
    """Where ``auto`` looks, in order, each with whether it is a cache (skipped with a warning when unusable)
    rather than a file the user named (an error when unusable)."""
    env = comm_env().rules
    if env is not None:
        return [(env, False)]
    return [(cache_path(kind, world_size, transport, torch_version), True), (rules_path(kind), False)]


def load_cached(
    path: str | Path, *, kind: str, world_size: int, torch_version: str, host: str | None = None
) -> tuple[Rules | None, str | None]:
    """The rules cached at ``path`` and None, or None and a one-line reason to skip it: a file that is not
    valid rules, or one measured for another kind, group size, host or torch (stale)."""
    path = Path(path)
    if not path.exists():
        return None, None
    try:
        made = load_rules(kind, path)
    except (OSError, ValueError) as err:
        return None, f"{str(err).splitlines()[0]}"
    host = socket.gethostname() if host is None else host
    want = {"kind": kind, "world_size": world_size, "hostname": host, "torch_version": torch_version}
    have = {"kind": made.kind, "world_size": made.world_size, **{k: made.meta.get(k) for k in want if k in made.meta}}
    stale = [f"{k} {have[k]!r} (this run: {v!r})" for k, v in want.items() if k in have and have[k] != v]
    if stale:
        return None, f"{path}: stale rules cache, measured for {', '.join(stale)}"
    return made, None


def load_rules(kind: str, path: str | Path | None = None) -> Rules | None:
    """The rules at ``path`` (default :func:`rules_path`), or None when there is no file. A file that is not
    valid rules raises ``ValueError`` naming it (a silently ignored file would hide a typo)."""
    path = Path(path) if path is not None else rules_path(kind)
    if not path.exists():
        return None
    try:
        return Rules.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not a dtrain rules file: {err}") from None


def save_rules(rules: Rules, path: str | Path | None = None) -> Path:
    """Write ``rules`` as JSON, atomically; the path written."""
    path = Path(path) if path is not None else rules_path(rules.kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rules.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path
