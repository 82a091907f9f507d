"""Training that survives a dead rank or a dead node: ``dtrain train`` under torch's elastic agent, a worker
killed with SIGKILL mid-run and the restart from the last complete checkpoint; two torchrun agents of a job of 1
to 2 nodes, one killed with its worker, and the survivor continuing alone at dp 1 from the resharded checkpoint;
the log line naming the dead peer, and bad input that is not retried. The heartbeat's bookkeeping runs on a fake
store; the rest runs real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from dtrain.comm.peer.watchdog import Heartbeat, Peer, process_ended
from dtrain.launch import KILL_ENV, run_ranks, worker_environment
from dtrain.testing.command import run_command, train_in_process
from dtrain.train.checkpoint import checkpoint_dir, complete_steps
from dtrain.train.config import load_config
from dtrain.train.loop import resize
from tests.jobs import elastic as jobs

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
MODEL = [
    *("--steps", str(STEPS), "--checkpoint-every", "2", "--seq-len", "32", "--batch-size", "8"),
    *("--precision", "float32", "--warmup-steps", "1", "--no-tensorboard", "--no-export"),
]
RUN = ["--nproc", "2", "--dp", "2", *MODEL, "--max-restarts", "2"]
# torchelastic's c10d rendezvous (seconds): a node that stops beating is dropped after keep_alive_interval x
# keep_alive_max_attempt, and a round of fewer than 2 nodes completes last_call_timeout after its first one. That
# wait covers the second agent's start on a loaded machine: a first round of one node, joined late by the other,
# runs without the kill this test makes and ends in a rendezvous timeout
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=30,close_timeout=1"


def _env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", KILL_ENV)}
    return base | {"PYTHONPATH": str(REPO)} | env


def _train(out: Path, *flags: str, **env: str) -> tuple[str, str]:
    """``python -m dtrain train --out OUT FLAGS``: its stdout and stderr, read once the process has ended (not
    when the workers' fork server, which holds them open too, has finished its own teardown)."""
    command = [sys.executable, "-m", "dtrain", "train", "--out", str(out), *(flags or RUN)]
    logs = out.parent / f"{out.name}.stdout", out.parent / f"{out.name}.stderr"
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        done = subprocess.run(command, cwd=REPO, env=_env(**env), stdout=stdout, stderr=stderr, timeout=300)
    printed = logs[0].read_text(), logs[1].read_text()
    assert done.returncode == 0, printed
    return printed


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(dp2_run) -> Path:
    """The run with nothing killed, ``RUN`` with a plan's prediction recorded (tests/train/conftest.py, shared with
    tests/train/test_train.py): its output directory (checkpoints at steps 2 and 4, metrics)."""
    out, _ = dp2_run
    assert [r["step"] for r in _metrics(out)] == list(range(1, STEPS + 1))
    assert complete_steps(out) == [STEPS, 2]
    return out


@pytest.fixture(scope="module")
def resumed_at_dp1(tmp_path_factory, uninterrupted) -> Path:
    """``--resume`` on one process (dp 1) from the dp 2 run's checkpoint of step 2: its output directory."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(checkpoint_dir(out, STEPS))
    train_in_process(out, "--nproc", "1", "--dp", "1", *MODEL, "--resume")
    return out


def test_killed_rank_restarts_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, uninterrupted):
    reference = _metrics(uninterrupted)
    # rank 1 dies 2 s into step 4, while rank 0 waits for it in the step's gradient collective. That collective
    # fails as the process ends, and rank 0 names the dead peer within milliseconds; the agent, looking at its
    # workers every 5 s, stops it first only if it looks within them. Checkpoints are written in the background
    # after every step, each completed by the next save: those of steps 1 and 2 are complete, step 3's is not
    # and the restart continues from step 2's. Once the job has saved its first, the directory also gets another
    # run's checkpoint of a later step, which is not this job's
    out, started = tmp_path / "killed", time.monotonic()

    def plant() -> None:
        while not checkpoint_dir(out, 1).exists() and time.monotonic() - started < 120:
            time.sleep(0.02)
        shutil.copytree(checkpoint_dir(uninterrupted, STEPS), checkpoint_dir(out, STEPS + 2))

    planter = threading.Thread(target=plant, daemon=True)
    planter.start()
    flags = [*RUN, "--checkpoint-every", "1", "--async-checkpoint", "--monitor-interval", "5"]
    stdout, stderr = _train(out, *flags, **{KILL_ENV: "1:3:+2"})
    planter.join(timeout=5)
    assert checkpoint_dir(out, STEPS + 2).exists()
    log = stdout + stderr
    # the survivor's failed collective names the dead peer, with its host and pid
    assert re.search(r"failed because rank 1 \(\S+:\d+\) is gone", log), log
    assert "restart 1: continuing from the checkpoint of step 2 on 2 process(es)" in log, log
    assert f"dtrain train: {STEPS - 2} steps, final loss" in stdout, stdout
    # what starts is said first, and the progress line is the training's (rank 0's, through the fork server)
    assert stdout.startswith("dtrain train: training llama (tiny)") and "train: step" in stdout, stdout
    metrics = _metrics(out)
    # one record a step (the dead attempt's step 3 was dropped and done again), the same numbers as without a kill
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in metrics] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in metrics] == [r["grad_norm"] for r in reference]


def test_a_run_that_does_not_resume_refuses_a_directory_with_an_earlier_runs_checkpoints(uninterrupted, capsys):
    """Started again in a directory whose checkpoints an earlier run left, a run would mix its own with them: it is
    refused in one line naming --out before any rank starts, and the directory is left as it was."""
    before = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    status, _ = run_command(["train", "--out", str(uninterrupted), *RUN])
    said = capsys.readouterr().err
    assert status == 2 and said.count("\n") == 1, said
    assert said.startswith(f"dtrain: error: --out {uninterrupted}: holds an earlier run's checkpoints (the last "
                           f"complete at step {STEPS}); --resume continues it"), said  # fmt: skip
    assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == before


def test_resume_at_another_layout_continues_as_if_never_stopped(uninterrupted, resumed_at_dp1):
    """``--resume`` at dp 1 from the dp 2 run's checkpoint of step 2: steps 3 and 4 as the dp 2 run had them."""
    resumed, reference = _metrics(resumed_at_dp1), _metrics(uninterrupted)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed[2:]] == pytest.approx([r["loss"] for r in reference[2:]], rel=1e-5)
    assert complete_steps(resumed_at_dp1) == [STEPS, 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_lost_node_shrinks_the_job_to_the_nodes_left(tmp_path, uninterrupted, resumed_at_dp1):
    """Two torchrun agents of one process each (``--nnodes 1:2``, dp 2, ``--elastic``); the worker of rank 1 kills
    its agent and itself as step 3 starts. The survivor's collective names the dead peer, its agent meets the
    rendezvous alone, and its restarted worker re-plans dp 1 and loads the checkpoint of step 2 written at dp 2:
    steps 1-2 as the dp 2 run's, steps 3-4 as the dp 1 run resumed from that checkpoint, exactly."""
    out, port = tmp_path / "shrunk", _free_port()
    agents = []
    for node, is_host in enumerate((1, 0)):  # the first agent holds the rendezvous store
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink"),
            *("--rdzv-conf", f"{RDZV_CONF},is_host={is_host}", "--local-addr", "127.0.0.1"),
            *("--max-restarts", "2", "--monitor-interval", "0.1"),
            *("-m", "dtrain", "train", "--out", str(out), "--elastic", "--dp", "2", *MODEL),
        ]
        log = open(tmp_path / f"agent{node}.log", "w")  # noqa: SIM115 (closed below)
        env = _env(**{KILL_ENV: "1:2:node", "OMP_NUM_THREADS": "1"})
        agents.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [agent.wait(timeout=120) for agent, _ in agents]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
            log.close()
    logs = [(tmp_path / f"agent{node}.log").read_text() for node in range(2)]
    assert sorted(codes) == [-9, 0], (codes, logs)
    survivor = codes.index(0)
    log = logs[survivor]
    assert re.search(r"failed because rank 1 \(\S+:\d+\) is gone", log), log
    assert "restart 1: continuing from the checkpoint of step 2 on 1 process(es), dp=1 x pp=1 x tp=1" in log, log
    assert f"dtrain train: {STEPS - 2} steps, final loss" in log, log
    metrics, before, after = _metrics(out), _metrics(uninterrupted), _metrics(resumed_at_dp1)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in metrics] == [r["loss"] for r in before[:2] + after[2:]]
    assert [r["grad_norm"] for r in metrics] == [r["grad_norm"] for r in before[:2] + after[2:]]
    assert complete_steps(out) == [STEPS, 2]


def test_bad_input_on_a_worker_is_raised_once_not_restarted(tmp_path):
    log = tmp_path / "attempts.txt"
    with pytest.raises(ValueError, match=r"^--thing: must be 1, got 2$"):
        run_ranks(jobs.bad_input_on_rank1, 2, str(log), max_restarts=3)
    attempts = {line.split()[1] for line in log.read_text().splitlines()}
    # rank 0's all-reduce fails as rank 1 ends; it finds the recorded bad input and ends with it, unrestarted
    assert attempts == {"0"}, log.read_text()


def test_a_rank_out_of_device_memory_ends_the_job_in_one_line_not_restarted(tmp_path):
    """Running out of device memory is not mended by a restart: the job ends with one line naming the rank and the
    allocator's message, as on bad input."""
    log = tmp_path / "attempts.txt"
    first = "CUDA out of memory. Tried to allocate 48.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which 3.10 GiB"
    first += " is free"  # CUDA's first three sentences
    with pytest.raises(ValueError) as raised:
        run_ranks(jobs.out_of_memory_on_rank1, 2, str(log), max_restarts=3)
    assert str(raised.value) == f"rank 1 ran out of device memory ({first})"
    assert {line.split()[1] for line in log.read_text().splitlines()} == {"0"}, log.read_text()


def test_a_rank_out_of_host_memory_ends_the_job_in_one_line_not_restarted(tmp_path):
    log = tmp_path / "attempts.txt"
    with pytest.raises(ValueError) as raised:
        run_ranks(jobs.out_of_memory_on_rank1, 2, str(log), True, max_restarts=3)
    said = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 281474976710656 bytes. Error code 12"
    assert str(raised.value) == f"rank 1 ran out of host memory ({said} (Cannot allocate memory))"
    assert {line.split()[1] for line in log.read_text().splitlines()} == {"0"}, log.read_text()


def test_dtrain_train_says_what_needs_less_memory(monkeypatch):
    import torch

    from dtrain.train import loop

    def runs_out(config, plan):
        raise torch.OutOfMemoryError(jobs.OUT_OF_MEMORY)

    monkeypatch.setattr(loop, "_train_rank", runs_out)
    with pytest.raises(ValueError, match=r"^a rank ran out of device memory \(CUDA out of memory\. Tried .*free\); "
                       r"a smaller --batch-size, more --accumulation .*need less$"):  # fmt: skip
        loop.train_rank(None, None)


def test_a_rank_that_fails_says_so_in_one_line_before_its_teardown(tmp_path):
    """An unexpected error is named, rank and first line, before the rank tears its group down (which can wait on
    a peer still in a collective with it, and the traceback only follows the teardown)."""
    stderr = tmp_path / "stderr"
    with pytest.raises(ChildFailedError):
        run_ranks(jobs.error_on_rank1, 2, str(stderr))
    said = (tmp_path / "stderr.1").read_text()
    line = "dtrain: rank 1 stopped: RuntimeError: the step's graph could not be recorded\n"
    assert said.startswith(line), said


def test_resize_keeps_tp_and_pp_and_takes_dp_from_the_world():
    config = load_config(sets=["parallel.dp=2", "parallel.pp=2", "elastic.resize=true", "training.batch_size=12"])
    assert resize(config, 6).parallel.dp == 3 and resize(config, 6).parallel.pp == 2
    assert resize(config, 4) is config
    with pytest.raises(ValueError, match=r"^--elastic: a world of 5 processes is not a multiple of pp x tp = 2 x 1$"):
        resize(config, 5)
    with pytest.raises(ValueError, match=r"^--elastic: at dp=5 \(10 processes\): .*batch_size.*dp=5"):
        resize(config, 10)
    fixed = load_config(sets=["parallel.dp=2"])
    assert resize(fixed, 3) is fixed  # without --elastic the layout is checked against the world as given


class _Store:
    """The c10d store calls the heartbeat makes, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + n
            return self.data[key]


def test_heartbeat_names_a_local_process_that_ended_and_a_peer_that_stopped_beating():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    store = _Store()
    alive = Heartbeat(store, 0, 3, interval=0.02)
    alive.start()
    try:
        # rank 1 ran here and ended; rank 2 registered on another host and never beats again
        store.set("dtrain/heartbeat/who/1", f"{alive.me.host}:{ended.pid}")
        store.set("dtrain/heartbeat/who/2", "elsewhere:4242")
        assert process_ended(ended.pid) and not process_ended(os.getpid())
        assert alive.gone() == [Peer(1, alive.me.host, ended.pid)]  # the local check answers at once
        store.set("dtrain/heartbeat/who/1", f"{alive.me.host}:{os.getpid()}")  # a live process that beats
        alive._peers.clear()
        stop = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                store.add("dtrain/heartbeat/beat/1", 1)
                time.sleep(0.005)

        beating = threading.Thread(target=beat)
        beating.start()
        try:
            assert alive.gone(wait=0.3) == [Peer(2, "elsewhere", 4242)]
        finally:
            stop.set()
            beating.join()
        line = alive.describe_failure(RuntimeError("Connection reset by peer\nmore"), wait=0.05)
        assert line is not None and "rank 1 (" in line and "rank 2 (elsewhere:4242)" in line
        assert "are gone" in line and line.endswith("RuntimeError: Connection reset by peer")
    finally:
        alive.stop()


def test_heartbeat_ring_watch_reports_the_next_rank_once_when_it_stops():
    store, lines = _Store(), []
    watcher = Heartbeat(store, 0, 2, interval=0.02, stale=1.0, report=lines.append)
    peer = Heartbeat(store, 1, 2, interval=0.02, stale=60)
    peer.start()
    watcher.start()
    try:
        time.sleep(0.2)
        assert lines == []  # rank 1 beats
        peer.stop()
        deadline = time.monotonic() + 15
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert len(lines) == 1 and lines[0].startswith(f"dtrain.comm heartbeat: {peer.me} has not beaten"), lines
    finally:
        watcher.stop()


def test_workers_run_in_the_launchers_environment_at_the_call_with_the_agents_variables_over_it(monkeypatch):
    """Workers fork from a fork server whose environment is the one it started in: a variable set after that, or
    one the launcher dropped, is as the launcher has it at the call; the agent's RANK, TORCHELASTIC_* stay."""
    launcher = {"A": "now", "RANK": "9", "OMP_NUM_THREADS": "1"}
    server = {
        "A": "then",
        "B": "gone",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RUN_ID": "r",
        "OMP_NUM_THREADS": "1",
    }
    want = {"A": "now", "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r", "OMP_NUM_THREADS": "1"}
    assert worker_environment(launcher, server) == want
    run_ranks(jobs.environment, 2, ["DTRAIN_TEST_MARK"])  # the fork server runs from here on
    monkeypatch.setenv("DTRAIN_TEST_MARK", "after the server started")
    seen = run_ranks(jobs.environment, 2, ["DTRAIN_TEST_MARK", "WORLD_SIZE"])
    assert seen == {"DTRAIN_TEST_MARK": "after the server started", "WORLD_SIZE": "2"}


def test_rendezvous_events_are_named_as_torch_names_them_without_reading_sources():
    import inspect

    from dtrain.launch import frame_name

    def torch_name(depth: int = 2) -> str:  # torch.distributed.elastic.rendezvous.dynamic_rendezvous's own
        return inspect.stack()[depth].function if len(inspect.stack()) > depth else "no_method_name"

    def caller(depth: int) -> tuple[str, str]:
        return frame_name(depth), torch_name(depth)

    def outer(depth: int) -> tuple[str, str]:
        return caller(depth)

    for depth in (1, 2, 3):
        ours, torchs = outer(depth)
        assert ours == torchs, depth
    assert outer(2) == ("outer", "outer")
    assert frame_name(100_000) == "no_method_name"
