"""dtrain.sim.compute: operations, their prices, the curve file, and dtrain bench compute on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.sim.compute import (
    ATTENTION_CALL,
    DEVICE_COMPUTE,
    LOG_SOFTMAX_BYTES,
    Curve,
    device_compute,
    layer_ops,
    load_curves,
    price,
    stage_compute,
    stage_ops,
)
from dtrain.sim.model import Layout, ModelSpec

GPT = ModelSpec(parameters=1e9, layers=4, hidden=1024, heads=16, sequence=512, vocab=32000)
A100 = DEVICE_COMPUTE["a100-sxm"]


def test_layer_matmul_flops_are_the_megatron_count() -> None:
    layout = Layout(tp=2, micro_batch=2, global_batch=2)
    ops = layer_ops(GPT, layout)
    products = sum(op.total_flops for op in ops if op.kind == "matmul" and op.name not in ("scores", "context"))
    tokens, h = 2 * 512, 1024
    assert products == pytest.approx(3 * 24 * tokens * h * h / 2)  # 24 T h^2 forward, 3x with backward, over tp
    attention = sum(op.total_flops for op in ops if op.name in ("scores", "context"))
    assert attention == pytest.approx(3 * 4 * 2 * 512 * 512 * h / 2)


def test_grouped_kv_heads_and_gated_mlp_change_the_shapes() -> None:
    llama = ModelSpec(parameters=1e9, layers=4, hidden=1024, heads=16, sequence=512, kv_heads=4, ffn_hidden=2816,
                      gated_mlp=True)  # fmt: skip
    ops = {op.name: op for op in layer_ops(llama, Layout()) if op.phase == "F"}
    assert ops["qkv"].n == 1024 + 2 * 4 * 64
    assert ops["mlp-in"].n == 2 * 2816 and ops["mlp-out"].k == 2816


def test_recompute_and_sequence_parallel_price_what_they_should() -> None:
    base = stage_compute(GPT, Layout(tp=2), 0, A100)
    full = stage_compute(GPT, Layout(tp=2, recompute="full"), 0, A100)
    selective = stage_compute(GPT, Layout(tp=2, recompute="selective"), 0, A100)
    layer_forward = sum(price(op, A100) for op in layer_ops(GPT, Layout(tp=2)) if op.phase == "F")
    assert full.recompute_s == pytest.approx(GPT.layers * layer_forward)
    assert base.forward_s > GPT.layers * layer_forward  # plus the embedding, final norm, logits, cross-entropy
    assert 0 < selective.recompute_s < full.recompute_s

    def norm_bytes(layout: Layout) -> float:
        return sum(op.nbytes for op in layer_ops(GPT, layout) if op.name in ("norms", "residual-adds"))

    assert norm_bytes(Layout(tp=2, sequence_parallel=True)) == pytest.approx(norm_bytes(Layout(tp=2)) / 2)
    flash = stage_compute(GPT, Layout(tp=2, recompute="selective", attention="flash"), 0, A100)
    assert flash.recompute_s == 0


def test_megatron_lm_kernels_price_the_2021_layer_as_it_runs() -> None:
    layout = Layout(tp=2, micro_batch=2, global_batch=2)
    tokens, h, heads = 2 * 512, 1024, 2 * 16 // 2

    def nbytes(ops, name: str, phase: str) -> float:
        return sum(op.nbytes for op in ops if op.name == name and op.phase == phase)

    fused, megatron = layer_ops(GPT, layout), layer_ops(GPT, layout, "megatron-lm")
    assert [op for op in megatron if op.kind == "matmul"] == [op for op in fused if op.kind == "matmul"]
    qkv = tokens * 3 * h / 2
    assert nbytes(megatron, "qkv-bias", "F") == pytest.approx(4 * qkv)  # matmul, then add_ of the bias
    assert nbytes(megatron, "qkv-bias", "B") == pytest.approx(2 * qkv)  # the bias gradient's sum over tokens
    assert nbytes(megatron, "qkv-split", "B") == pytest.approx(4 * qkv)
    assert nbytes(megatron, "scores-scale", "B") == pytest.approx(4 * tokens * 2 * h / 2)
    assert nbytes(megatron, "context-copy", "F") == pytest.approx(4 * tokens * h / 2)
    assert not {"qkv-bias", "qkv-split", "scores-scale", "context-copy"} & {op.name for op in fused}
    # the causal kernel reads the lower triangle only: 8 and 9 bytes a score against the model's 9 and 11
    scores = heads * 512 * 512
    assert nbytes(megatron, "softmax-dropout", "F") == pytest.approx(8 * scores)
    assert nbytes(megatron, "softmax-dropout", "B") == pytest.approx(9 * scores)
    assert nbytes(fused, "softmax-dropout", "F") == pytest.approx(9 * scores)
    assert nbytes(megatron, "norms", "B") == pytest.approx(nbytes(fused, "norms", "B") * 10 / 8)
    # past 2048 the fused softmax is not taken: 32-bit scale, mask, softmax and casts
    long = ModelSpec(parameters=1e9, layers=4, hidden=1024, heads=16, sequence=4096, vocab=32000)
    longer = layer_ops(long, layout, "megatron-lm")
    assert nbytes(longer, "softmax-dropout", "F") == pytest.approx(41 * heads * 4096**2)
    assert nbytes(longer, "softmax-dropout", "B") == pytest.approx(45 * heads * 4096**2)
    # the 32-bit cross-entropy on the last stage: 38 and 14 bytes a logit against 10 and 6
    last = stage_compute(GPT, layout, 0, A100, "megatron-lm")
    base = stage_compute(GPT, layout, 0, A100)
    logits = tokens * 32000 / 2
    assert last.by_name["cross-entropy"] - base.by_name["cross-entropy"] == pytest.approx(
        A100.memory_s(52 * logits) - A100.memory_s(16 * logits)
    )
    assert last.total_s > base.total_s
    # selective recomputation runs the context copy again with the attention core
    selective = Layout(tp=2, micro_batch=2, global_batch=2, recompute="selective")
    sel, sel_fused = stage_compute(GPT, selective, 0, A100, "megatron-lm"), stage_compute(GPT, selective, 0, A100)
    copy = price(next(op for op in megatron if op.name == "context-copy"), A100)
    softmax_saving = A100.memory_s(9 * scores) - A100.memory_s(8 * scores)
    assert sel.recompute_s - sel_fused.recompute_s == pytest.approx(GPT.layers * (copy - softmax_saving))
    with pytest.raises(ValueError, match="kernels 'apex' is not one of fused, megatron-lm"):
        layer_ops(GPT, layout, "apex")


def test_first_and_last_stages_carry_embedding_and_logits() -> None:
    layout = Layout(pp=2, global_batch=2)
    first, last = stage_compute(GPT, layout, 0, A100), stage_compute(GPT, layout, 1, A100)
    assert "logits" in last.by_name and last.by_name["logits"] > 0 and first.by_name.get("logits", 0) == 0
    assert last.total_s > first.total_s


def test_small_matmuls_run_below_the_ceiling_and_big_ones_near_it() -> None:
    small, big = A100.matmul_s(128, 128, 128), A100.matmul_s(8192, 8192, 8192)
    assert 2 * 128**3 / small / A100.peak_flops < 0.1
    assert 2 * 8192**3 / big / A100.peak_flops == pytest.approx(A100.matmul_efficiency, rel=0.02)


def test_curves_load_absent_or_present_and_replace_the_constants(tmp_path) -> None:
    assert load_curves(tmp_path / "none.json") == {}
    path = tmp_path / "curves.json"
    path.write_text(
        json.dumps({"devices": {"h100-sxm": {"matmul": [[1e9, 0.2], [1e12, 0.4]], "memory": [[1e6, 0.5]]}}})
    )
    curves = load_curves(path)
    h100 = device_compute(989.4e12, 3350e9, curves=curves)
    assert h100.key == "h100-sxm" and h100.matmul_curve(1e12) == pytest.approx(0.4)
    assert h100.matmul_curve(10**10.5) == pytest.approx(0.3)  # halfway in log(size)
    assert device_compute(989.4e12, 3350e9, curves={}).matmul_curve is None
    assert device_compute(1e15, 3e12, curves={}).key == "generic"
    path.write_text("{}")
    with pytest.raises(ValueError, match="compute-curve file"):
        load_curves(path)
    with pytest.raises(ValueError, match="increasing"):
        Curve((2.0, 1.0), (0.5, 0.5))


def test_bench_compute_quick_on_the_cpu_writes_rows_and_curves(tmp_path) -> None:
    pytest.importorskip("torch")
    from dtrain.cli.main import main

    out, curves = tmp_path / "rows.jsonl", tmp_path / "curves.json"
    assert main(["bench", "compute", "--quick", "--repeats", "1", "--warmup", "0", "--out", str(out),
                 "--write-curves", str(curves)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"matmul", "matmul-fp8", "attention", "attention-full", "memory"}
    assert all(r["seconds"] > 0 and r["efficiency"] > 0 for r in rows)
    # the unmasked kernel does twice the causal one's work on the same shape
    for causal in (r for r in rows if r["kind"] == "attention"):
        full = next(
            r
            for r in rows
            if r["kind"] == "attention-full" and (r["seq"], r["heads"]) == (causal["seq"], causal["heads"])
        )
        assert full["flops"] == 2 * causal["flops"] and full["op"] == "sdpa"
    loaded = load_curves(curves)["cpu"]
    assert set(loaded) == {"matmul", "matmul-fp8", "attention", "attention-full", "memory"}  # no GPU family
    # bytes read and written once: the unary ops and the cross-entropy's log-softmax read and write the tensor,
    # the add reads two and writes one
    reads_writes = {r["op"]: r["bytes"] / r["elements"] for r in rows if r["kind"] == "memory" and r["op"] != "adamw"}
    item = reads_writes["layer-norm"] / 2
    assert reads_writes == {op: n * item for op, n in (("layer-norm", 2), ("rms-norm", 2), ("gelu", 2), ("silu", 2),
                                                        ("add", 3), ("cross-entropy", 2))}  # fmt: skip


def test_fp8_runs_the_linear_products_at_the_fp8_rate_with_their_casts() -> None:
    h100 = DEVICE_COMPUTE["h100-sxm"]
    layout = Layout(tp=2, micro_batch=2, global_batch=4, sequence_parallel=True, attention="flash")
    fp8 = Layout(tp=2, micro_batch=2, global_batch=4, sequence_parallel=True, attention="flash", fp8=True)
    ops = layer_ops(GPT, fp8)
    linear = {"qkv", "attention-out", "mlp-in", "mlp-out"}
    assert {op.name for op in ops if op.fp8} == linear  # every phase of the four linear products, nothing else
    assert all(op.fp8 for op in ops if op.name in linear)
    assert not any(op.fp8 for op in stage_compute_ops(fp8) if op.name == "logits")
    tokens, h, t, f = 2 * 512, 1024, 2, 4096
    casts = {op.phase: op.nbytes for op in ops if op.name == "fp8-cast"}
    weights = (4 * h * h + 2 * h * f) / t
    assert casts["F"] == pytest.approx(2 * tokens * (2 * h + h / t + f / t) + 3 * tokens * h / t + 4 * weights / 2)
    assert casts["B"] == pytest.approx(4 * tokens * (3 * h / t + h + f / t + h))
    product = next(op for op in ops if op.name == "mlp-in" and op.phase == "F")
    assert h100.matmul_s(product.m, product.n, product.k, fp8=True) < h100.matmul_s(product.m, product.n, product.k)
    assert stage_compute(GPT, fp8, 0, h100).total_s < stage_compute(GPT, layout, 0, h100).total_s
    with pytest.raises(ValueError, match="no FP8"):
        A100.matmul_s(1024, 1024, 1024, fp8=True)


def stage_compute_ops(layout: Layout) -> list:
    from dtrain.sim.compute import stage_ops

    return [op for part in stage_ops(GPT, layout, 0).values() for op in part]


def test_fp8_keeps_8_bit_inputs_and_8_bit_weights() -> None:
    from dtrain.sim.model import activation_bytes_per_layer, memory_per_device

    s, b, h, t = 512, 2, 1024, 2
    for sp, saved in ((True, 7 / t), (False, 2 + 5 / t)):
        plain = Layout(tp=t, micro_batch=b, global_batch=b, sequence_parallel=sp)
        fp8 = Layout(tp=t, micro_batch=b, global_batch=b, sequence_parallel=sp, fp8=True)
        difference = activation_bytes_per_layer(GPT, plain) - activation_bytes_per_layer(GPT, fp8)
        assert difference == pytest.approx(saved * s * b * h)
        assert memory_per_device(GPT, fp8).weights == pytest.approx(2 * memory_per_device(GPT, plain).weights)
    assert "fp8" in Layout(fp8=True).describe()
    with pytest.raises(ValueError, match="fp8 and fp8_params must be"):
        Layout(fp8="yes")
    fp8_weights = Layout(tp=t, micro_batch=b, global_batch=b, fp8=True, fp8_params=True)
    assert memory_per_device(GPT, fp8_weights).weights == pytest.approx(memory_per_device(GPT, Layout(tp=t,
        micro_batch=b, global_batch=b)).weights)  # fmt: skip
    assert "fp8-params" in fp8_weights.describe()


def test_fused_accumulation_leaves_out_the_accumulating_pass() -> None:
    plain = {op.name for op in layer_ops(GPT, Layout())}
    fused = layer_ops(GPT, Layout(), fused_accumulation=True)
    assert "grad-accumulate" in plain and plain - {op.name for op in fused} == {"grad-accumulate"}
    assert (
        stage_compute(GPT, Layout(), 0, A100, fused_accumulation=True).weight_s
        < stage_compute(GPT, Layout(), 0, A100).weight_s
    )


def test_fp8_curve_loads_and_is_used() -> None:
    curves = {"h100-sxm": {"matmul-fp8": Curve((1e9, 1e12), (0.25, 0.5))}}
    h100 = device_compute(989.4e12, 3350e9, curves=curves)
    assert h100.fp8_matmul_curve is not None and h100.matmul_curve is None
    m = n = k = 8192
    assert h100.matmul_s(m, n, k, fp8=True) == pytest.approx(2 * m * n * k / (1978.9e12 * 0.5) + h100.kernel_s)


def test_bench_compute_times_fp8_products_and_merges_curves_by_kind(tmp_path) -> None:
    pytest.importorskip("torch")
    from dtrain.bench.compute import curves_from_rows, run, write_curves

    rows = run(quick=True, repeats=1, warmup=0, kinds=("matmul-fp8",))
    assert rows and {r["kind"] for r in rows} == {"matmul-fp8"}
    assert max(r["efficiency"] for r in rows) == pytest.approx(1.0)  # the CPU's best FP8 product is its peak
    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"devices": {"cpu": {"matmul": [[1e9, 0.5]], "measured": "an older run"}}}))
    write_curves(path, "cpu", curves_from_rows(rows), "this run")
    entry = json.loads(path.read_text())["devices"]["cpu"]
    assert entry["matmul"] == [[1e9, 0.5]] and entry["matmul-fp8"]
    assert entry["measured"] == {"matmul": "an older run", "matmul-fp8": "this run"}
    assert set(load_curves(path)["cpu"]) == {"matmul", "matmul-fp8"}
    with pytest.raises(ValueError, match="--kinds"):
        run(quick=True, kinds=("tensor",))
    with pytest.raises(ValueError, match="--timing wall"):
        run(quick=True, timing="wall")


def test_a_measured_sustained_factor_slows_the_devices_products_and_nothing_else(tmp_path) -> None:
    from dtrain.sim.compute import device_compute

    h200 = DEVICE_COMPUTE["h200-sxm"]
    path = tmp_path / "curves.json"
    curves = {"matmul": [[1e9, 0.5], [1e13, 0.7]], "matmul-fp8": [[1e9, 0.4], [1e13, 0.6]], "memory": [[1e6, 0.8]]}
    path.write_text(json.dumps({"devices": {"h200-sxm": {**curves, "sustained": {"matmul": 1.1, "matmul-fp8": 1.2}}}}))
    held = device_compute(h200.peak_flops, h200.memory_bytes_per_s, curves=load_curves(path))
    path.write_text(json.dumps({"devices": {"h200-sxm": curves}}))
    burst = device_compute(h200.peak_flops, h200.memory_bytes_per_s, curves=load_curves(path))
    big = (8192, 12288, 12288)
    for fp8, factor in ((False, 1.1), (True, 1.2)):
        grown = (held.matmul_s(*big, fp8=fp8) - held.kernel_s) / (burst.matmul_s(*big, fp8=fp8) - burst.kernel_s)
        assert grown == pytest.approx(factor)
    assert held.memory_s(1e9) == burst.memory_s(1e9) and held.attention_s(1e12) == burst.attention_s(1e12)
    h100 = DEVICE_COMPUTE["h100-sxm"]  # another device's factor is not taken
    assert device_compute(h100.peak_flops, h100.memory_bytes_per_s, curves=load_curves(path)).sustained == 1.0
    path.write_text(json.dumps({"devices": {"h200-sxm": {"sustained": {"attention": 1.1}}}}))
    with pytest.raises(ValueError, match="sustained"):
        load_curves(path)


def test_the_sustained_factor_is_the_layers_sustained_time_over_what_the_curves_price(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))
    pytest.importorskip("torch")
    from sustained_products import sustained_factors

    from dtrain.sim.compute import device_compute

    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"devices": {"h200-sxm": {"matmul": [[1e9, 0.5], [1e13, 0.7]]}}}))
    h200 = DEVICE_COMPUTE["h200-sxm"]
    device = device_compute(h200.peak_flops, h200.memory_bytes_per_s, curves=load_curves(path))
    shapes = [(2048, 9216, 12288), (12288, 3072, 2048)]
    rows = [{"precision": "bf16", "m": m, "n": n, "k": k, "sustained_s": 1.25 * device.matmul_s(m, n, k)}
            for m, n, k in shapes]  # fmt: skip
    assert sustained_factors(rows, "h200-sxm", str(path)) == {"matmul": pytest.approx(1.25)}


def test_the_stored_sustained_factor_is_the_mean_over_the_layers_measured(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))
    pytest.importorskip("torch")
    from sustained_products import _store_mean

    from dtrain.sim.compute import device_compute

    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"devices": {"h200-sxm": {"matmul": [[1e9, 0.5], [1e13, 0.7]]}}}))
    h200 = DEVICE_COMPUTE["h200-sxm"]
    device = device_compute(h200.peak_flops, h200.memory_bytes_per_s, curves=load_curves(path))
    files = []
    for i, (factor, (m, n, k)) in enumerate(((1.1, (2048, 9216, 12288)), (1.3, (4096, 2048, 6144)))):
        row = {"device": "NVIDIA H200", "precision": "bf16", "m": m, "n": n, "k": k,
               "sustained_s": factor * device.matmul_s(m, n, k)}  # fmt: skip
        files.append(tmp_path / f"layer{i}.jsonl")
        files[-1].write_text(json.dumps(row) + "\n")
    _store_mean([str(f) for f in files], str(path))
    assert load_curves(path)["h200-sxm"]["sustained"] == {"matmul": pytest.approx(1.2)}


LLAMA_1B = ModelSpec(parameters=1.24e9, layers=16, hidden=2048, heads=32, sequence=2048, vocab=128256,
                     ffn_hidden=8192, kv_heads=8, gated_mlp=True)  # fmt: skip
EAGER_OPS = Path(__file__).resolve().parents[2] / "benchmarks/results/eager_ops-llama1b-h200x1-run2.jsonl"
_MATRIX_OR_ATTENTION = ("mm", "_cudnn_attention", "_scaled_dot_product", "_flash_attention", "_efficient_attention")
_NO_KERNEL = {"unsqueeze", "squeeze", "slice", "select", "as_strided", "_reshape_alias", "unbind", "empty"}


def _recorded_bytes(op: dict, logits: int) -> float | None:
    """Bytes one recorded aten operation reads and writes (None: a product, attention, a view, or the test's own
    seed gradient); the recording counts each input's elements, so an expanded view, a loss that gathers and a
    zero-fill are counted as what they touch, and the log-softmax as the passes PyTorch's kernels make."""
    name = op["op"].split(".")[1]
    if name.startswith(_MATRIX_OR_ATTENTION) or name in _NO_KERNEL or name == "ones_like":
        return None
    if name in ("_log_softmax", "_log_softmax_backward_data"):
        return LOG_SOFTMAX_BYTES[name != "_log_softmax"] * logits
    reads = [n for _, _, n in op["inputs"]]
    if name in ("nll_loss_forward", "nll_loss_backward", "fill_"):  # a gather of b s values; a fill writes only
        reads = []
    return sum(reads) + sum(n for _, _, n in op["outputs"])


def test_dtrain_kernels_move_the_bytes_the_eager_decoder_dispatched_on_an_h200() -> None:
    """``kernels="dtrain"`` against every aten operation a Llama 3.2 1B block and its head dispatched under bf16
    autocast on an H200 (``benchmarks/gpu/eager_ops.py``, a TorchDispatchMode): the same number of memory-bound
    kernels a pass and the same bytes, to 0.5%."""
    record = next(r for r in map(json.loads, EAGER_OPS.read_text().splitlines()) if r["record"] == "ops")
    layout = Layout(micro_batch=record["micro_batch"], global_batch=record["micro_batch"], attention="flash")
    assert record["seq_len"] == LLAMA_1B.sequence
    logits = layout.micro_batch * LLAMA_1B.sequence * LLAMA_1B.vocab
    recorded: dict[tuple[str, str], list[float]] = {}
    for op in record["ops"]:
        if op["part"] == "head" and op["op"].startswith("aten.add_"):
            continue  # the recording's block and head share one leaf input, whose gradient the head's adds to
        if (n := _recorded_bytes(op, logits)) is not None and not op["op"].startswith("aten.nll_loss_forward"):
            recorded.setdefault((op["part"], op["pass"]), []).append(n)
    parts = stage_ops(LLAMA_1B, layout, 0, "dtrain")
    for part, key in (("block", "layer"), ("head", "last")):
        for phase in ("F", "B"):
            priced = [op.nbytes for op in parts[key] if op.kind == "memory" and (op.phase == "F") == (phase == "F")
                      and op.name != "grad-accumulate"]  # fmt: skip
            assert len(priced) == len(recorded[part, phase]), (part, phase)
            assert sum(priced) == pytest.approx(sum(recorded[part, phase]), rel=5e-3), (part, phase)


def test_dtrain_kernels_cast_every_weight_each_micro_batch_and_run_no_fp8_or_sequence_parallelism() -> None:
    def casts(micro_batch: int) -> float:
        ops = layer_ops(LLAMA_1B, Layout(micro_batch=micro_batch, global_batch=8, attention="flash"), "dtrain")
        return sum(op.nbytes for op in ops if op.name == "weight-casts")

    weights = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192
    assert casts(1) == casts(4) == 6 * weights  # read 4, write 2 a weight, whatever the micro-batch
    flash = Layout(micro_batch=2, global_batch=2, attention="flash")
    eager, fused = (stage_compute(LLAMA_1B, flash, 0, DEVICE_COMPUTE["h200-sxm"], k) for k in ("dtrain", "fused"))
    assert eager.forward_s > fused.forward_s and eager.flops == fused.flops  # the same products, more bytes
    for layout in (Layout(attention="flash", fp8=True), Layout(attention="flash", sequence_parallel=True, tp=2),
                   Layout()):  # fmt: skip
        with pytest.raises(ValueError, match=r"^kernels 'dtrain': dtrain.models runs no FP8"):
            layer_ops(LLAMA_1B, layout, "dtrain")


@pytest.mark.parametrize("preset_name", ["tiny", "1b"])
def test_dtrain_activation_bytes_are_what_autograd_saves_for_a_block(preset_name: str) -> None:
    """``activation_bytes_per_layer(..., kernels="dtrain")`` against the tensors autograd keeps for a
    ``dtrain.models`` block under bf16 autocast (``saved_tensors_hooks``, each storage once), on the CPU. The CPU's
    RMS norm is the composite one, which also keeps its 32-bit normalized input and its weight; CUDA's fused kernel
    keeps the input and the reciprocal root mean square alone. RoPE's cos and sin are a few kilobytes."""
    import torch

    from dtrain.models.decoder import Block
    from dtrain.models.presets import preset
    from dtrain.sim.model import activation_bytes_per_layer
    from dtrain.train.plan import model_spec

    config = preset("llama", preset_name)
    b, s = 2, 64
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(b, s, config.hidden_size, requires_grad=True)
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        block(x)
    h, d = config.hidden_size, config.head_dim
    cpu_norms = 2 * (4 * b * s * h + 4 * h)  # the composite norm's normalized input and weight, twice
    rope = 2 * 2 * s * d  # cos and sin, 16 bits
    spec = model_spec(config, s)
    priced = activation_bytes_per_layer(
        spec, Layout(micro_batch=b, global_batch=b, attention="flash"), "none", "dtrain"
    )
    rstd = 2 * 4 * b * s  # the norms' 32-bit reciprocal root mean squares, not priced
    assert sum(saved.values()) == priced + cpu_norms + rope + rstd


def test_zb_v_memory_follows_the_order_dtrain_train_runs() -> None:
    """Under ZB-V with ``dtrain train``'s cut each stage holds its chunks' blocks from a micro-batch's forward to its
    weight-gradient pass, as the order built for the chunks' FLOPs schedules them: at least one micro-batch of
    every block it holds, at most all ``m``, and on Llama 1B (pp 4, m 8, equal layer counts) more than 1F1B's ``p``
    micro-batches of the stage's blocks on some stage."""
    from dtrain.sim.model import stage_blocks, zb_v_blocks_in_flight

    layout = Layout(pp=4, micro_batch=2, global_batch=16, schedule="zb-v", chunks=2, attention="flash",
                    balance="layers")  # fmt: skip
    held, blocks = zb_v_blocks_in_flight(LLAMA_1B, layout), stage_blocks(LLAMA_1B, layout)
    assert all(b <= h <= 8 * b for h, b in zip(held, blocks, strict=True))
    assert any(h > 4 * b for h, b in zip(held, blocks, strict=True))


def test_dtrain_memory_prices_the_peaks_of_dtrains_own_runs_on_4_h100s() -> None:
    """The memory model with ``kernels="dtrain"`` against the peak memory each of dtrain's 13 runs on 4 x H100
    recorded (``benchmarks/sim/validation/training_h100.py``'s rows: data parallel, tensor, pipeline, hybrid,
    ZeRO-3, recomputation), priced as those runs' attention held its keys and values (repeated to every head):
    within 6% of every one, where the fused layer's memory misses the data-parallel run by over 30%; read in place,
    as dtrain.models' attention reads them, less."""
    import sys

    from dtrain.sim.model import memory_per_device

    sys.path.insert(0, str(EAGER_OPS.parents[1] / "sim" / "validation"))
    try:
        from training_h100 import RUNS_FORM, rows
    finally:
        sys.path.pop(0)
    for row in rows():
        eager = memory_per_device(row["model"], row["layout"], "dtrain", eager=RUNS_FORM).total / 2**30
        assert eager == pytest.approx(row["measured_gib"], rel=0.06), row["run"]
        assert memory_per_device(row["model"], row["layout"], "dtrain").total / 2**30 < eager
    dp = next(row for row in rows() if row["run"] == "dtrain train dp4, 100 steps")
    assert memory_per_device(dp["model"], dp["layout"]).total / 2**30 < 0.7 * dp["measured_gib"]


def test_dtrain_tensor_parallelism_sums_each_parts_input_gradient_once_in_16_bits() -> None:
    """With ``kernels="dtrain"`` a layer's backward runs one all-reduce of the 16-bit input gradient for attention
    and one for the MLP (dtrain.models' parts cast their input once and declare ``tensor_parallel_shared_input``):
    two of ``tp_s``, as the fused layer's; with each projection casting its own input (``EagerForm(shared_inputs=
    False)``) one a column-parallel projection, q, k, v, gate and up, of the 32-bit gradient: ten."""
    from dtrain.sim.model import EagerForm, stage_layers
    from dtrain.sim.step import StepConfig, stage_seconds

    layout = Layout(tp=2, micro_batch=2, global_batch=2, attention="flash")
    h200 = DEVICE_COMPUTE["h200-sxm"]
    layers = stage_layers(LLAMA_1B, layout, 0)
    for kernels, shared, calls in (("dtrain", True, 2), ("dtrain", False, 10), ("fused", True, 2)):
        config = StepConfig(kernels=kernels, contention=False, overlap_tp_backward=False,
                            eager=EagerForm(shared_inputs=shared))  # fmt: skip
        none, some = (stage_seconds(LLAMA_1B, layout, 0, h200.peak_flops, h200.memory_bytes_per_s, config, tp)
                      for tp in (0.0, 1e-3))  # fmt: skip
        assert some[1] - none[1] == pytest.approx(layers * calls * 1e-3)
        assert some[0] - none[0] == pytest.approx(layers * 2 * 1e-3 + 1e-3)  # two forward, the embedding's one


def test_each_attention_pass_is_priced_at_the_efficiency_of_its_call() -> None:
    # the curves time a forward with its backward as one call, by the call's FLOPs: the two passes together cost
    # what the curve gives that call, not each pass at the (lower) efficiency of its own smaller size
    curve = Curve((1e10, 1e12), (0.2, 0.6))
    device = replace(DEVICE_COMPUTE["h200-sxm"], attention_curve=curve, kernel_s=0.0)
    ops = [op for op in layer_ops(GPT, Layout(attention="flash")) if op.kind == "attention"]
    forward = next(op.flops for op in ops if op.phase == "F")
    call = 3.5 * forward
    assert sum(price(op, device) for op in ops) == pytest.approx(call / (device.peak_flops * curve(call)))
    # a context-parallel rank's kernels on other ranks' keys are unmasked: priced on the unmasked curve
    full = Curve((1e10, 1e12), (0.3, 0.7))
    ring = [op for op in layer_ops(GPT, Layout(attention="flash", cp=4)) if op.kind == "attention"]
    assert [op.causal for op in ring if op.phase == "F"] == [True, False, False, False]
    unmasked = replace(device, attention_full_curve=full)
    for op in ring:
        size = op.flops * ATTENTION_CALL[op.phase]
        expected = op.flops / (device.peak_flops * (curve if op.causal else full)(size))
        assert price(op, unmasked) == pytest.approx(expected)
        assert price(op, device) == pytest.approx(op.flops / (device.peak_flops * curve(size)))  # no unmasked curve


def test_attention_rows_make_curves_by_kernel_family_and_the_other_family_is_priced_beside_the_own() -> None:
    from dtrain.bench.compute import curves_from_rows

    def rows(backend: str, efficiency: float, kind: str = "attention") -> list[dict]:
        return [{"kind": kind, "backend": backend, "device": "h200-sxm", "flops": f, "efficiency": efficiency}
                for f in (1e10, 1e11, 1e12)]  # fmt: skip

    full = rows("cudnn", 0.6, "attention-full") + rows("flash", 0.3, "attention-full")
    curves = curves_from_rows(rows("cudnn", 0.5) + rows("flash", 0.25) + rows("efficient", 0.1) + full)
    assert curves["attention_kernel"] == "cudnn"
    assert {k for k in curves if k != "attention_kernel"} == {"attention", "attention-full", "attention-fa2",
                                                               "attention-full-fa2"}  # fmt: skip
    assert [e for _, e in curves["attention"]] == [0.5] * 3 and [e for _, e in curves["attention-fa2"]] == [0.25] * 3
    # one family timed alone is the device's own; the CPU's kernels are nobody's family
    assert curves_from_rows(rows("flash", 0.25))["attention_kernel"] == "fa2"
    assert "attention_kernel" not in curves_from_rows([{**r, "device": "cpu"} for r in rows("flash", 0.25)])

    flat = Curve((1e9, 1e13), (0.5, 0.5))
    half, slow_full = Curve((1e9, 1e13), (0.25, 0.25)), Curve((1e9, 1e13), (0.2, 0.2))
    h200 = replace(DEVICE_COMPUTE["h200-sxm"], attention_curve=flat, attention_full_curve=flat,
                   attention_kernel="cudnn", attention_alternates=(("fa2", half, slow_full, flat, flat),))  # fmt: skip
    flops, peak, k = 1e11, h200.peak_flops, h200.kernel_s
    assert h200.attention_s(flops) == pytest.approx(flops / (peak * 0.5) + k)
    fa2 = replace(h200, kernel="fa2")
    assert fa2.attention_s(flops) == pytest.approx(flops / (peak * 0.25) + k)  # its own curve where the chip is its
    assert fa2.attention_s(flops, causal=False) == pytest.approx(flops / (peak * 0.2) + k)
    # a launch-timed device of the same chip keeps its own price and gains the other family's extra device time
    launch = Curve((1e9, 1e13), (0.1, 0.1))
    h100 = replace(fa2, key="h100-sxm", attention_curve=launch)
    assert h100.attention_s(flops) == pytest.approx(flops / (peak * 0.1) + k + flops / peak * (1 / 0.25 - 1 / 0.5))
    with pytest.raises(ValueError, match="no measurement of attention kernel 'cudnn'"):
        replace(DEVICE_COMPUTE["a100-sxm"], kernel="cudnn").attention_s(flops)
    with pytest.raises(ValueError, match="attention kernel 'fa3'"):
        replace(h200, kernel="fa3")


def test_the_shipped_curves_price_flashattention_2_at_its_measured_h200_rate_and_the_h100_beside_its_own() -> None:
    from dtrain.sim.compute import ATTENTION_KERNELS, device_compute
    from dtrain.sim.step import StepConfig

    curves = load_curves()
    h200, h100 = curves["h200-sxm"], curves["h100-sxm"]
    assert h200["attention_kernel"] == h100["attention_kernel"] == "cudnn"
    flops = 9e10  # one 175B layer's attention on tp 4, 2,048 tokens
    own, fa2 = (device_compute(989.4e12, 4800e9, attention_kernel=k) for k in (None, "fa2"))
    assert fa2.attention_s(flops) == pytest.approx(flops / (989.4e12 * h200["attention-fa2"](flops)) + fa2.kernel_s)
    assert 1.6 < fa2.attention_s(flops) / own.attention_s(flops) < 2.1  # FlashAttention-2 at about half cuDNN's rate
    h100_own, h100_fa2 = (device_compute(989.4e12, 3350e9, attention_kernel=k) for k in (None, "fa2"))
    extra = flops / 989.4e12 * (1 / h200["attention-fa2"](flops) - 1 / h200["attention"](flops))
    assert h100_fa2.attention_s(flops) - h100_own.attention_s(flops) == pytest.approx(extra)
    assert device_compute(989.4e12, 3350e9, attention_kernel="cudnn").attention_s(flops) == h100_own.attention_s(flops)
    assert ATTENTION_KERNELS == ("cudnn", "fa2", "fa1")
    with pytest.raises(ValueError, match="attention_kernel 'flash'"):
        StepConfig(attention_kernel="flash")


def test_flashattention_1_is_flashattention_2_slowed_by_the_papers_ratio_at_the_sequence_length() -> None:
    """FlashAttention 1.x has no curve of its own: its kernel takes FlashAttention-2's time (the device's own
    FlashAttention-2 price) times FlashAttention-2's speed over its own in the FlashAttention-2 paper's figures at
    the same sequence length, causal or not; the H200 takes the H100's figures, and a device with none, or an
    operation without its key count, is refused."""
    from dtrain.sim.compute import FA1_SPEEDS, device_compute, fa1_slowdown, layer_ops, price
    from dtrain.sim.model import Layout, ModelSpec

    flops, k = 9e10, 3e-6
    h100_fa2, h100_fa1 = (device_compute(989.4e12, 3350e9, attention_kernel=f) for f in ("fa2", "fa1"))
    assert fa1_slowdown("h100-sxm", 2048) == pytest.approx(265 / 108)  # figure 7 (d): causal, head width 128
    assert fa1_slowdown("h100-sxm", 2048, causal=False) == pytest.approx(320 / 128)  # figure 7 (b)
    assert fa1_slowdown("h200-sxm", 2048) == fa1_slowdown("h100-sxm", 2048)
    assert fa1_slowdown("a100-sxm", 4096) == pytest.approx(173 / 76)  # figure 4 (d)
    between = fa1_slowdown("h100-sxm", 2896)  # 2048 * 2 ** 0.5: halfway in log(keys)
    assert between == pytest.approx(2 / (108 / 265 + 126 / 294), rel=1e-4)  # the speeds' ratio interpolated
    assert fa1_slowdown("h100-sxm", 128) == pytest.approx(163 / 98)  # held at the ends
    assert fa1_slowdown("h100-sxm", 1 << 20) == pytest.approx(328 / 137)
    assert all(fa2 > fa1 for points in FA1_SPEEDS.values() for row in points.values() for _, fa1, fa2 in row)
    for causal in (True, False):
        fa2_s = h100_fa2.attention_s(flops, causal=causal)
        want = (fa2_s - k) * fa1_slowdown("h100-sxm", 2048, causal) + k
        assert h100_fa1.attention_s(flops, causal=causal, keys=2048) == pytest.approx(want)
    with pytest.raises(ValueError, match="needs the keys"):
        h100_fa1.attention_s(flops)
    with pytest.raises(ValueError, match="no published FlashAttention 1.x speed"):
        device_compute(500e12, 1000e9, attention_kernel="fa1").attention_s(flops, keys=2048)
    # a layer's attention kernels carry their key count: one GPT-3 175B layer on tp 4, FP8, sequence 2048
    model = ModelSpec(parameters=175e9, layers=96, hidden=12288, heads=96, sequence=2048, vocab=50688)
    layout = Layout(tp=4, micro_batch=1, global_batch=1, attention="flash", sequence_parallel=True)
    kernels = [op for op in layer_ops(model, layout) if op.kind == "attention"]
    assert kernels and {op.keys for op in kernels} == {2048}
    assert sum(price(op, h100_fa1) for op in kernels) / sum(price(op, h100_fa2) for op in kernels) == pytest.approx(
        265 / 108, rel=0.01
    )
