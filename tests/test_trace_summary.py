"""The device-time summary of a profiler trace: unions, exposed communication and idle time on known events."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "training"))

from trace_summary import is_comm, summarize  # noqa: E402


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_of_overlapping_compute_and_communication():
    events = [
        _kernel("sm90_gemm", 0, 400),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 300),  # 100 us under the gemm, 200 exposed
        _kernel("elementwise", 700, 100),  # idle 600..700
        _kernel("Memcpy DtoD", 800, 200, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -50, "dur": 2000},  # host events are not counted
    ]
    s = summarize(events, steps=2)
    assert s["span_ms"] == pytest.approx(1000e-3 / 2)
    assert s["busy_ms"] == pytest.approx(900e-3 / 2)
    assert s["compute_ms"] == pytest.approx(700e-3 / 2)
    assert s["comm_ms"] == pytest.approx(300e-3 / 2)
    assert s["comm_exposed_ms"] == pytest.approx(200e-3 / 2)
    assert s["idle_ms"] == pytest.approx(100e-3 / 2)
    assert s["top"][0] == ("sm90_gemm", pytest.approx(0.2))


def test_communication_kernels_are_recognised():
    assert is_comm("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL")
    assert is_comm("exchange_kernel")
    assert not is_comm("ampere_bf16_s16816gemm")


def test_a_trace_without_device_events_is_refused():
    with pytest.raises(ValueError, match="no kernel"):
        summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}])
