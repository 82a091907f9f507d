"""dtrain.train.config: the sectioned run configuration, its TOML file, --set overrides and flags."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from dtrain.cli.main import build_parser
from dtrain.models.presets import PRESETS
from dtrain.train.config import (
    SECTIONS,
    ConfigError,
    ParallelSection,
    TrainConfig,
    TrainingSection,
    add_arguments,
    flag_name,
    from_arguments,
    keys,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]


def _train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]


def _config(argv: list[str]) -> TrainConfig:
    return from_arguments(build_parser().parse_args(["train", *argv]))


def _write(tmp_path: Path, text: str, name: str = "train.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ValueError)
    return message


# ----------------------------------------------------------------------------------------------- round trips


def test_every_value_changed_survives_to_toml_and_back(tmp_path):
    config = TrainConfig(
        model=dataclasses.replace(TrainConfig().model, family="gpt2", preset="124m"),
        data=dataclasses.replace(TrainConfig().data, dataset='corp"ora\\x', seq_len=64, eval_every=5),
        parallel=ParallelSection(dp=2, pp=2, tp=2, schedule="gpipe", microbatches=4, zero=1, balance="flops"),
        optimizer=dataclasses.replace(TrainConfig().optimizer, lr=1e-4, eps=1e-10, grad_clip=0.0),
        lr_schedule=dataclasses.replace(TrainConfig().lr_schedule, kind="wsd", warmup_steps=3, decay_steps=6),
        training=TrainingSection(steps=9, batch_size=32, accumulation=2, seed=4, precision="bf16", compile=True),
        checkpoint=dataclasses.replace(TrainConfig().checkpoint, every=3, resume=True, export=False),
        logging=dataclasses.replace(TrainConfig().logging, out="runs/a b", tensorboard=False, log_every=2),
    )
    path = tmp_path / "sub" / "run.toml"
    text = config.to_toml(path)
    assert path.read_text() == text and not list(path.parent.glob("*.tmp"))
    assert load_config(path) == config
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert load_config(_write(tmp_path, TrainConfig().to_toml())) == TrainConfig()
    assert set(config.to_dict()) == set(SECTIONS) and config.to_dict()["parallel"]["tp"] == 2


def test_an_int_for_a_float_key_is_a_float_and_missing_keys_keep_their_defaults(tmp_path):
    config = load_config(_write(tmp_path, "[optimizer]\nlr = 1\n"))
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert dataclasses.replace(config, optimizer=TrainConfig().optimizer) == TrainConfig()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_file_validates(path):
    config = load_config(path)
    assert config.model.preset in PRESETS[config.model.family]
    assert config.training.precision == ("float32" if path.name.endswith("-cpu.toml") else "bf16")


def test_the_shipped_configs_are_the_readme_run_and_the_gpu_runs():
    names = {p.name for p in (ROOT / "configs").glob("*.toml")}
    assert {"tiny-cpu.toml", "gpt2-125m-gpu.toml", "llama-125m-gpu.toml", "llama-1b-gpu.toml"} <= names
    tiny = load_config(ROOT / "configs" / "tiny-cpu.toml")
    assert (tiny.parallel.dp, tiny.parallel.pp, tiny.parallel.microbatches) == (2, 2, 4)
    big = load_config(ROOT / "configs" / "llama-1b-gpu.toml")
    assert (big.model.preset, big.data.seq_len) == ("1b", 2048)


# ------------------------------------------------------------------------------------------------ precedence


def test_defaults_then_the_file_then_set_then_flags(tmp_path):
    path = _write(tmp_path, '[parallel]\ndp = 2\npp = 2\n[training]\nsteps = 7\nbatch_size = 8\n[logging]\nout = "f"\n')
    config = _config(["--config", str(path), "--set", "training.steps=9", "--set", "parallel.dp=1", "--steps", "11"])
    assert config.training.steps == 11  # file 7 < --set 9 < flag 11
    assert config.parallel.dp == 1  # file 2 < --set 1
    assert config.parallel.pp == 2 and config.logging.out == "f"  # the file over the defaults
    assert config.training.seed == 0  # the default
    # later --set wins over earlier; a flag wins even when it restates the default
    assert _config(["--set", "training.seed=1", "--set", "training.seed=2"]).training.seed == 2
    assert _config(["--config", str(path), "--pp", "1"]).parallel.pp == 1


def test_no_flags_give_the_defaults_and_bool_flags_turn_both_ways(tmp_path):
    assert _config([]) == TrainConfig()
    path = _write(tmp_path, "[training]\ncompile = true\n[checkpoint]\nexport = false\n")
    config = _config(["--config", str(path), "--no-compile", "--export", "--resume"])
    assert (config.training.compile, config.checkpoint.export, config.checkpoint.resume) == (False, True, True)


def test_set_values_are_toml_values_or_bare_text():
    config = _config(
        [
            "--set", "optimizer.lr=3e-4",
            "--set", "training.compile=true",
            "--set", "model.preset=125m",
            "--set", "logging.out=runs/x=y",
            "--set", 'data.dataset="quoted path"',
            "--set", "parallel.algorithm=ring",
            "--set", "model.family = gpt2",
            "--set", "model.preset=124m",
            "--set", "model.config=2024",
        ]
    )  # fmt: skip
    assert config.optimizer.lr == 3e-4 and config.training.compile is True
    assert config.logging.out == "runs/x=y" and config.data.dataset == "quoted path"
    assert config.parallel.algorithm == "ring" and config.model.family == "gpt2"
    assert config.model.config == "2024"  # a string key takes the text of what parses as a number
    assert _config(["--set", "model.preset=124m", "--model", "gpt2"]).model.preset == "124m"
    assert _config(["--set", "model.preset=1b"]).model.preset == "1b"


def test_load_config_takes_flags_as_typed_keys(tmp_path):
    path = _write(tmp_path, "[parallel]\ntp = 2\n")
    config = load_config(path, ["parallel.tp=4"], {"parallel.tp": 1, "optimizer.lr": 0.5})
    assert config.parallel.tp == 1 and config.optimizer.lr == 0.5


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[parallel]\ntp = 0\n", "train.toml: [parallel] tp: must be a positive int, got 0"),
        (
            '[training]\nprecision = "bf17"\n',
            "train.toml: [training] precision: must be one of auto, float32, bf16, fp16, got 'bf17'",
        ),
        ('[training]\nsteps = "ten"\n', "train.toml: [training] steps: must be a positive int, got 'ten'"),
        ("[training]\nsteps = 2.0\n", "train.toml: [training] steps: must be a positive int, got 2.0"),
        ("[training]\ncompile = 1\n", "train.toml: [training] compile: must be true or false, got 1"),
        ("[model]\npreset = 3\n", "train.toml: [model] preset: must be a string, got 3"),
        ("[parallel]\nzero = 4\n", "train.toml: [parallel] zero: must be one of 0, 1, 2, 3, got 4"),
        ("[optimizer]\nbeta2 = 1.0\n", "train.toml: [optimizer] beta2: must be a number in [0, 1), got 1.0"),
        ("[optimizer]\nlr = 0\n", "train.toml: [optimizer] lr: must be a number > 0, got 0.0"),
        ("[optimizer]\nlr = inf\n", "train.toml: [optimizer] lr: must be a finite number, got inf"),
        ("[checkpoint]\nevery = -1\n", "train.toml: [checkpoint] every: must be an int >= 0, got -1"),
        ('[lr_schedule]\nkind = "linear"\n', "train.toml: [lr_schedule] kind: must be one of constant, cosine, wsd"),
        ('[parallel]\nalgorithm = "fastest"\n', "train.toml: [parallel] algorithm: must be one of auto, native, "),
        ('[model]\npreset = "huge"\n', "train.toml: [model] preset: no preset 'huge' for llama; known: tiny, 125m"),
        ('[model]\nfamily = "gpt2"\npreset = "1b"\n', "train.toml: [model] preset: no preset '1b' for gpt2; known"),
        ('[model]\nconfig = "a.json"\nweights = "w"\n', "train.toml: [model] config: give model.config or model."),
        ("[training]\nbatch_size = 10\n[parallel]\ndp = 4\n", "train.toml: [training] batch_size: 10 sequences do"),
        (
            "[parallel]\npp = 2\nmicrobatches = 3\n",
            "train.toml: [parallel] microbatches: each accumulation step's 16 sequences (batch_size / dp / "
            "accumulation) do not split into 3 micro-batches",
        ),
        (
            '[parallel]\npp = 4\nschedule = "interleaved-1f1b"\nmicrobatches = 2\n',
            "train.toml: [parallel] microbatches: interleaved-1f1b takes micro-batches in groups of pp=4",
        ),
        (
            '[parallel]\npp = 2\nschedule = "interleaved-1f1b"\nmicrobatches = 4\nmicrobatch_group = 8\n',
            "train.toml: [parallel] microbatches: interleaved-1f1b takes micro-batches in groups of "
            "microbatch_group=8; 4 is not a multiple",
        ),
        (
            '[parallel]\npp = 2\nschedule = "interleaved-1f1b"\nmicrobatches = 4\nmicrobatch_group = 3\n',
            "train.toml: [parallel] microbatch_group: 3 is not a multiple of pp=2",
        ),
        (
            "[parallel]\npp = 2\nmicrobatches = 4\nmicrobatch_group = 4\n",
            "train.toml: [parallel] microbatch_group: groups interleaved-1f1b's micro-batches; schedule is 1f1b",
        ),
        (
            "[parallel]\nmicrobatch_group = 4\n",
            "train.toml: [parallel] microbatch_group: groups a pipeline's micro-batches; pp is 1",
        ),
        ("[parallel]\nmicrobatch_group = -1\n", "train.toml: [parallel] microbatch_group: must be an int >= 0, got -1"),
        (
            '[parallel]\ndp = 1\ndp_exchange = "copy-engine"\n',
            "train.toml: [parallel] dp_exchange: copy-engine does not run with dp = 1 (no gradient to average)",
        ),
        (
            '[parallel]\ndp = 1\npp = 2\nmicrobatches = 2\ndp_exchange = "copy-engine"\n',
            "train.toml: [parallel] dp_exchange: copy-engine does not run with dp = 1",
        ),
        (
            '[parallel]\ndp = 2\nzero = 1\ndp_exchange = "copy-engine"\n',
            "train.toml: [parallel] dp_exchange: copy-engine does not run with zero = 1 (ZeRO reduces its own shards)",
        ),
        (
            '[parallel]\ndp = 2\ndp_exchange = "copy-engine"\n[training]\ngrad_reduce_dtype = "bf16"\n',
            "train.toml: [parallel] dp_exchange: copy-engine does not run with grad_reduce_dtype = bf16",
        ),
        (
            '[parallel]\ndp_exchange = "nvlink"\n',
            "train.toml: [parallel] dp_exchange: must be one of collective, copy-engine, got 'nvlink'",
        ),
        (
            "[parallel]\ndp = 1\ndp_overlap_optimizer = true\n[optimizer]\ngrad_clip = 0\n",
            "train.toml: [parallel] dp_overlap_optimizer: does not run with dp = 1 (no gradient to average)",
        ),
        (
            "[parallel]\ndp = 2\npp = 2\nmicrobatches = 2\ndp_overlap_optimizer = true\n[optimizer]\ngrad_clip = 0\n",
            "train.toml: [parallel] dp_overlap_optimizer: does not run with pp > 1",
        ),
        (
            "[parallel]\ndp = 2\nzero = 1\ndp_overlap_optimizer = true\n[optimizer]\ngrad_clip = 0\n",
            "train.toml: [parallel] dp_overlap_optimizer: does not run with zero = 1 (ZeRO steps its own shards)",
        ),
        (
            "[parallel]\ndp = 2\ndp_overlap_optimizer = true\n",
            "train.toml: [parallel] dp_overlap_optimizer: does not run with optimizer.grad_clip > 0 (clipping needs",
        ),
        (
            "[parallel]\ndp = 2\ndp_overlap_optimizer = true\n[optimizer]\ngrad_clip = 0\n"
            '[training]\nprecision = "fp16"\n',
            "train.toml: [parallel] dp_overlap_optimizer: does not run with fp16 (its loss scale needs",
        ),
        (
            "[lr_schedule]\nwarmup_steps = 30\n",
            "train.toml: [lr_schedule] warmup_steps: must be at most training.steps (20), got 30",
        ),
        (
            '[lr_schedule]\nkind = "wsd"\nwarmup_steps = 5\ndecay_steps = 16\n',
            "train.toml: [lr_schedule] decay_steps: must be at most training.steps - warmup_steps (15), got 16",
        ),
        ("[training]\naccumulation = 3\n", "train.toml: [training] accumulation: each dp rank's 16 sequences"),
        (
            "[parallel]\npipeline_graphs = true\n",
            "train.toml: [parallel] pipeline_graphs: replays a pipeline's micro-batches; it needs pp > 1",
        ),
        (
            "[parallel]\npp = 2\ntp = 2\npipeline_graphs = true\n",
            "train.toml: [parallel] pipeline_graphs: does not run with tp > 1 (its collectives run inside each",
        ),
        (
            '[parallel]\npp = 2\npipeline_graphs = true\n[training]\nprecision = "fp16"\n',
            "train.toml: [parallel] pipeline_graphs: does not run with fp16 (its loss scale changes between steps)",
        ),
        (
            '[parallel]\npp = 2\npipeline_graphs = true\n[training]\nactivation_checkpointing = "full"\n',
            "train.toml: [parallel] pipeline_graphs: does not run with activation checkpointing",
        ),
        (
            "[parallel]\ntp = 2\nstep_graph = true\n",
            "train.toml: [parallel] step_graph: does not run with tp > 1 (its collectives run inside each forward)",
        ),
        (
            '[parallel]\npp = 2\nstep_graph = true\npipeline_transport = "group"\n',
            "train.toml: [parallel] step_graph: does not run with pipeline_transport = group (no peer",
        ),
        (
            "[parallel]\nzero = 2\nstep_graph = true\n",
            "train.toml: [parallel] step_graph: does not run with zero = 2 (its collectives run inside forward and",
        ),
        (
            '[parallel]\nstep_graph = true\n[training]\nprecision = "fp16"\n',
            "train.toml: [parallel] step_graph: does not run with fp16 (its loss scale changes between steps)",
        ),
        ('[logging]\nout = ""\n', "train.toml: [logging] out: must be a directory path"),
        (
            "[parallel]\ntpp = 2\n",
            "train.toml: [parallel] tpp: unknown key; keys of [parallel]: dp, pp, tp, schedule, microbatches, "
            "microbatch_group, pipeline_graphs, step_graph, pipeline_transport, dp_exchange, dp_overlap_optimizer, "
            "grad_accumulation_fusion, zero, zero_shard_size, algorithm, balance",
        ),
        ("[modle]\nfamily = 1\n", "train.toml: [modle]: unknown section; sections: model, data, parallel, optimizer"),
        ("steps = 20\n", "train.toml: steps: not a section; sections: model, data"),
        ("[training]\nsteps = = 2\n", "train.toml: not valid TOML: Invalid value (at line 2, column 9)"),
    ],
)
def test_a_bad_file_value_is_one_line_naming_the_file_and_key(tmp_path, text, expected):
    message = _error(load_config, _write(tmp_path, text))
    assert message.startswith(str(tmp_path / "train.toml")), message
    assert message.replace(str(tmp_path) + "/", "").startswith(expected), message


def test_microbatches_are_not_checked_without_a_pipeline():
    assert TrainConfig(parallel=ParallelSection(microbatches=3)).parallel.microbatches == 3


def test_a_preset_is_not_needed_with_a_config_or_weights():
    assert load_config(None, ["model.preset=none", "model.config=llama.json"]).model.config == "llama.json"
    assert load_config(None, ["model.preset=none", "model.weights=hf/llama"]).model.weights == "hf/llama"


def test_an_unreadable_file_is_one_line(tmp_path):
    assert _error(load_config, tmp_path / "missing.toml") == (
        f"{tmp_path}/missing.toml: cannot read the config file: No such file or directory"
    )
    (tmp_path / "bin.toml").write_bytes(b"[model]\xff\n")
    assert _error(load_config, tmp_path / "bin.toml").startswith(f"{tmp_path}/bin.toml: not UTF-8 text")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--set", "parallel.tp=0"], "--set parallel.tp: must be a positive int, got 0"),
        (["--set", "parallel.tp=two"], "--set parallel.tp: must be a positive int, got 'two'"),
        (["--set", "training.precision=bf17"], "--set training.precision: must be one of auto, float32, bf16, fp16"),
        (
            ["--set", "training.stepz=2"],
            "--set training.stepz: unknown key; keys of [training]: steps, batch_size, accumulation, seed, "
            "precision, grad_reduce_dtype, compile",
        ),
        (["--set", "train.steps=2"], "--set train.steps: unknown section [train]; sections: model, data, parallel"),
        (["--set", "steps=2"], "--set steps: expected section.key=VALUE"),
        (["--set", "training.steps"], "--set training.steps: expected section.key=VALUE"),
        (["--tp", "0"], "--tp: must be a positive int, got 0"),
        (["--lr", "-1"], "--lr: must be a number > 0, got -1.0"),
        (["--checkpoint-every", "-2"], "--checkpoint-every: must be an int >= 0, got -2"),
        (["--preset", "huge"], "--preset: no preset 'huge' for llama; known: tiny, 125m, 1b, 8b"),
        (["--algorithm", "bogus"], "--algorithm: must be one of auto, native, "),
        (["--dp", "3"], "[training] batch_size: 16 sequences do not split over dp=3 ranks"),
        (["--dp", "3", "--batch-size", "10"], "--batch-size: 10 sequences do not split over dp=3 ranks"),
        (["--tokenizer-vocab", "10"], "--tokenizer-vocab: must be an int in [257, 16777216], got 10"),
        (["--tokenizer-vocab", str(2**25)], "--tokenizer-vocab: must be an int in [257, 16777216], got 33554432"),
    ],
)
def test_a_bad_set_or_flag_is_one_line_naming_it(argv, expected):
    assert _error(_config, argv).startswith(expected)


def test_an_error_names_the_layer_the_value_came_from(tmp_path):
    path = _write(tmp_path, "[parallel]\ntp = 0\n")
    assert _error(_config, ["--config", str(path)]).startswith(f"{path}: [parallel] tp:")
    assert _error(_config, ["--config", str(path), "--set", "parallel.tp=-1"]).startswith("--set parallel.tp:")
    assert _error(_config, ["--config", str(path), "--set", "parallel.tp=-1", "--tp", "-2"]).startswith("--tp:")
    assert _config(["--config", str(path), "--tp", "2"]).parallel.tp == 2  # a later layer mends it


def test_a_config_made_in_python_names_the_section_and_key():
    assert _error(TrainingSection, precision="bf17") == (
        "[training] precision: must be one of auto, float32, bf16, fp16, got 'bf17'"
    )
    assert _error(TrainConfig.from_dict, {"parallel": {"tp": 0}}) == "[parallel] tp: must be a positive int, got 0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().parallel.dp = 2


def test_the_command_prints_a_config_error_on_one_line(tmp_path, capsys):
    from dtrain.cli.main import main

    assert main(["train", "--config", str(_write(tmp_path, "[parallel]\ntp = 0\n"))]) == 2
    out = capsys.readouterr().err
    assert out == f"dtrain: error: {tmp_path}/train.toml: [parallel] tp: must be a positive int, got 0\n"


# ----------------------------------------------------------------------------------------------------- flags


def test_every_key_has_one_flag_listed_by_help(capsys):
    parser = _train_parser()
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    assert set(by_dest) == {"help", "nproc", "config_file", "config_sets", *(key for key, _ in keys())}
    for key, _ in keys():
        action = by_dest[key]
        assert flag_name(key) in action.option_strings and action.default is argparse.SUPPRESS, key
        assert action.help and "(default: " in action.help, key
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    flags = set(re.findall(r"(--[a-z0-9-]+)", text))
    wanted = {flag_name(key) for key, _ in keys()} | {"--config", "--set", "--nproc"}
    wanted |= {"--no-" + flag_name(key)[2:] for key, f in keys() if f.type in ("bool", bool)}
    assert wanted <= flags, wanted - flags
    assert all(f"[{section}]:" in text for section in SECTIONS)


def test_the_named_flags():
    expected = {
        "checkpoint.every": "--checkpoint-every",
        "lr_schedule.kind": "--lr-schedule",
        "model.config": "--model-config",
        "model.weights": "--weights",
        "model.family": "--model",
        "logging.out": "--out",
        "checkpoint.resume": "--resume",
        "training.batch_size": "--batch-size",
        "parallel.dp": "--dp",
        "optimizer.lr": "--lr",
    }
    assert {key: flag_name(key) for key in expected} == expected
    flags = [flag_name(key) for key, _ in keys()]
    assert len(flags) == len(set(flags))


def test_choices_are_enforced_by_the_parser_and_a_bare_parser_works():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--zero", "2", "--precision", "fp16", "--lr-schedule", "wsd"])
    config = from_arguments(args)
    assert (config.parallel.zero, config.training.precision, config.lr_schedule.kind) == (2, "fp16", "wsd")
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "bf17"])


def test_the_preset_help_names_every_preset():
    help_text = next(f for key, f in keys() if key == "model.preset").metadata["help"]
    for family, names in PRESETS.items():
        assert f"{family} {', '.join(names)}" in help_text
