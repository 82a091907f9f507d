"""Bits and bytes, kept apart.

Network links are rated in bits per second (Gb/s: IEEE 802.3, InfiniBand), memory and GPU interconnects in bytes
per second (GB/s: NVIDIA's NVLink and HBM figures, PCIe payload rates), and a factor of 8 is easily lost between
them. Inside dtrain every rate is
``bytes_per_s`` (a float, decimal units); these functions are the only places where Gb/s or GB/s turn into it.
Decimal prefixes throughout (1 Gb/s = 1e9 bit/s, 1 GB/s = 1e9 B/s), as vendors quote them.
"""

from __future__ import annotations

import math

__all__ = [
    "BITS_PER_BYTE",
    "gbit_per_s_to_bytes_per_s",
    "bytes_per_s_to_gbit_per_s",
    "gbyte_per_s_to_bytes_per_s",
    "bytes_per_s_to_gbyte_per_s",
    "format_bytes",
    "format_rate",
    "format_seconds",
]

BITS_PER_BYTE = 8


def _check(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """A network rate in Gb/s (bits) as bytes per second: 100 Gb/s is 12.5e9 B/s."""
    return _check(gbit_per_s, "gbit_per_s") * 1e9 / BITS_PER_BYTE


def bytes_per_s_to_gbit_per_s(bytes_per_s: float) -> float:
    """Bytes per second as Gb/s (bits): 25e9 B/s is 200 Gb/s."""
    return _check(bytes_per_s, "bytes_per_s") * BITS_PER_BYTE / 1e9


def gbyte_per_s_to_bytes_per_s(gbyte_per_s: float) -> float:
    """A memory or interconnect rate in GB/s (bytes) as bytes per second: 25 GB/s is 25e9 B/s."""
    return _check(gbyte_per_s, "gbyte_per_s") * 1e9


def bytes_per_s_to_gbyte_per_s(bytes_per_s: float) -> float:
    """Bytes per second as GB/s (bytes)."""
    return _check(bytes_per_s, "bytes_per_s") / 1e9


_BYTE_PREFIXES = ((1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def format_bytes(nbytes: float) -> str:
    """``7e11`` -> ``"700 GB"`` (decimal, as datasheets write sizes)."""
    for scale, unit in _BYTE_PREFIXES:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.4g} B"


def format_rate(bytes_per_s: float) -> str:
    """Both ways of writing a rate: ``"25 GB/s = 200 Gb/s"``."""
    return f"{bytes_per_s / 1e9:.4g} GB/s = {bytes_per_s * BITS_PER_BYTE / 1e9:.4g} Gb/s"


def format_seconds(seconds: float) -> str:
    """``40.0`` -> ``"40 s"``, ``2.5e-5`` -> ``"25 us"``."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"
