"""``dtrain bench calibrate``: measure the cost model's parameters and save them where ``algorithm="auto"``
looks (:func:`dtrain.comm.cost.model.params_path`, or ``out``)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from dtrain.comm.cost import model as cost
from dtrain.comm.cost.calibrate import calibrate
from dtrain.env import under_torchrun
from dtrain.launch import rank_device, run_ranks

__all__ = ["run", "calibrate_on_rank", "run_rules", "rules_on_rank", "run_from_arguments"]


def run(nproc: int, out: str | None = None, repeats: int = 10, sizes: tuple[int, ...] | None = None) -> dict:
    """Calibrate on ``nproc`` local ranks (or the torchrun job this process is in); the saved params."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be a whole number >= 1 (timed calls a size), got {repeats!r}")
    return run_ranks(calibrate_on_rank, nproc, out, repeats, sizes)


def calibrate_on_rank(out: str | None, repeats: int, sizes: tuple[int, ...] | None) -> dict:
    """Every rank measures; rank 0 writes the JSON file, prints the parameters and returns them as a dict."""
    device = rank_device()
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_size = int(env) if env.isdigit() else None
    params = calibrate(device=device, sizes=sizes, repeats=repeats, local_size=local_size)
    if dist.get_rank() != 0:
        return {}
    meta = {
        "hostname": platform.node(),
        "torch_version": torch.__version__,
        "device": device.type,
        "device_name": _device_name(device),
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "local_size": local_size,
        "sizes": list(sizes) if sizes else "default for the device",
        "repeats": repeats,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = cost.save_params(params, out, meta, device=device.type)
    _show(params, path)
    return params.to_dict()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _show(params: cost.CostParams, path: Path) -> None:
    table = Table(title=f"cost model parameters (saved to {path})")
    columns = ("link", "alpha (us)", "alpha_peer (us)", "bandwidth (GB/s)", "per pair (GB/s)", "reduce (GB/s)")
    for name in columns:
        table.add_column(name, justify="left" if name == "link" else "right")
    for name, link in (("intra", params.intra), ("inter", params.inter)):
        if link is not None:
            table.add_row(
                name,
                f"{link.alpha_s * 1e6:.2f}",
                _per_peer(link),
                _rate(link.beta_s_per_byte),
                _per_pair(link),
                _rate(link.gamma_s_per_byte),
            )
    Console().print(table)


def _per_peer(link: cost.LinkCost) -> str:
    """alpha_peer in us, or "= alpha" where it was not measured (the single-port model)."""
    return "= alpha" if link.alpha_peer_s is None else f"{link.alpha_peer_s * 1e6:.2f}"


def _per_pair(link: cost.LinkCost) -> str:
    """One pair's bandwidth in GB/s, or "= total" where it is not limited beyond the rank's total."""
    return "= total" if link.beta_peer_s_per_byte is None else _rate(link.beta_peer_s_per_byte)


def _rate(seconds_per_byte: float) -> str:
    return "inf" if seconds_per_byte == 0 else f"{1 / seconds_per_byte / 1e9:.2f}"


def run_rules(
    nproc: int,
    *,
    collectives: tuple[str, ...] | None = None,
    min_bytes: int = 1 << 10,
    max_bytes: int = 64 << 20,
    factor: int = 4,
    rounds: int = 3,
    fresh: bool = False,
    out: str | None = None,
    records_out: str | None = None,
    transport: str = "torch",
) -> dict | None:
    """``dtrain bench calibrate --rules``: time the candidates of ``auto`` (:func:`dtrain.comm.tune.candidates`:
    ``native``, ours on the group's transport and, where calls may change transport, on the other one) per
    collective over the sizes ``min_bytes`` .. ``max_bytes`` (``factor`` apart) and save the winners as rules
    where ``auto`` loads them by default (:func:`dtrain.comm.cost.rules.cache_path`), or to ``out``; on
    ``nproc`` local ranks, the torchrun job this process is in, or (``transport="mpi"``) the mpirun job. The
    rules as a dict (rank 0's)."""
    from dtrain.comm.tune import CALIBRATED

    collectives = tuple(CALIBRATED if collectives is None else collectives)
    if transport not in ("torch", "mpi"):
        raise ValueError(f"--transport {transport!r} is not known; use torch or mpi")
    if factor < 2:
        raise ValueError(f"--factor must be >= 2, got {factor}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if min_bytes < 1:
        raise ValueError(f"--min-bytes must be a whole number of bytes >= 1, got {min_bytes}")
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes {min_bytes} is above --max-bytes {max_bytes}")
    from dtrain.bench.comm import BUS_FACTORS, check_fits, local_ranks, names_given

    names_given("--collectives", collectives)
    unknown = [c for c in collectives if c not in BUS_FACTORS]
    if unknown:
        raise ValueError(f"--collectives: unknown {unknown}; known: {', '.join(BUS_FACTORS)}")
    if transport != "mpi" and nproc < 1 and not under_torchrun():
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    cpu = transport == "mpi" or not torch.cuda.is_available()
    check_fits("--max-bytes", max_bytes, 1 if transport == "mpi" else local_ranks(nproc), cpu)
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    args = (collectives, tuple(sizes), rounds, fresh, out, records_out, transport)
    if transport == "mpi":
        return rules_on_rank(*args)
    return run_ranks(rules_on_rank, nproc, *args)


def rules_on_rank(
    collectives: tuple[str, ...],
    sizes: tuple[int, ...],
    rounds: int,
    fresh: bool,
    out: str | None,
    records_out: str | None,
    transport: str,
) -> dict | None:
    """Every rank measures; rank 0 saves the rules (and the records, where ``records_out`` names a file)."""
    import json

    from dtrain.comm.api import _kind
    from dtrain.comm.cost import rules
    from dtrain.comm.tune import cache_path_for, calibrate_rules

    group = None
    if transport == "mpi":
        from dtrain.comm.mpi import world

        group = world()
    device = torch.device("cpu") if group is not None else rank_device()
    key = group if group is not None else dist.group.WORLD
    kind = _kind(key, device)
    made, records = calibrate_rules(
        key, device, collectives=collectives, sizes=sizes, rounds=rounds, fresh=fresh, progress=print
    )
    if made is None:
        return None
    path = rules.save_rules(made, out or cache_path_for(key, device, kind))
    if records_out:
        target = Path(records_out)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps({**r, "hostname": platform.node()}) + "\n" for r in records))
        os.replace(tmp, target)
    for coll, steps in made.table.items():
        print(f"{coll:15s} " + ", ".join(f"from {n} B: {a}" for n, a in steps))
    print(f"rules for algorithm='auto' ({kind}, {made.world_size} ranks) written to {path}")
    return made.to_dict()


def run_from_arguments(args) -> int:
    """``dtrain bench calibrate``: the rules calibration with ``--rules``, else the cost model's parameters."""
    if not getattr(args, "rules", False):
        run(args.nproc, args.out, args.repeats)
        return 0
    names = args.collectives.split(",") if isinstance(args.collectives, str) else args.collectives
    collectives = None if names is None else tuple(c.strip() for c in names if c.strip())
    run_rules(
        args.nproc,
        collectives=collectives,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        rounds=args.rounds,
        fresh=args.fresh,
        out=args.out,
        records_out=args.records_out,
        transport=args.transport,
    )
    return 0
