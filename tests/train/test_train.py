"""``dtrain train``: the models and data, real multi-rank runs through the command, resume, and bad layouts.

Each run is a subprocess of ``python -m dtrain train`` with the debug preset and a few steps; runs that several
tests read are module fixtures. The references: one rank on the whole global batch (for data and pipeline
parallel), one uninterrupted run (for resume).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtrain.cli.main import build_parser, main
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.train import loop
from dtrain.train.checkpoint import checkpoint_path, save_checkpoint
from dtrain.train.config import TrainConfig, flag_name
from dtrain.train.data import CharTokenizer, ClassificationBatches, TextBatches, load_corpus
from dtrain.train.models import GPTConfig, build_model, model_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _run(out: Path, *flags: str) -> list[dict]:
    command = [sys.executable, "-m", "dtrain", "train", "--out", str(out), "--batch-size", "8", *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # what starts is said first, and the bar is the training's
    assert done.stdout.startswith("dtrain train: training "), done.stdout
    assert "train: step" in done.stdout and "bench" not in done.stdout, done.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _fake_checkpoint(out: Path, step: int, world: int, **layout) -> None:
    """Checkpoint files of ``world`` ranks at ``step`` that hold only the step and the layout (all the launching
    process reads)."""
    full = {"model": "gpt", "preset": "debug", "dp": 1, "pp": 1, "tp": 1, "seed": 0, "batch_size": 16, **layout}
    for rank in range(world):
        save_checkpoint(checkpoint_path(out, step, rank), {"step": step, "layout": full})


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would start."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(loop, "run_ranks", refuse)


def _final_params(out: Path, step: int) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / f"step-{step:08d}" / "rank-00000.pt"
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("one-rank")
    return out, _run(out, "--nproc", "1", "--steps", str(STEPS))


@pytest.fixture(scope="module")
def two_ranks_dp(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp2")
    return _run(out, "--nproc", "2", "--dp", "2", "--steps", str(STEPS))


def test_gpt_maps_token_ids_to_logits_over_the_vocabulary():
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert model(torch.randint(0, 50, (3, 16))).shape == (3, 16, 50)
    assert len(model) == 4  # embedding, 2 blocks, head: stages can cut between any of them


def test_gpt_attention_is_causal():
    torch.manual_seed(0)
    model = build_model("gpt", config=model_config("gpt", vocab_size=30)).eval()
    x = torch.randint(0, 30, (1, 12))
    changed = x.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 30
    torch.testing.assert_close(model(x)[:, :8], model(changed)[:, :8])


def test_model_configs_reject_bad_shapes():
    with pytest.raises(ValueError, match="n_embd=30 is not a multiple of n_head=4"):
        GPTConfig(vocab_size=10, n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet")


def test_mlp_classifier_maps_features_to_class_logits():
    x, labels = ClassificationBatches(in_features=32, num_classes=8, batch_size=5, seed=0).batch(0)
    assert build_model("mlp", config=model_config("mlp"))(x).shape == (5, 8) and labels.shape == (5,)


def test_text_batches_are_next_token_windows_fixed_by_seed_and_step():
    text = load_corpus()
    assert len(text) > 300_000 and "for" in text
    data, tokenizer = TextBatches.from_corpus(batch_size=4, block_size=32, seed=7)
    x, y = data.batch(3)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(data.batch(3)[0], x) and not torch.equal(data.batch(4)[0], x)
    assert tokenizer.decode(tokenizer.encode("def f(): pass")) == "def f(): pass"


def test_tokenizer_vocabulary_round_trips_through_a_file(tmp_path):
    tokenizer = CharTokenizer.from_text("hello, world")
    tokenizer.save(tmp_path / "vocab.json")
    assert CharTokenizer.load(tmp_path / "vocab.json") == tokenizer


def test_data_parallel_run_writes_finite_falling_losses(two_ranks_dp):
    losses = [r["loss"] for r in two_ranks_dp]
    assert [r["step"] for r in two_ranks_dp] == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in two_ranks_dp)


def test_data_parallel_on_two_ranks_matches_one_rank_on_the_global_batch(two_ranks_dp, one_rank):
    reference = [r["loss"] for r in one_rank[1]]
    assert [r["loss"] for r in two_ranks_dp] == pytest.approx(reference, rel=1e-5)


def test_pipeline_run_writes_a_chrome_trace_and_a_gantt_chart(tmp_path, one_rank):
    records = _run(tmp_path, "--nproc", "2", "--pp", "2", "--microbatches", "2", "--steps", "2", "--schedule", "gpipe")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in one_rank[1][:2]], rel=1e-5)
    assert 0 <= records[-1]["bubble_measured"] < 1 and records[-1]["bubble_theory"] == pytest.approx(1 / 3)
    events = json.loads((tmp_path / "pipeline-trace.json").read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert sorted(e["name"] for e in compute) == ["B0", "B0", "B1", "B1", "F0", "F0", "F1", "F1"]
    assert {e["pid"] for e in compute} == {0, 1} and all(e["dur"] >= 0 for e in compute)
    assert (tmp_path / "pipeline-gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_from_a_checkpoint_continues_as_if_never_stopped(tmp_path, one_rank):
    reference_out, reference = one_rank
    _run(tmp_path, "--nproc", "1", "--steps", str(STEPS // 2))
    resumed = _run(tmp_path, "--nproc", "1", "--steps", str(STEPS), "--resume")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    expected = _final_params(reference_out, STEPS)
    for name, tensor in _final_params(tmp_path, STEPS).items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc", "4", "--dp", "2"], "must multiply to the world size"),
        (["--nproc", "2", "--dp", "2", "--batch-size", "15"], "batch size 15 is not divisible by dp=2"),
        (["--nproc", "2", "--pp", "2", "--microbatches", "3"], "not divisible by 3 micro-batches"),
        (["--nproc", "8", "--pp", "8"], "pp=8 stages but model 'gpt' (debug) has only 4 layers"),
        (["--nproc", "4", "--tp", "4"], "which does not divide by tp"),
        (["--resume"], "no complete checkpoint"),
        (
            [
                "--nproc",
                "2",
                "--pp",
                "2",
                "--microbatches",
                "3",
                "--batch-size",
                "18",
                "--schedule",
                "interleaved-1f1b",
            ],
            "is not a multiple",
        ),
        (["--nproc", "4", "--pp", "4", "--microbatches", "4", "--schedule", "interleaved-1f1b"], "has only 4 layers"),
    ],
)
def test_bad_layouts_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_the_command_exits_nonzero_on_a_bad_layout():
    command = [sys.executable, "-m", "dtrain", "train", "--nproc", "3", "--dp", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "dp x pp x tp" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--algorithm", "bogus"], "--algorithm: unknown all-reduce algorithm 'bogus'; known: auto, native"),
        (["--nproc", "0"], "--nproc: must be a positive int, got 0"),
        (["--steps", "0"], "--steps: must be a positive int, got 0"),
        (["--out", "/proc/forbidden/run"], "--out /proc/forbidden/run: cannot create or write the output directory"),
        (["--nproc", "4", "--dp", "2", "--pp", "2", "--algorithm", "hierarchical"], "--algorithm hierarchical: needs"),
    ],
)
def test_bad_options_name_their_flag_before_any_rank_starts(tmp_path, capsys, no_ranks, flags, message):
    out = ["--out", str(tmp_path / "run")] if "--out" not in flags else []
    assert main(["train", *out, *flags]) == 2
    printed = capsys.readouterr().out
    assert message in printed and printed.count("\n") == 1, printed
    assert "broadcast" not in printed


@pytest.mark.parametrize(
    ("written", "flags", "message"),
    [
        (
            {"dp": 2, "pp": 2},
            ["--nproc", "4", "--dp", "4"],
            "was written with dp=2 pp=2; this run has dp=4 pp=1",
        ),
        ({}, ["--model", "mlp"], "was written with model=gpt; this run has model=mlp"),
    ],
)
def test_resume_from_another_layout_or_model_fails_before_any_rank_starts(
    tmp_path, capsys, no_ranks, written, flags, message
):
    _fake_checkpoint(tmp_path, 4, 4 if written else 1, **written)
    assert main(["train", "--out", str(tmp_path), "--steps", "8", "--resume", *flags]) == 2
    printed = capsys.readouterr().out
    assert f"dtrain: error: --resume: the checkpoint under {tmp_path}/checkpoints {message}" in printed
    assert printed.count("\n") == 1


def test_resume_from_an_incomplete_checkpoint_of_another_layout_names_the_layout(tmp_path, capsys, no_ranks):
    _fake_checkpoint(tmp_path, 4, 2, dp=2)  # written by 2 ranks; 4 ranks find it incomplete
    assert main(["train", "--out", str(tmp_path), "--nproc", "4", "--dp", "4", "--resume"]) == 2
    assert "was written with dp=2; this run has dp=4" in capsys.readouterr().out


def test_resume_when_the_steps_are_done_says_so_without_starting_ranks(tmp_path, capsys, no_ranks):
    _fake_checkpoint(tmp_path, 4, 1)
    assert main(["train", "--out", str(tmp_path), "--steps", "4", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert (
        printed
        == f"dtrain train: nothing to do: the checkpoint under {tmp_path}/checkpoints is at step 4, --steps is 4\n"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "flags",
    [["--algorithm", "bogus"], ["--nproc", "0"], ["--out", "/proc/forbidden"]],
)
def test_the_command_prints_one_line_and_no_traceback_on_bad_input(flags):
    command = [sys.executable, "-m", "dtrain", "train", "--steps", "1", *flags]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert len((done.stdout + done.stderr).splitlines()) == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and flags[0] in done.stdout


def test_every_config_key_is_a_flag_with_its_default():
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {a.dest: a for a in train_parser._actions if a.option_strings}
    for f in dataclasses.fields(TrainConfig):
        assert flag_name(f.name) in flags[f.name].option_strings and flags[f.name].default == f.default, f.name
        assert flags[f.name].help, f.name
    assert set(flags) == {"help", "nproc", *(f.name for f in dataclasses.fields(TrainConfig))}
    args = build_parser().parse_args(["train", "--batch-size", "8", "--resume", "--weight-decay", "0.1"])
    assert args.batch_size == 8 and args.resume is True and args.weight_decay == 0.1 and args.nproc == 1


@pytest.mark.parametrize("algorithm", ["auto", "native", *registry.names(Collective.ALL_REDUCE)])
def test_the_launching_process_accepts_every_all_reduce_algorithm(tmp_path, algorithm):
    # every rank then pairs it with a broadcast algorithm for the initial parameters (tests/parallel/test_hybrid.py
    # trains with each); the command's own check must not refuse any of them
    args = build_parser().parse_args(["train", "--nproc", "2", "--dp", "2", "--algorithm", algorithm])
    config = dataclasses.replace(TrainConfig(), dp=2, algorithm=algorithm, out=str(tmp_path))
    assert args.algorithm == algorithm
    start = loop.check_run(config, 2)
    assert (start.world_size, start.dims.dp) == (2, 2)


def test_ctrl_c_stops_the_ranks_and_exits_130_in_one_line(tmp_path):
    command = [sys.executable, "-m", "dtrain", "train", "--nproc", "2", "--dp", "2", "--model", "mlp"]
    command += ["--steps", "1000000", "--out", str(tmp_path)]
    run = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # some steps in
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, stdout + stderr
    assert stderr.splitlines() == ["dtrain: interrupted (signal 2); the ranks were stopped"], stderr
