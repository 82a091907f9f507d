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

Every rank of a group must read the same rules (as the same calibration), or ranks would choose different
algorithms and wait for each other forever; :mod:`dtrain.comm.api` checks that once per group.

Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.env import comm_env

__all__ = ["MODEL", "NATIVE", "BUILT_IN", "Rules", "built_in", "from_records", "rules_path", "load_rules", "save_rules"]


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
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ValueError) and str(err).startswith("rules:"):
                raise
            raise ValueError(f"rules: malformed rules data ({type(err).__name__}: {err})") from None


#: The name a rule gives to mean "ask the cost model" (built-in rules cover only what was measured).
MODEL = "model"

#: The backend's own collective (NCCL's, Gloo's): what ``auto`` runs where no rule covers a call.
NATIVE = "native"

#: Built-in rules, used where no rules file covers a group: measured winners. Side by side with NCCL 2.28
#: (torch 2.11, NVLink multicast off, calls back to back in one process, rounds interleaved), NCCL was faster
#: at every size from 8 KiB to 1 GiB for every collective on 4 H100s, and on 2 H100s everywhere but the
#: reduce-scatter from 64 MiB, where the cost model's pick on the peer transport ran 1.03-1.13x NCCL's speed.
#: Everything else falls to ``native``, the default.
BUILT_IN: tuple[Rules, ...] = (
    Rules(
        kind="cuda-peer",
        world_size=2,
        table={"reduce_scatter": ((0, NATIVE), ((32 << 20) + 1, MODEL))},
        meta={"from": "reduce-scatter against NCCL on 2 H100s, 8 KiB-1 GiB"},
    ),
)


def built_in(kind: str, world_size: int, local_size: int | None) -> Rules | None:
    """The built-in rules for this kind of group, if any."""
    return next((r for r in BUILT_IN if r.covers(kind, world_size, local_size)), None)


def from_records(
    records: Iterable[Mapping], *, kind: str, local_size: int | None = None, meta: Mapping | None = None
) -> Rules:
    """Rules from ``dtrain bench comm`` records: per collective and size, the fastest path, ``native`` or one of
    our own algorithms (not "auto" nor a "+graph" variant); sizes with one candidate only are skipped."""
    times: dict[str, dict[int, dict[str, float]]] = {}
    worlds = set()
    for r in records:
        algorithm = str(r["algorithm"])
        if algorithm == "auto" or "+" in algorithm or r.get("time_us") is None:
            continue
        worlds.add(int(r["world_size"]))
        per_size = times.setdefault(str(r["collective"]), {}).setdefault(int(r["nbytes"]), {})
        per_size[algorithm] = min(float(r["time_us"]), per_size.get(algorithm, math.inf))
    if len(worlds) > 1:
        raise ValueError(f"rules: the records come from several group sizes {sorted(worlds)}; give one run's")
    if not worlds:
        raise ValueError("rules: no record of a collective's paths to learn from")
    table = {}
    for coll, sizes in times.items():
        winners = [(n, min(t, key=t.get)) for n, t in sorted(sizes.items()) if len(t) > 1]
        if not winners:
            continue
        steps = [(0, winners[0][1])]
        for (lo, _), (hi, algorithm) in zip(winners, winners[1:], strict=False):
            if algorithm != steps[-1][1]:
                steps.append((math.isqrt(lo * hi) + 1, algorithm))
        table[coll] = tuple(steps)
    return Rules(kind=kind, world_size=worlds.pop(), local_size=local_size, table=table, meta=dict(meta or {}))


def rules_path(kind: str) -> Path:
    """``$DTRAIN_COMM_RULES`` if set, else ``~/.cache/dtrain/rules-{kind}.json``."""
    env = comm_env().rules
    if env is not None:
        return env
    return Path.home() / ".cache" / "dtrain" / f"rules-{kind}.json"


def load_rules(kind: str, path: str | Path | None = None) -> Rules | None:
    """The rules at ``path`` (default :func:`rules_path`), or None when there is no file. A file that is not
    valid rules raises ``ValueError`` naming it (a silently ignored file would hide a typo)."""
    path = Path(path) if path is not None else rules_path(kind)
    if not path.exists():
        return None
    try:
        return Rules.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}: not a dtrain rules file: {err}") from None


def save_rules(rules: Rules, path: str | Path | None = None) -> Path:
    """Write ``rules`` as JSON, atomically; the path written."""
    path = Path(path) if path is not None else rules_path(rules.kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rules.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path
