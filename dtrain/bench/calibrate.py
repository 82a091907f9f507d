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
from dtrain.launch import rank_device, run_ranks

__all__ = ["run", "calibrate_on_rank"]


def run(nproc: int, out: str | None = None, repeats: int = 10, sizes: tuple[int, ...] | None = None) -> dict:
    """Calibrate on ``nproc`` local ranks (or the torchrun job this process is in); the saved params."""
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
