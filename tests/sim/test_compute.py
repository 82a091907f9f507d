"""Compute from operations (dtrain.sim.compute): each operation's FLOPs or bytes at a device's measured rates,
summed per stage; the profile file ``dtrain bench compute`` writes; the step simulated with it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtrain.cli.main import main
from dtrain.cluster.files import resolve
from dtrain.sim.compute import ComputeProfile, load_profile, stage_compute
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, simulate_step

MODEL = ModelSpec(
    parameters=1.2e9, layers=8, hidden=1024, heads=16, sequence=512, vocab=32000, ffn_hidden=4096, kv_heads=4,
    gated_mlp=True,
)  # fmt: skip
RATE, ATTENTION, COPY = 4e14, 2e14, 2e12


def _flat(rate=RATE, forward=ATTENTION, backward=ATTENTION) -> ComputeProfile:
    """Every matrix product at ``rate``, attention at ``forward`` / ``backward`` FLOP/s."""
    shapes = [(m, n, k, rate) for m in (256, 65536) for n in (256, 65536) for k in (256, 65536)]
    return ComputeProfile(
        device="flat", matmul=tuple(shapes), attention=((512, 64, forward, backward), (4096, 128, forward, backward)),
        copy_bytes_per_s=COPY, adam_params_per_s=1e9,
    )  # fmt: skip


def _layer_matmul_flops(model: ModelSpec, tokens: int, tp: int) -> float:
    hd = model.hidden // model.heads
    qkv = model.hidden * (model.heads + 2 * model.kv_heads) * hd / tp
    out = model.hidden * model.heads * hd / tp
    mlp = 3 * model.hidden * model.ffn / tp
    return 2 * tokens * (qkv + out + mlp)


@pytest.mark.parametrize("tp", [1, 2])
def test_matrix_products_and_attention_cost_their_flops_at_the_measured_rates(tp):
    layout = Layout(dp=1, tp=tp, pp=2, micro_batch=2, global_batch=4)
    tokens, layers = 2 * MODEL.sequence, MODEL.layers // 2
    first, last = (stage_compute(MODEL, layout, _flat(), s) for s in (0, 1))
    per_layer = _layer_matmul_flops(MODEL, tokens, tp)
    logits = 2 * tokens * MODEL.hidden * MODEL.vocab / tp
    # forward once, backward twice (the input's and the weight's gradients); the logits on the last stage only
    assert first.matmul_s == pytest.approx(3 * layers * per_layer / RATE, rel=1e-9)
    assert last.matmul_s == pytest.approx((3 * layers * per_layer + 3 * logits) / RATE, rel=1e-9)
    causal = 2 * tokens * MODEL.sequence * MODEL.hidden / tp  # half of the 4 b s^2 h of full attention
    assert first.attention_s == pytest.approx(layers * 3.5 * causal / ATTENTION, rel=1e-9)
    assert first.forward_s + first.backward_s == pytest.approx(first.matmul_s + first.attention_s + first.memory_s)


def test_recomputation_adds_the_forward_it_repeats_to_backward():
    base = Layout(dp=1, micro_batch=1, global_batch=1)
    plain, selective, full = (
        stage_compute(MODEL, dataclasses.replace(base, recompute=r), _flat(), 0) for r in ("none", "selective", "full")
    )
    layers = MODEL.layers
    attention_forward = plain.attention_s / 3.5 / layers
    assert selective.backward_s - plain.backward_s == pytest.approx(layers * attention_forward, rel=1e-9)
    layer_forward = (plain.forward_s - MODEL.parameters * 6 / COPY - MODEL.sequence * MODEL.hidden * 2 / COPY
                     - 2 * MODEL.sequence * MODEL.hidden * MODEL.vocab / RATE
                     - MODEL.sequence * MODEL.vocab * 8 / COPY) / layers  # fmt: skip
    assert full.backward_s - plain.backward_s == pytest.approx(layers * layer_forward, rel=1e-9)
    assert full.forward_s == plain.forward_s


def test_a_faster_measured_shape_prices_the_same_flops_faster():
    slow, fast = _flat(rate=1e14), _flat(rate=4e14)
    layout = Layout(dp=1, micro_batch=1, global_batch=1)
    assert stage_compute(MODEL, layout, fast, 0).matmul_s == pytest.approx(
        stage_compute(MODEL, layout, slow, 0).matmul_s / 4
    )
    # between two measured shapes the rate lies between theirs
    profile = ComputeProfile(
        device="two", matmul=((1024, 1024, 1024, 1e14), (4096, 4096, 4096, 4e14)),
        attention=((512, 64, 1e14, 1e14),), copy_bytes_per_s=1e12, adam_params_per_s=1e9,
    )  # fmt: skip
    rate = 2 * 2048**3 / profile.matmul_s(2048, 2048, 2048)
    assert 1e14 < rate < 4e14


def test_the_simulated_step_prices_compute_and_the_optimizer_by_the_profile():
    topo = resolve("h100-node")
    layout = Layout(dp=2, micro_batch=1, global_batch=4)
    placement = place(topo, layout)
    profiled = simulate_step(MODEL, layout, topo, placement, StepConfig(compute=_flat()))
    stage = stage_compute(MODEL, layout, _flat(), 0)
    assert profiled.compute_s == pytest.approx(layout.microbatches * (stage.forward_s + stage.backward_s))
    assert profiled.optimizer_s == pytest.approx(MODEL.parameters / 1e9)
    constant = simulate_step(MODEL, layout, topo, placement, StepConfig())
    assert constant.compute_s != profiled.compute_s


def test_bench_compute_writes_a_profile_the_planner_loads(tmp_path, capsys):
    out, profile = tmp_path / "rows.jsonl", tmp_path / "profile.json"
    assert main(["bench", "compute", "--quick", "--out", str(out), "--profile-out", str(profile)]) == 0
    loaded = load_profile(profile)
    assert loaded.device == "cpu" and all(r[3] > 0 for r in loaded.matmul)
    ops = {json.loads(line)["op"] for line in out.read_text().splitlines()}
    assert ops == {"matmul", "attention", "copy", "adamw"}
    assert f"profile in {profile}" in capsys.readouterr().out
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "2", "--global-batch", "4", "--json"]
    assert main([*argv, "--compute", str(profile)]) == 0
    assert json.loads(capsys.readouterr().out)["compute_s"] > 0


def test_a_bad_profile_is_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"device": "x", "matmul": []}))
    argv = ["simulate", "train", "--topology", "h100-node", "--global-batch", "1", "--compute", str(bad)]
    assert main(argv) == 2
    said = capsys.readouterr().out
    assert (
        said.startswith(f"dtrain: error: --compute: {bad}: not a dtrain bench compute profile")
        and len(said.splitlines()) == 1
    )


def test_the_shipped_h100_profile_loads_by_name_and_stays_under_the_datasheet_peak():
    from dtrain.sim.compute import profile

    h100 = profile("h100-sxm")
    assert h100.device == "NVIDIA H100 80GB HBM3"
    assert max(r[3] for r in h100.matmul) < 989.4e12  # dense bf16 peak of the H100 SXM datasheet
    assert h100.copy_bytes_per_s < 3.35e12  # HBM3 bandwidth of the same datasheet
