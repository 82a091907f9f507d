"""benchmarks/sim/beside_measured.py: its results files hold one row a measurement, and each row's prediction is
what the simulator gives when called directly on that row."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from dtrain.cluster.presets import preset
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.nccl import NcclParams, simulate_nccl
from dtrain.sim.peer_model import exchange_time
from dtrain.sim.pipeline import pipeline_makespan
from dtrain.sim.placement import place
from dtrain.sim.step import simulate_step
from dtrain.sim.transports import Transport

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def beside():
    return _module(ROOT / "benchmarks" / "sim" / "beside_measured.py", "beside_measured")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def _measured(names) -> int:
    return sum(len(_rows(n)) for n in names)


def test_collectives_file_matches_a_direct_call(beside):
    records = _rows("sim_beside_collectives-h100x4.jsonl")
    figures = next(r for r in records if r["record"] == "figures")
    rows = [r for r in records if r["record"] == "row"]
    assert len(rows) == _measured(beside.COLLECTIVE_FILES)
    assert figures["host_s"] == pytest.approx(beside.nccl_host_s())
    params = NcclParams(**figures["nccl"])
    row = next(r for r in rows if r["model"] == "nccl" and r["world_size"] == 2 and r["nbytes"] == 128 << 20)
    device = simulate_nccl(Transport(name="nvlink").topology(2), row["collective"], row["nbytes"],
                           params=dataclasses.replace(params, host_s=0.0), protocol=row["protocol"],
                           root=0).time_s  # fmt: skip
    assert row["device_us"] == pytest.approx(device * 1e6)
    host = figures["host_s"][row["collective"]]
    assert row["predicted_us"] == pytest.approx(max(host, device) * 1e6)
    assert row["error"] == pytest.approx(row["predicted_us"] / row["measured_us"] - 1)
    peer = next(r for r in rows if r["model"] == "peer")
    assert figures["fused_host_s"] == pytest.approx(beside.fused_host_s())

    def same(r: dict) -> bool:
        return (r["collective"], r["algorithm"], r["nbytes"]) == (peer["collective"], peer["algorithm"], peer["nbytes"])

    again = beside.collective_rows(params, figures["host_s"], beside.peer_figures(), figures["fused_host_s"],
                                   files=[peer["source"]], where=same)  # fmt: skip
    assert len(again) == 1 and again[0]["predicted_us"] == pytest.approx(peer["predicted_us"])
    assert peer["resolved"] in beside.FUSED  # the one-kernel all-reduce: its host time, else its kernel
    assert peer["predicted_us"] == pytest.approx(max(peer["device_us"], figures["fused_host_s"] * 1e6))
    assert {r["pricing"] for r in rows} == {"simulate_nccl", "exchange_time", "peer_time"}


def test_a_one_kernel_row_is_one_call_of_the_exchange_kernel(beside):
    """A 4-GPU all-gather of 8 MiB (2 MiB a rank in): the exchange kernel's device time, the host's time of a
    one-pass all-gather from the probe, the larger of the two; the same bytes through the pull plan differ."""
    records = _rows("sim_beside_collectives-h100x4.jsonl")
    figures = next(r for r in records if r["record"] == "figures")
    assert figures["exchange_host_s"] == pytest.approx(beside.exchange_host_s())
    row = next(r for r in records if r["record"] == "row" and r["collective"] == "all_gather"
               and r["resolved"] == "direct" and r["world_size"] == 4 and r["nbytes"] == 8 << 20)  # fmt: skip
    assert row["pricing"] == "exchange_time" and row["form"] == "gather"
    cost = beside.peer_figures()
    host = figures["exchange_host_s"]["all_gather"]
    t = exchange_time("gather", 4, 2 << 20, cost, host_s=host)
    assert row["device_us"] == pytest.approx(t.gpu_s * 1e6)
    assert row["predicted_us"] == pytest.approx(t.time_s * 1e6) and row["host_us"] == pytest.approx(host * 1e6)
    assert row["device_us"] > host * 1e6  # 6 MiB read from 3 peers: the kernel, not the host, sets this one
    import captured_base

    planned = captured_base._peer_row({**_rows(row["source"])[0], "collective": "all_gather", "nbytes": 8 << 20,
                                       "resolved_algorithm": "direct", "world_size": 4, "run": row["source"]},
                                      cost, graph=False)  # fmt: skip
    assert planned["gpu_us"] != pytest.approx(row["device_us"], rel=0.05)
    # the one-shot all-reduce up to 256 KiB is the kernel's; above it torch's kernel, priced as its pull plan
    small = [r for r in records if r["record"] == "row" and r["collective"] == "all_reduce" and r["resolved"] ==
             "one_shot"]  # fmt: skip
    assert {r["pricing"] for r in small if r["nbytes"] <= 256 << 10} == {"exchange_time"}
    assert {r["pricing"] for r in small if r["nbytes"] > 256 << 10} == {"peer_time"}
    assert all(r["pricing"] == "simulate_nccl" for r in records if r.get("algorithm") == "torch")


def test_pipeline_file_matches_a_direct_call(beside):
    rows = _rows("sim_beside_pipeline-h100x4.jsonl")
    eager = sum(1 for n in beside.PIPELINE_FILES for r in _rows(n) if not r.get("graphs"))
    assert len(rows) == eager and eager < _measured(beside.PIPELINE_FILES)  # the graphed rows are not predicted
    assert {r["transport"] for r in rows} == {"group", "peer"}
    row = next(r for r in rows if r["schedule"] == "gpipe" and r["batch"] == 4096)
    device = beside.fp32_device()
    t, w, p, layers = row["batch"] // row["microbatches"], 4096, 4, 4
    f = layers * (device.matmul_s(t, w, w, itemsize=4) + device.memory_s(8 * t * w))
    b = layers * (device.matmul_s(t, w, w, itemsize=4) + device.memory_s(12 * t * w))
    b += layers * (device.matmul_s(w, w, t, itemsize=4) + device.memory_s(4 * t * w) + device.memory_s(8 * w * w))
    loss = device.memory_s(8 * t * w) + device.memory_s(12 * t * w)
    span = pipeline_makespan([f] * (p - 1) + [f + loss / 2], [b] * (p - 1) + [b + loss / 2],
                             row["message_us"] * 1e-6, row["microbatches"], "gpipe")  # fmt: skip
    assert row["device_ms"] == pytest.approx(span * 1e3)
    hosted = pipeline_makespan([f] * (p - 1) + [f + loss / 2], [b] * (p - 1) + [b + loss / 2],
                               row["message_us"] * 1e-6, row["microbatches"], "gpipe",
                               host_s=row["host_us_per_action"] * 1e-6)  # fmt: skip
    assert row["predicted_ms"] == pytest.approx(hosted * 1e3)
    assert 0 < row["device_bubble"] < 1
    assert row["message_us"] * 1e-6 == pytest.approx(beside.message_s(t * w * 4))
    measured = next(
        r for r in _rows(row["source"]) if r["schedule"] == "gpipe" and r["microbatches"] == row["microbatches"]
    )
    assert row["measured_ms"] == measured["step_ms"]


def test_dp_file_matches_a_direct_call(beside):
    rows = _rows("sim_beside_dp-h100x4.jsonl")
    assert len(rows) == _measured(beside.DP_FILES)
    row = next(r for r in rows if r["ranks"] == 4 and r["batch_per_rank"] == 16)
    measured = next(r for r in _rows(row["source"]) if r["variant"] == row["variant"])
    model = ModelSpec(name="gpt", parameters=float(measured["parameters"]), layers=12, hidden=768, heads=12,
                      sequence=512, vocab=32768, ffn_hidden=3072, bytes_per_value=4)  # fmt: skip
    layout = Layout(dp=4, micro_batch=16, global_batch=64, attention="flash")
    topo = preset("h100-node")
    assert row["predicted_s"] == pytest.approx(simulate_step(model, layout, topo, place(topo, layout)).step_s)
    assert row["measured_s"] == measured["step_s"]
    assert all(math.isfinite(r["error"]) for r in rows)


def test_report_section_shows_the_three_tables():
    report = _module(ROOT / "benchmarks" / "report.py", "dtrain_report")
    text = report.section_sim_beside_measured()
    for heading in ("Collectives with the defaults", "Pipeline schedules", "Data parallel against DDP"):
        assert heading in text
