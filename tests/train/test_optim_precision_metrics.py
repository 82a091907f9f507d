"""AdamW's groups, the learning-rate schedules, the precision settings and loss scale, and the metrics writer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dtrain.models import build, preset
from dtrain.train.metrics import PEAK_BF16_FLOPS, MetricsWriter, mfu, peak_flops, peak_memory_bytes
from dtrain.train.optim import adamw, lr_schedule, param_groups, set_lr
from dtrain.train.precision import DynamicLossScaler, autocast, autocast_dtype


def test_weight_decay_falls_on_matrices_and_embeddings_only_and_tied_weights_count_once():
    model = build(preset("llama", "tiny"))
    groups = param_groups(model.named_parameters(), weight_decay=0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert model[0].embed_tokens.weight in decay["params"]  # the tied head is the same tensor, listed once
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    opt = adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    set_lr(opt, 5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]


def test_cosine_warms_up_linearly_then_falls_to_the_floor_at_the_last_step():
    rate = lr_schedule("cosine", lr=1.0, steps=11, warmup_steps=3, min_lr_ratio=0.1)
    assert [rate(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert rate(3) == pytest.approx(1.0)
    assert rate(10) == pytest.approx(0.1)
    assert rate(3 + 7 / 2) == pytest.approx(0.55)  # halfway down the half cosine
    values = [rate(s) for s in range(3, 11)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly_over_its_last_steps():
    rate = lr_schedule("wsd", lr=2.0, steps=10, warmup_steps=1, decay_steps=4, min_lr_ratio=0.0)
    assert [rate(s) for s in range(10)] == pytest.approx([1.0, 2, 2, 2, 2, 2, 1.5, 1.0, 0.5, 0.0])
    default = lr_schedule("wsd", lr=1.0, steps=100)
    assert default(79) == 1.0 and default(80) < 1.0 and default(99) == pytest.approx(0.1)
    assert lr_schedule("constant", lr=3.0, steps=5, warmup_steps=2)(4) == 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "linear"}, "kind must be one of constant, cosine, wsd"),
        ({"warmup_steps": 20}, "warmup_steps must be a number in [0, 10]"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"kind": "wsd", "warmup_steps": 8, "decay_steps": 5}, "decay_steps"),
    ],
)
def test_bad_schedules_name_the_argument(kwargs, message):
    args = {"kind": "cosine", "lr": 1.0, "steps": 10, **kwargs}
    with pytest.raises(ValueError, match="lr_schedule: ") as info:
        lr_schedule(args.pop("kind"), **args)
    assert message in str(info.value)


def test_precision_settings_pick_the_autocast_dtype_per_device():
    assert autocast_dtype("auto", "cpu") is None
    assert autocast_dtype("auto", "cuda") is torch.bfloat16
    assert autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert autocast_dtype("float32", "cuda") is None
    assert autocast_dtype("fp16", "cuda") is torch.float16
    with pytest.raises(ValueError, match="--precision fp16: float16 training needs a CUDA device"):
        autocast_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="--precision: must be one of"):
        autocast_dtype("bf17", "cpu")
    x = torch.randn(4, 4)
    with autocast(torch.bfloat16, "cpu"):
        assert (x @ x).dtype is torch.bfloat16
    with autocast(None, "cpu"):
        assert (x @ x).dtype is torch.float32


def test_the_loss_scale_backs_off_on_overflow_and_grows_after_clean_steps():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    scaler.update(True)
    assert scaler.scale == 512.0 and scaler.skipped == 1
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 512.0
    scaler.update(False)
    assert scaler.scale == 1024.0
    scaler.update(False)
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == {"scale": 1024.0, "clean_steps": 1, "skipped": 1}
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_mfu_is_model_flops_over_the_datasheet_peak_and_undefined_on_cpu(monkeypatch):
    assert peak_flops("cpu") is None and mfu(1e6, 1e9, 2, "cpu") is None and peak_memory_bytes("cpu") is None
    assert dict(PEAK_BF16_FLOPS)["A100"] == 312e12
    names = {"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA H100 PCIe", "cuda:2": "Some Other GPU"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[str(device)])
    assert peak_flops("cuda:0") == 989.4e12 and peak_flops("cuda:1") == 756e12 and peak_flops("cuda:2") is None
    # 80k tokens/s over 2 H100 SXM at 7.5 GFLOP a token: 6e14 of 2 x 989.4e12 FLOP/s
    assert mfu(80e3, 7.5e9, 2, "cuda:0") == pytest.approx(6e14 / (2 * 989.4e12))


def test_metrics_go_to_json_lines_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.write({"step": 1, "loss": 3.5, "lr": 1e-3, "mfu": None, "note": "x"})
        writer.write({"step": 2, "loss": 3.0, "eval_loss": 3.2, "grad_norm": math.inf})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == [3.5, 3.0]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/loss"} <= tags and "train/grad_norm" not in tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.5), (2, 3.0)]
    with MetricsWriter(tmp_path, tensorboard=False, resume=True) as writer:
        writer.write({"step": 3, "loss": 2.5})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_tensorboard_shows_each_step_once_after_a_resume_and_a_fresh_run_hides_an_earlier_one(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars() -> list[tuple[int, float]]:
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train/loss")]

    with MetricsWriter(tmp_path, tensorboard=True) as writer:  # an attempt that died after its checkpoint of step 2
        for step in (1, 2, 3, 4):
            writer.write({"step": step, "loss": float(step)})
    with MetricsWriter(tmp_path, tensorboard=True, resume=True, first_step=2) as writer:
        for step in (3, 4):
            writer.write({"step": step, "loss": 10.0 + step})
    assert scalars() == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    with MetricsWriter(tmp_path, tensorboard=True) as writer:  # a new run in the same directory
        writer.write({"step": 1, "loss": 0.5})
    assert scalars() == [(1, 0.5)]


def test_a_restarted_run_drops_the_metrics_past_its_checkpoint_and_a_half_written_line(tmp_path):
    from dtrain.train.loop import _trim_metrics

    records = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(records) + '{"step": 5, "lo')  # the dead attempt's last write
    _trim_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(records[:2])
