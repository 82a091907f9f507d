"""Quantities on the command line: byte sizes in binary units, and sizes or counts with decimal prefixes.

- :func:`parse_bytes`: ``"64K"``, ``"1MiB"``, ``"1G"`` -> bytes, K being 1024 (message and buffer sizes);
- :func:`parse_quantity`: ``"700GB"``, ``"1TB"``, ``"64KiB"`` -> bytes, decimal prefixes as datasheets write
  sizes and rates (G is 10^9), ``Ki``/``Mi``/... binary;
- :func:`parse_count`: ``"175e9"``, ``"175G"``, ``"1.3T"`` -> a count, such as a model's parameters.

Each refuses, in argparse's one line naming the flag, what no machine holds: byte sizes above :data:`MAX_BYTES`
(1 EiB), quantities and counts above :data:`MAX_QUANTITY` (10^24), and anything that overflows to infinity.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

__all__ = ["MAX_BYTES", "MAX_QUANTITY", "check_finite", "parse_bytes", "parse_quantity", "parse_count", "whole"]

#: The largest size :func:`parse_bytes` takes: 1 EiB.
MAX_BYTES = 1 << 60
#: The largest value :func:`parse_quantity` and :func:`parse_count` take: 10^24 (a yottabyte; a count far past any
#: model's).
MAX_QUANTITY = 1e24

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20}
_UNITS |= {"MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_NUMBER = r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*"


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"1MiB"``, ``"1G"`` -> bytes (binary units: K is 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 4096, 64K, 1MiB, 1G)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is above the largest size taken, 1 EiB (2**60 bytes)")
    return value


def _bounded(value: float, text: str) -> float:
    if value > MAX_QUANTITY:  # infinity too (1e400)
        raise argparse.ArgumentTypeError(f"{text!r} is above the largest value taken, 1e24")
    return value


def _scaled(match: re.Match) -> float:
    prefix = (match.group(2) or "").upper()
    try:
        value = float(match.group(1))
    except ValueError:
        return float("nan")
    return value * (_BINARY[prefix] if prefix in _BINARY else _DECIMAL[prefix])


def parse_quantity(text: str) -> float:
    """A size in bytes: ``"700GB"``, ``"1TB"``, ``"1e12"``, ``"64KiB"`` -> a number (decimal prefixes as
    datasheets write sizes; ``Ki``/``Mi``/... binary). A trailing ``B`` (bytes) is optional."""
    match = re.fullmatch(_NUMBER + r"([kKmMgGtTpP][iI]?)?[bB]?\s*", text)
    value = _scaled(match) if match else float("nan")
    if value != value:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 700GB, 1TB, 1e12, 64KiB)")
    return _bounded(value, text)


def parse_count(text: str) -> float:
    """A count such as a number of parameters: ``"175e9"``, ``"175G"``, ``"1.3T"``. A trailing ``B`` is refused:
    it could mean bytes or billions."""
    if text.strip().upper().endswith("B"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is ambiguous (bytes or billions?): give a count, such as 175e9 or 175G"
        )
    match = re.fullmatch(_NUMBER + r"([kKmMgGtTpP][iI]?)?\s*", text)
    value = _scaled(match) if match else float("nan")
    if value != value:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (try 175e9, 175G, 1.3T)")
    return _bounded(value, text)


def whole(least: int, most: int | None = None, what: str = "a whole number"):
    """An argparse type: a whole number ``>= least`` (and ``<= most`` where given); argparse names the flag in its
    one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            bounds = f">= {least}" if most is None else f"from {least} to {most}"
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, got {text!r}")
        return value

    return parse


def check_finite(data: Any, where: str = "") -> None:
    """ValueError naming the first value of ``data`` (dicts and lists within) that is infinite or NaN, which JSON
    cannot hold: inputs out of range."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ValueError(f"{where or 'the result'} comes out as {data}: the inputs are out of range")
    if isinstance(data, dict):
        for key, value in data.items():
            check_finite(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            check_finite(value, f"{where}[{i}]")
