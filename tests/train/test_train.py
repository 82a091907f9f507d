"""``dtrain train``: real multi-rank runs of a tiny Llama through the command, resume, export, and bad input.

Each run is ``dtrain train`` on the default dataset (Python's help texts, a BPE tokenizer trained on them) with a
few steps, by this process's command line (:func:`dtrain.testing.command.train_in_process`: the launcher and ranks
of ``python -m dtrain train`` without a new interpreter); the Ctrl-C run and the bad input are subprocesses of
``python -m dtrain``, as is the run with a killed rank in tests/train/test_elastic.py, which also checks the
progress line. Runs that several tests read are module fixtures. The reference: one rank on the whole global batch
(for data and pipeline parallel).
"""

from __future__ import annotations

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
from dtrain.testing.command import train_in_process
from dtrain.train import loop
from dtrain.train.checkpoint import checkpoint_dir, load_model_state
from dtrain.train.config import from_arguments, load_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
# float32, a short sequence, constant learning rate after one warmup step: fast, and exact across layouts
BASE = ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--warmup-steps", "1", "--no-tensorboard"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _run(out: Path, *flags: str, export: bool = False) -> list[dict]:
    stdout = train_in_process(out, *BASE, *flags, "--export" if export else "--no-export")
    assert stdout.startswith("dtrain train: training llama (tiny)"), stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _fake_checkpoint(out: Path, step: int, world: int, config_flags: list[str]) -> None:
    """A checkpoint directory at ``step`` holding what the launching process reads for a run with
    ``config_flags``: meta.json, and DCP's files of a state of the step alone."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from dtrain.models import hf

    args = build_parser().parse_args(["train", "--out", str(out), *config_flags])
    config = from_arguments(args)
    plan = loop.check_run(config, world)
    directory = checkpoint_dir(out, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves in one process
        dcp.save({"step": step}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    meta = {"step": step, "model": hf.config_to_dict(plan.model), "seq_len": config.data.seq_len}
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would start."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(loop, "run_ranks", refuse)


def _final_params(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_model_state(checkpoint_dir(out, step))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("one-rank")
    return out, _run(out, "--nproc", "1", "--steps", str(STEPS), "--eval-every", "2", export=True)


@pytest.fixture(scope="module")
def two_ranks_dp(dp2_run) -> list[dict]:
    """The metrics of tests/train/conftest.py's run: 2 ranks at dp 2, with a plan's prediction recorded."""
    out, stdout = dp2_run
    assert stdout.startswith("dtrain train: training llama (tiny)"), stdout  # what starts is said first
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert json.loads((out / "plan_score.json").read_text()) == {k: v for k, v in records[-1].items() if "plan_" in k}
    return records


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_data_parallel_run_writes_finite_falling_losses_and_its_metrics(two_ranks_dp):
    assert [r["step"] for r in two_ranks_dp] == list(range(1, STEPS + 1))
    losses = _losses(two_ranks_dp)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    for r in two_ranks_dp:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["mfu"] is None and r["peak_memory_gib"] is None  # on CPUs neither is defined


def test_a_planned_run_records_the_prediction_beside_the_measurement(two_ranks_dp):
    assert all(r["plan_step_s"] == 0.25 for r in two_ranks_dp)
    last = two_ranks_dp[-1]
    assert last["plan_layout"] == "dp2 tp1 pp1" and last["plan_topology"] == "t" and last["plan_memory_gib"] == 2
    timed = sorted(r["step_s"] for r in two_ranks_dp[3:])  # the steps after the first three
    assert last["plan_measured_step_s"] == timed[len(timed) // 2] and last["plan_steps_timed"] == len(timed)
    assert last["plan_step_ratio"] == pytest.approx(last["plan_measured_step_s"] / 0.25)
    assert last["plan_measured_memory_gib"] is None and last["plan_memory_ratio"] is None  # no device memory on CPU
    assert not any("plan_measured_step_s" in r for r in two_ranks_dp[:-1])


def test_data_parallel_on_two_ranks_matches_one_rank_on_the_global_batch(two_ranks_dp, one_rank):
    assert _losses(two_ranks_dp) == pytest.approx(_losses(one_rank[1]), rel=1e-5)
    grad_norms = [r["grad_norm"] for r in two_ranks_dp]
    assert grad_norms == pytest.approx([r["grad_norm"] for r in one_rank[1]], rel=1e-4)


def test_pipeline_run_matches_one_rank_and_writes_a_chrome_trace_and_a_gantt_chart(tmp_path, one_rank):
    flags = ["--nproc", "2", "--pp", "2", "--microbatches", "2", "--steps", "2", "--schedule", "gpipe"]
    records = _run(tmp_path, *flags, "--pipeline-transport", "peer")  # the second step over peer channels
    assert _losses(records) == pytest.approx(_losses(one_rank[1][:2]), rel=1e-5)
    assert 0 <= records[-1]["bubble_measured"] < 1 and records[-1]["bubble_theory"] == pytest.approx(1 / 3)
    assert records[-1]["bubble_clock"] == "host"  # the CPU's
    events = json.loads((tmp_path / "pipeline-trace.json").read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert sorted(e["name"] for e in compute) == ["B0", "B0", "B1", "B1", "F0", "F0", "F1", "F1"]
    assert (tmp_path / "pipeline-gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gradients_averaged_through_peer_windows_match_one_rank(tmp_path, one_rank):
    records = _run(tmp_path, "--nproc", "2", "--dp", "2", "--steps", "3", "--dp-exchange", "copy-engine")
    assert _losses(records) == pytest.approx(_losses(one_rank[1][:3]), rel=1e-5)


def test_the_optimizer_stepped_inside_backward_matches_one_rank(tmp_path):
    """--dp-overlap-optimizer (with copy-engine buckets): the optimizer steps inside backward, beside the last
    bucket's exchange; without clipping, which it refuses, against one rank without clipping."""
    one = _run(tmp_path / "one", "--nproc", "1", "--steps", "3", "--grad-clip", "0")
    flags = ["--nproc", "2", "--dp", "2", "--steps", "3", "--grad-clip", "0", "--dp-exchange", "copy-engine"]
    records = _run(tmp_path / "two", *flags, "--dp-overlap-optimizer")
    assert _losses(records) == pytest.approx(_losses(one), rel=1e-5)


def test_interleaved_pipeline_in_larger_microbatch_groups_matches_one_rank(tmp_path, one_rank):
    flags = ["--nproc", "2", "--pp", "2", "--microbatches", "4", "--steps", "2", "--schedule", "interleaved-1f1b"]
    records = _run(tmp_path, *flags, "--microbatch-group", "4")
    assert _losses(records) == pytest.approx(_losses(one_rank[1][:2]), rel=1e-5)
    assert records[-1]["bubble_theory"] == pytest.approx(1 / 9)  # (p - 1) / (v m + p - 1), whatever the group


# the whole validation split at 250 tokens a sequence: 119 sequences, the last of 15 batches holding 7, which split
# neither over 2 replicas nor into a pipeline's pieces of 4; six steps at a high rate make the sequences' losses differ
WHOLE_VAL = ["--seq-len", "250", "--steps", "6", "--lr", "1e-2", "--eval-every", "6", "--set", "data.eval_batches=200"]


@pytest.fixture(scope="module")
def whole_val_one_rank(tmp_path_factory) -> float:
    (record,) = [r for r in _run(tmp_path_factory.mktemp("whole-val"), "--nproc", "1", *WHOLE_VAL) if "eval_loss" in r]
    return record["eval_loss"]


@pytest.mark.parametrize(
    "layout",
    [["--dp", "2"], ["--pp", "2", "--microbatches", "2", "--accumulation", "2"]],
    ids=["dp2", "pp2-accumulation2"],
)
def test_rows_that_do_not_split_evenly_are_evaluated_as_one_rank_does(tmp_path, whole_val_one_rank, layout):
    (record,) = [r for r in _run(tmp_path, "--nproc", "2", *layout, *WHOLE_VAL) if "eval_loss" in r]
    assert record["eval_loss"] == pytest.approx(whole_val_one_rank, rel=1e-5)


def test_evaluation_runs_at_its_interval_on_the_validation_split(one_rank):
    records = one_rank[1]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert all(math.isfinite(r["eval_loss"]) for r in records if "eval_loss" in r)


def test_the_exported_model_loads_with_the_trained_weights_and_generates(one_rank, capsys, tmp_path):
    from dtrain.data.loader import TokenDataset
    from dtrain.models import hf

    out, _ = one_rank
    model = hf.load_pretrained(out / "model")
    trained = _final_params(out, STEPS)
    loaded = model.state_dict()
    for name, tensor in trained.items():  # a tied weight once, under its first name
        assert torch.equal(loaded[name], tensor), name
    assert (out / "model" / "tokenizer.json").exists() and (out / "config.toml").exists()
    # the end-of-text id the documents were packed with, where generate (dtrain's, transformers') stops
    dataset = TokenDataset(json.loads((checkpoint_dir(out, STEPS) / "meta.json").read_text())["dataset"])
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["eos_token_id"] == dataset.eos_id, config
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0  # dtrain export writes the same
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config
    capsys.readouterr()
    status = main(["generate", "--model", str(out / "model"), "--prompt", "The for", "--max-new-tokens", "8"])
    printed = capsys.readouterr()
    assert status == 0 and printed.out.startswith("The for"), printed.out + printed.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc", "4", "--dp", "2"], "--dp/--pp/--tp: dp x pp x tp = 2 x 1 x 1 = 2, but --nproc starts 4 processes"),
        (["--nproc", "8", "--pp", "8"], "--pp: 8 stages of 1 chunk(s) need 8 layers, but the model has only 6"),
        (["--nproc", "4", "--tp", "4"], "--tp: num_key_value_heads=2 does not divide by tp=4"),
        (["--zero", "1"], "--zero: ZeRO stage 1 shards over the dp ranks, but dp is 1"),
        (["--precision", "fp16"], "--precision fp16: float16 training needs a CUDA device"),
        (["--nproc", "2", "--pp", "2", "--pipeline-graphs"], "pipeline_graphs: records CUDA graphs; the ranks would"),
        (["--nproc", "2", "--step-graph"], "step_graph: records CUDA graphs; the ranks would run on cpu"),
        (["--seq-len", "4096"], "--seq-len: 4096 is longer than the 256 positions"),
        (["--resume"], "no complete checkpoint"),
        (["--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "zb-h1"], "zero = 2, zero = 3 or"),
        (["--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "2"], "--zero 2: with --pp above 1 the tied embedding"),
        (["--nproc", "2", "--dp", "2", "--zero", "1", "--algorithm", "tree"], "runs all-gathers with it too"),
        (["--seed", str(2**64)], "--seed: must be an int in"),
        (["--weights", "/nonexistent/model"], "--weights: /nonexistent/model"),
        (["--dataset", "/nonexistent/data"], "--dataset: /nonexistent/data is not a prepared dataset"),
        (["--model-config", "/nonexistent/config.json"], "--model-config: /nonexistent/config.json: no such file"),
        (
            ["--model-config", "/nonexistent/config.json", "--preset", "1b"],
            "--preset: --model-config /nonexistent/config.json gives the model's shape; drop the preset",
        ),
        (
            ["--dataset", "/nonexistent/data", "--tokenizer-vocab", "600"],
            "--tokenizer-vocab: 600: trains a tokenizer for the default dataset, but --dataset /nonexistent/data was",
        ),
    ],
)
def test_bad_layouts_and_inputs_fail_before_any_rank_starts(tmp_path, capsys, no_ranks, flags, message):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    printed = capsys.readouterr()
    assert message in printed.err and printed.err.count("\n") == 1 and not printed.out, printed
    assert not (tmp_path / "run").exists() or flags == ["--resume"]


def test_flags_the_weights_would_override_are_refused(one_rank, tmp_path, capsys, no_ranks):
    """The exported model is a llama with its tokenizer.json: another family, or a tokenizer size, is refused."""
    weights = str(one_rank[0] / "model")
    for flags, message in (
        (["--model", "gpt2"], f"--model: gpt2, but --weights {weights} is a llama model"),
        (["--tokenizer-vocab", "600"], f"but the run takes the tokenizer of --weights {weights}; drop the flag"),
    ):
        assert main(["train", "--out", str(tmp_path / "run"), "--weights", weights, *flags]) == 2
        printed = capsys.readouterr()
        assert message in printed.err and printed.err.count("\n") == 1 and not printed.out, printed


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_refusal_under_torchrun_is_said_by_a_nodes_first_rank_alone(tmp_path, capsys, monkeypatch, local_rank):
    """Every rank of a torchrun job reads the same flags and files and refuses alike; the first of a node says it."""
    for name, value in (("RANK", local_rank), ("WORLD_SIZE", "2"), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("dtrain.env.QUIET_REFUSAL_WAIT_S", 0.0)
    for flags in (["--seed", str(2**64)], ["--seq-len", "4096"]):  # a flag's check, then the run's
        assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
        printed = capsys.readouterr()
        assert printed.err.count("dtrain: error: --s") == (local_rank == "0") and not printed.out, printed


def test_torchrun_prints_a_refusal_once(tmp_path):
    """Two ranks under torchrun refuse a flag alike (before torch is imported in them): one line in all."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "dtrain", "train", "--out", str(tmp_path / "run"), "--seed", str(2**64)]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert (done.stdout + done.stderr).count("dtrain: error: --seed: must be an int in") == 1, done.stderr


def test_a_model_config_with_a_smaller_vocabulary_than_the_tokenizer_is_refused(tmp_path, capsys, no_ranks):
    from dtrain.models import LlamaConfig, hf

    shape = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=64)  # fmt: skip
    hf.save_config(shape, tmp_path / "shape")
    assert main(["train", "--out", str(tmp_path / "run"), "--model-config", str(tmp_path / "shape")]) == 2
    printed = capsys.readouterr().err
    assert "the model's vocabulary of 100 is smaller than the tokenizer's 512" in printed, printed


def test_an_unknown_key_in_the_model_config_names_the_file_and_key(tmp_path, capsys, no_ranks):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_sizes": 8}))
    assert main(["train", "--out", str(tmp_path / "run"), "--model-config", str(tmp_path / "config.json")]) == 2
    printed = capsys.readouterr().err
    assert str(tmp_path / "config.json") in printed and "hidden_sizes" in printed and printed.count("\n") == 1


def test_resume_with_another_sequence_length_fails_before_any_rank_starts(tmp_path, capsys, no_ranks):
    _fake_checkpoint(tmp_path, 4, 4, ["--nproc", "4", "--dp", "2", "--pp", "2", "--microbatches", "2"])
    assert main(["train", "--out", str(tmp_path), "--steps", "8", "--resume", "--dp", "1", "--seq-len", "64"]) == 2
    printed = capsys.readouterr().err
    assert f"--seq-len: 64, but the checkpoint under {tmp_path}/checkpoints has 128" in printed
    assert printed.count("\n") == 1


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"tie_word_embeddings": False}, "tie_word_embeddings is true there, false here"),
        ({"vocab_size": 1024}, "vocab_size is 512 there, 1024 here"),
        ({"num_key_value_heads": 4}, "num_key_value_heads is 2 there, 4 here"),
    ],
)
def test_resume_of_another_model_names_the_key_that_differs(tmp_path, capsys, no_ranks, changes, said):
    from dtrain.models import hf, preset

    _fake_checkpoint(tmp_path, 4, 1, [])
    shape = hf.config_to_dict(preset("llama", "tiny")) | changes
    (tmp_path / "config.json").write_text(json.dumps(shape))
    config = str(tmp_path / "config.json")
    assert main(["train", "--out", str(tmp_path), "--steps", "8", "--resume", "--model-config", config]) == 2
    printed = capsys.readouterr().err
    assert f"another model than this run's (--model-config {config}): {said}" in printed, printed
    assert printed.count("\n") == 1


def test_resume_when_the_steps_are_done_says_so_without_starting_ranks(tmp_path, capsys, no_ranks):
    _fake_checkpoint(tmp_path, 4, 1, [])
    assert main(["train", "--out", str(tmp_path), "--steps", "4", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert (
        printed
        == f"dtrain train: nothing to do: the checkpoint under {tmp_path}/checkpoints is at step 4, --steps is 4\n"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags", [["--algorithm", "bogus"], ["--nproc", "0"], ["--out", "/proc/forbidden"]])
def test_the_command_prints_one_line_and_no_traceback_on_bad_input(flags):
    command = [sys.executable, "-m", "dtrain", "train", "--steps", "1", *flags]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stdout + done.stderr  # on stderr
    assert "Traceback" not in done.stderr and flags[0] in done.stderr


@pytest.mark.parametrize("algorithm", ["auto", "native", *registry.names(Collective.ALL_REDUCE)])
def test_the_launching_process_accepts_every_all_reduce_algorithm(tmp_path, algorithm):
    # every rank then pairs it with a broadcast algorithm for the initial parameters (tests/parallel/test_hybrid.py
    # trains with each); the command's own check must not refuse any of them
    args = build_parser().parse_args(["train", "--nproc", "2", "--dp", "2", "--algorithm", algorithm])
    config = load_config(flags={"parallel.dp": 2, "parallel.algorithm": algorithm, "logging.out": str(tmp_path)})
    assert vars(args)["parallel.algorithm"] == algorithm
    plan = loop.check_run(config, 2)
    assert (plan.world_size, plan.dims.dp) == (2, 2)


def test_ctrl_c_stops_the_ranks_and_exits_130_in_one_line(tmp_path):
    command = [sys.executable, "-m", "dtrain", "train", "--nproc", "2", "--dp", "2", *BASE]
    command += ["--steps", "1000000", "--out", str(tmp_path)]
    run = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, metrics = time.monotonic() + 120, tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first step's record is written: training is under way
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, stdout + stderr
    assert stderr.splitlines() == ["dtrain: interrupted (signal 2); the ranks were stopped"], stderr


def _fork_server(parent: int) -> int | None:
    """The pid of the workers' fork server ``parent`` started, once it exists (Linux's /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        if ppid == parent and b"multiprocessing.forkserver" in command:
            return int(entry.name)
    return None


def _imports_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped: its import of torch is under way or done."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the fork server through /proc")
@pytest.mark.parametrize("when", ["as it starts", "as it imports torch"])
def test_ctrl_c_while_the_workers_fork_server_starts_exits_130_in_one_line(tmp_path, when):
    # Ctrl-C reaches every process of the terminal's process group: the launching process and the fork server the
    # workers are to come from, here before the server has imported torch
    command = [sys.executable, "-m", "dtrain", "train", "--nproc", "2", "--dp", "2", *BASE]
    command += ["--steps", "1000000", "--out", str(tmp_path)]
    run = subprocess.Popen(
        command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline, server = time.monotonic() + 120, None
        while time.monotonic() < deadline and run.poll() is None:
            server = server or _fork_server(run.pid)
            if server is not None and (when == "as it starts" or _imports_torch(server)):
                break
            time.sleep(0.005)
        assert server is not None and run.poll() is None, "no fork server was started"
        os.killpg(run.pid, signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, stdout + stderr
    assert stderr.splitlines() == ["dtrain: interrupted (signal 2); the ranks were stopped"], stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_run_line_says_when_each_step_is_recorded_as_a_graph():
    from dtrain.models import preset
    from dtrain.parallel.grid import ParallelDims

    for recorded in (False, True):
        config = load_config(REPO / "configs" / "tiny-cpu.toml", flags={"parallel.step_graph": recorded})
        par = config.parallel
        dims = ParallelDims(world_size=par.dp * par.pp * par.tp, dp=par.dp, pp=par.pp, tp=par.tp)
        plan = loop.RunPlan(par.dp * par.pp, dims, preset("llama", "tiny"), "data", "tok.json", 0, 250)
        line = loop.describe(config, plan)
        assert line.startswith("training ") and ("each step a CUDA graph from the third" in line) == recorded, line
    flags = {"parallel.pp": 2, "parallel.schedule": "interleaved-1f1b", "parallel.microbatches": 4}
    config = load_config(REPO / "configs" / "tiny-cpu.toml", flags={**flags, "parallel.microbatch_group": 4})
    line = loop.describe(config, plan)
    assert "interleaved-1f1b x 4 micro-batches in groups of 4" in line, line
    config = load_config(
        REPO / "configs" / "tiny-cpu.toml", flags={"parallel.pp": 1, "parallel.dp_exchange": "copy-engine"}
    )
    assert "gradients averaged through copy engines" in loop.describe(config, plan)
    flags = {"parallel.pp": 1, "parallel.dp_overlap_optimizer": True, "optimizer.grad_clip": 0}
    config = load_config(REPO / "configs" / "tiny-cpu.toml", flags=flags)
    assert "the optimizer stepped inside backward" in loop.describe(config, plan)
    said = {}
    for fusion, extra in (("auto", {}), ("auto", {"parallel.step_graph": True}), ("on", {}), ("off", {})):
        flags = {"parallel.grad_accumulation_fusion": fusion, **extra}
        line = loop.describe(load_config(REPO / "configs" / "tiny-cpu.toml", flags=flags), plan)
        said[fusion, bool(extra)] = line.split("micro-batches")[1].split(":")[0]
    assert said == {
        ("auto", False): ", weight gradients accumulated inside their large products",
        ("auto", True): ", weight gradients accumulated inside their products, each step a CUDA graph from the third",
        ("on", False): ", weight gradients accumulated inside their products",
        ("off", False): "",
    }
