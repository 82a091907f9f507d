"""benchmarks/training/torchtitan_llama.py without torchtitan: the flavor it registers has each llama preset's
shape (torchtitan's SwiGLU rounding lands on the preset's width), its flags are checked before any rank starts,
and its record is computed from torchtitan's logged metrics with the warm-up logs left out."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from dtrain.models import preset, train_flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))

import torchtitan_llama  # noqa: E402


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "8b"])
def test_the_registered_flavor_has_the_shape_of_the_preset(name):
    config = preset("llama", name)
    spec = torchtitan_llama.flavor(config, 2048)
    assert (spec["dim"], spec["n_layers"], spec["n_heads"], spec["n_kv_heads"], spec["vocab_size"]) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
    )
    assert torchtitan_llama.ffn_width(spec["dim"], spec["multiple_of"], spec["ffn_dim_multiplier"]) == (
        config.intermediate_size
    )
    assert spec["rope_theta"] == config.rope_theta and spec["max_seq_len"] == 2048
    factor = (config.rope_scaling or {}).get("factor", 1.0)
    assert spec["rope_scaling"]["scaling_factor"] == factor


def test_torchtitan_own_llama3_widths_are_reproduced():
    # torchtitan's Llama 3 8B flavor: dim 4096, ffn_dim_multiplier 1.3, multiple_of 1024 -> 14336
    assert torchtitan_llama.ffn_width(4096, 1024, 1.3) == 14336
    assert torchtitan_llama.ffn_width(256, 256, None) == 768  # its debug model


def test_a_head_size_torchtitan_cannot_express_is_refused():
    with pytest.raises(ValueError, match="head_dim"):
        torchtitan_llama.flavor(preset("llama", "1b", head_dim=128), 2048)


@pytest.mark.parametrize("flags", [["--warmup", "3"], ["--steps", "7"], ["--log-freq", "0"], ["--seq-len", "0"]])
def test_bad_flags_stop_the_launch(flags, capsys):
    with pytest.raises(SystemExit):
        torchtitan_llama._parse(flags)
    assert "--" in capsys.readouterr().err


def test_flags_after_the_separator_go_to_torchtitan():
    args = torchtitan_llama._parse(["--compile", "--", "--dataloader.num_workers", "2"])
    flags = torchtitan_llama.torchtitan_flags(args, "dtrain_1b", Path("a"), Path("c"), Path("d"))
    assert flags[-2:] == ["--dataloader.num_workers", "2"]
    assert flags[flags.index("--compile.components") + 1] == "model,loss"
    assert flags[flags.index("--training.steps") + 1] == "25"  # 5 warm-up + 20 timed


def _metrics(step_s: float, loss: float, active: float) -> dict:
    return {
        "time_metrics/end_to_end(s)": step_s,
        "time_metrics/data_loading(s)": 0.001,
        "throughput(tps)": 4 * 2048 / step_s,
        "mfu(%)": 40.0,
        "memory/max_active(GiB)": active,
        "memory/max_reserved(GiB)": active + 1,
        "loss_metrics/global_avg_loss": loss,
    }


def test_the_record_averages_the_logs_after_warmup():
    args = torchtitan_llama._parse(["--steps", "10", "--warmup", "5", "--log-freq", "5"])
    logs = {1: _metrics(9.0, 11.0, 50.0), 5: _metrics(1.0, 10.0, 40.0), 10: _metrics(0.2, 9.0, 30.0)}
    logs[15] = _metrics(0.3, 8.0, 31.0)
    config = preset("llama", "1b")
    record = torchtitan_llama.summarize(logs, args, world=4, config=config, peak=1e15)
    assert math.isclose(record["step_s"], 0.25)
    assert math.isclose(record["tokens_per_s"], 4 * 4 * 2048 / 0.25)
    assert math.isclose(record["mfu"], record["tokens_per_s"] * train_flops_per_token(config, 2048) / 4e15)
    assert math.isclose(record["torchtitan_mfu"], 0.4)
    assert record["peak_memory_gib"] == 31.0 and record["loss"] == 8.0 and record["timed_steps"] == 10
    with pytest.raises(RuntimeError, match="warm-up"):
        torchtitan_llama.summarize({1: logs[1], 5: logs[5]}, args, world=4, config=config, peak=None)
