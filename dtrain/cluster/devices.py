"""Accelerator specifications: peak dense FLOP/s by precision, memory and its bandwidth, their interconnects.

Figures are NVIDIA's datasheets (dense, no structured sparsity; SXM boards unless named PCIe); memory sizes
are the datasheets' decimal gigabytes. The A100: 312 TFLOPS dense bf16, 80 GB, HBM at 1935 GB/s on the 80 GB
PCIe board and 2039 GB/s on the SXM board (NVIDIA A100 datasheet).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.catalogue import LINKS
from dtrain.cluster.topology import Device

__all__ = ["DeviceSpec", "DEVICES", "device_spec", "make_device", "PRECISIONS", "REQUIRED_PRECISIONS"]

PRECISIONS = ("bf16", "fp16", "tf32", "fp32", "fp8")
#: The precisions every device runs; ``fp8`` (8-bit floating point, Hopper and later) only some.
REQUIRED_PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator model. ``peak_flops`` maps a precision in :data:`PRECISIONS` to dense FLOP/s (every one of
    :data:`REQUIRED_PRECISIONS`; ``fp8`` where the device has it)."""

    key: str
    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    hbm: str  # catalogue key of its memory
    nvlink: str | None  # catalogue key of its NVLink generation
    pcie: str  # catalogue key of its host interface
    source: str

    def __post_init__(self) -> None:
        missing = [p for p in REQUIRED_PRECISIONS if p not in self.peak_flops]
        if missing:
            raise ValueError(f"device {self.key!r}: peak_flops lacks {missing}")
        unknown = [p for p in self.peak_flops if p not in PRECISIONS]
        if unknown:
            raise ValueError(f"device {self.key!r}: peak_flops names unknown precisions {unknown}")
        for key in (self.hbm, self.nvlink, self.pcie):
            if key is not None and key not in LINKS:
                raise ValueError(f"device {self.key!r}: {key!r} is not a catalogue link")

    @property
    def memory_bytes_per_s(self) -> float:
        """HBM bandwidth."""
        return LINKS[self.hbm].bytes_per_s

    def has(self, precision: str) -> bool:
        """Whether the device runs products at ``precision``."""
        return precision in self.peak_flops

    def flops(self, precision: str) -> float:
        """Peak dense FLOP/s at ``precision``."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        if precision not in self.peak_flops:
            raise ValueError(f"{self.name} has no {precision} products; it runs {', '.join(self.peak_flops)}")
        return self.peak_flops[precision]


def _flops(bf16_tflops: float, tf32_tflops: float, fp32_tflops: float, fp8_tflops: float = 0.0) -> dict[str, float]:
    out = {"bf16": bf16_tflops * 1e12, "fp16": bf16_tflops * 1e12, "tf32": tf32_tflops * 1e12,
           "fp32": fp32_tflops * 1e12}  # fmt: skip
    if fp8_tflops:
        out["fp8"] = fp8_tflops * 1e12
    return out


DEVICES: dict[str, DeviceSpec] = {
    "a100-sxm": DeviceSpec(
        key="a100-sxm", name="NVIDIA A100 80GB SXM", peak_flops=_flops(312, 156, 19.5), memory_bytes=80 * 10**9,
        hbm="hbm2e-a100-sxm", nvlink="nvlink3", pcie="pcie4x16",
        source="NVIDIA A100 datasheet (312 TFLOPS bf16, 80 GB)"),
    "a100-pcie": DeviceSpec(
        key="a100-pcie", name="NVIDIA A100 80GB PCIe", peak_flops=_flops(312, 156, 19.5), memory_bytes=80 * 10**9,
        hbm="hbm2e-a100", nvlink="nvlink3", pcie="pcie4x16",
        source="NVIDIA A100 datasheet (HBM 1935 GB/s, PCIe 4.0)"),
    "h100-sxm": DeviceSpec(
        key="h100-sxm", name="NVIDIA H100 SXM5 80GB", peak_flops=_flops(989.4, 494.7, 66.9, 1978.9),
        memory_bytes=80 * 10**9, hbm="hbm3-h100", nvlink="nvlink4", pcie="pcie5x16",
        source="NVIDIA H100 datasheet (NVLink 4; 1978.9 TFLOPS dense FP8)"),
    "h200-sxm": DeviceSpec(
        key="h200-sxm", name="NVIDIA H200 SXM 141GB", peak_flops=_flops(989.4, 494.7, 66.9, 1978.9),
        memory_bytes=141 * 10**9, hbm="hbm3e-h200", nvlink="nvlink4", pcie="pcie5x16",
        source="NVIDIA H200 datasheet (same compute as H100 SXM, 141 GB at 4.8 TB/s)"),
}  # fmt: skip


def device_spec(key: str) -> DeviceSpec:
    """The accelerator called ``key`` (``"a100-sxm"``, ``"a100-pcie"``, ``"h100-sxm"``, ``"h200-sxm"``)."""
    try:
        return DEVICES[key]
    except KeyError:
        raise ValueError(f"unknown device {key!r}; known: {', '.join(DEVICES)}") from None


def make_device(key: str, *, name: str, server: str, rack: str | None = None, precision: str = "bf16") -> Device:
    """A topology :class:`Device` of model ``key``, its ``peak_flops`` at the training ``precision`` (one of
    :data:`REQUIRED_PRECISIONS`: a device's ``peak_flops`` prices every operation, and FP8 runs only the linear
    layers' products, which the simulator's layout says, ``Layout.fp8``)."""
    if precision == "fp8":
        raise ValueError("precision 'fp8': a device trains at a 16- or 32-bit precision; FP8 linear layers are a "
                         "layout's choice (dtrain simulate train --fp8)")  # fmt: skip
    spec = device_spec(key)
    return Device(
        name=name,
        server=server,
        rack=rack,
        peak_flops=spec.flops(precision),
        memory_bytes=spec.memory_bytes,
        memory_bytes_per_s=spec.memory_bytes_per_s,
    )
