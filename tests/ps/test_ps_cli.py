"""``dtrain ps`` end to end: roles as processes, a fault injected, metrics as JSON lines; bad flags refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.cli.main import main


def test_dtrain_ps_trains_through_a_server_kill_and_writes_json_lines(tmp_path, capsys):
    status = main(["ps", "--model", "synthetic", "--mode", "async", "--steps", "40", "--servers", "2",
                   "--replicas", "2", "--fault", "1:10", "--compute-s", "0.01", "--dead-after-s", "0.5",
                   "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert status == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps, summary = [x for x in lines if "step" in x], lines[-1]
    assert len(steps) == 2 * 40 and summary["summary"]
    assert [e["dead"] for e in summary["failovers"]] == [[1]]
    assert summary["lost_acknowledged_updates"] == 0 and summary["recovery_s"] > 0
    assert "training went on after" in capsys.readouterr().out


def test_dtrain_ps_refuses_a_straggler_that_does_not_exist(capsys):
    assert main(["ps", "--workers", "2", "--straggler", "5:2", "--no-progress"]) == 2
    assert "workers are 0..1" in capsys.readouterr().err


def _refused(monkeypatch, capsys, argv: list[str]) -> str:
    """Run ``dtrain ps argv``, which must be refused (exit 2) before any role process starts; its output."""
    from dtrain.ps.launch import LocalCluster

    def no_start(self):
        raise AssertionError("a process was started for a refused command line")

    monkeypatch.setattr(LocalCluster, "start", no_start)
    assert main(["ps", *argv, "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_fault_without_replication_is_refused_before_any_process_starts(monkeypatch, capsys):
    line = _refused(monkeypatch, capsys, ["--model", "mlp", "--servers", "2", "--fault", "1:5"])
    assert "--fault" in line and "--replicas" in line


def test_run_job_refuses_a_fault_without_replication_before_any_process_starts(monkeypatch, tmp_path):
    from dtrain.ps.config import JobConfig
    from dtrain.ps.launch import LocalCluster
    from dtrain.ps.run import Fault, run_job
    from dtrain.ps.train import TaskConfig

    monkeypatch.setattr(LocalCluster, "start", lambda self: pytest.fail("a process was started"))
    job = JobConfig(num_keys=64, width=4, num_servers=2, num_workers=1)
    with pytest.raises(ValueError, match="without replication"):
        run_job(job, TaskConfig(task="synthetic"), tmp_path, fault=Fault(server=1, step=5))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--mode", "quorum", "--workers", "2", "--quorum", "5"], "--quorum must be in [0, --workers=2], got 5"),
        (["--servers", "2", "--replicas", "3"], "--replicas=3 needs at least that many servers, got --servers=2"),
        (["--servers", "0"], "--servers must be a positive int, got 0"),
        (["--hot-keys", "8", "--servers", "2", "--hot-replicas", "2"], "--hot-keys needs --replicas=1 and "
                                                                          "--hot-replicas < --servers"),
        (["--hot-keys", "-1"], "--hot-keys must be an int >= 0"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--momentum", "-0.5"], "--momentum must be >= 0"),
        (["--staleness", "-1", "--mode", "ssp"], "--staleness must be an int >= 0"),
        (["--dead-after-s", "0"], "--dead-after-s must be > 0"),
        (["--model", "mlp", "--workers", "3", "--batch-size", "64"],
         "--batch-size 64 does not split evenly over --workers 3"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--fault", "2:1", "--replicas", "2"], "--fault names server 2; servers are 0..1"),
        (["--model", "ctr", "--width", "100000"], "above the 256 MiB a message may carry: use more --servers"),
        (["--compute-s", "nan"], "--compute-s must be a finite number of seconds >= 0, got nan"),
        (["--straggler", "0:nan"], "the slowdown factor must be a finite number >= 1"),
        (["--compute-s", "1e300"], "--compute-s must be a finite number of seconds >= 0, got 1e+300 (at most 86400)"),
        (["--straggler", "0:1e300"], "the slowdown factor must be a finite number >= 1 (at most 1000)"),
        (["--fault", "1:inf", "--replicas", "2"], "--fault 1:inf: the step must be a whole number in 0..49"),
        (["--fault", "1:nan", "--replicas", "2"], "--fault 1:nan: the step must be a whole number in 0..49"),
        (["--fault", "1:2.5", "--replicas", "2"], "--fault 1:2.5: the step must be a whole number in 0..49"),
        (["--hot-keys", "100000000000000000000", "--servers", "3"], "--hot-keys must be below 2**62"),
        (["--staleness", str(2**62), "--mode", "ssp"], "--staleness must be below 2**62"),
        (["--width", str(2**64)], "--width must be below 2**62"),
    ],
)  # fmt: skip
def test_bad_flags_are_named_as_the_user_typed_them(monkeypatch, capsys, argv, expected):
    line = _refused(monkeypatch, capsys, ["--model", "synthetic", *argv])
    assert expected in line, line
    assert "JobConfig" not in line and "num_" not in line and "_s" not in line.replace("--dead-after-s", "")


def test_ctrl_c_stops_every_process_and_exits_130_with_one_line(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    argv = [sys.executable, "-m", "dtrain", "ps", "--model", "synthetic", "--mode", "async", "--servers", "1",
            "--workers", "1", "--steps", "100000", "--compute-s", "0.01", "--out", str(tmp_path),
            "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log, deadline = tmp_path / "worker-0.jsonl", time.monotonic() + 90
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(children) == 3  # coordinator, server, worker
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err
    assert [line for line in err.splitlines() if line.strip()] == [
        "dtrain ps: interrupted; every process it started is stopped"
    ]
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived dtrain ps"


@pytest.mark.parametrize(
    "variables",
    [
        {"DTRAIN_PS_ROLE": "coordinator", "DTRAIN_PS_JOB": '{"num_keys": 8, "width": 2}'},
        {"DTRAIN_PS_ROLE": "server", "DTRAIN_PS_RANK": "0", "DTRAIN_PS_COORDINATOR": "tcp://127.0.0.1:1"},
        {"DTRAIN_PS_ROLE": "worker", "DTRAIN_PS_RANK": "0", "DTRAIN_PS_COORDINATOR": "tcp://127.0.0.1:1",
         "DTRAIN_PS_TASK": "{}"},
    ],
    ids=["coordinator", "server", "worker"],
)  # fmt: skip
def test_ctrl_c_ends_a_role_with_one_line_and_status_130(variables):
    """A role started by hand (``python -m dtrain.ps`` on a cluster node) and stopped with Ctrl-C: one line, no
    traceback; a server or worker is interrupted while it waits for its welcome, the coordinator while serving."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "DTRAIN_PS_SECRET": "00112233445566778899aabbccddeeff", **variables}
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.ps"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        time.sleep(3.0)  # imported and waiting (a server or worker waits 60 s for its welcome)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == ["dtrain.ps: interrupted"], err


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"DTRAIN_PS_ROLE": "coordinator", "DTRAIN_PS_JOB": "{bad"}, "DTRAIN_PS_JOB: not a valid configuration"),
        ({"DTRAIN_PS_ROLE": "coordinator", "DTRAIN_PS_JOB": '{"num_keys": 10}'}, "DTRAIN_PS_JOB: not a valid"),
        ({"DTRAIN_PS_ROLE": "coordinator", "DTRAIN_PS_JOB": "[1]"}, "a JSON list, not an object"),
        ({"DTRAIN_PS_ROLE": "worker", "DTRAIN_PS_RANK": "0", "DTRAIN_PS_COORDINATOR": "tcp://127.0.0.1:1",
          "DTRAIN_PS_TASK": '{"steps": "x"}'}, "DTRAIN_PS_TASK: not a valid configuration"),
    ],
)  # fmt: skip
def test_a_role_with_a_malformed_configuration_variable_exits_2_with_one_line(variables, expected):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "DTRAIN_PS_SECRET": "00112233445566778899aabbccddeeff", **variables}
    done = subprocess.run([sys.executable, "-m", "dtrain.ps"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert expected in done.stderr, done.stderr


GOOD_JOB = {"num_keys": 4, "width": 2, "num_servers": 1, "num_workers": 1, "mode": "async", "timeout_s": 0.5}


def _role_against_fakes(role: str, job: dict, server_answer: dict | None) -> subprocess.CompletedProcess:
    """Run ``python -m dtrain.ps`` as ``role`` against a fake coordinator, which welcomes it with ``job``, and a
    fake server, which answers every request with ``server_answer`` (or never, when None)."""
    import zmq

    from dtrain.ps import wire

    repo = Path(__file__).resolve().parents[2]
    secret = wire.local_secret()
    keys = (secret, wire.worker_key(secret))
    ctx = zmq.Context()
    try:
        coordinator, server = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        coordinator.bind("tcp://127.0.0.1:*")
        server.bind("tcp://127.0.0.1:*")
        env = {**os.environ, "PYTHONPATH": str(repo), "DTRAIN_PS_ROLE": role, "DTRAIN_PS_RANK": "0",
               "DTRAIN_PS_COORDINATOR": coordinator.getsockopt_string(zmq.LAST_ENDPOINT),
               "DTRAIN_PS_SECRET": (keys[1] if role == "worker" else secret).hex(),
               "DTRAIN_PS_TASK": json.dumps({"task": "synthetic", "steps": 1, "width": 2})}  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "dtrain.ps"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        layout = {"epoch": 0, "chains": [[0]], "endpoints": [server.getsockopt_string(zmq.LAST_ENDPOINT)]}
        deadline = time.monotonic() + 60
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                for sock in (coordinator, server):
                    if not sock.poll(10):
                        continue
                    ident, *frames = sock.recv_multipart()
                    msg = wire.decode(keys, frames)
                    if msg.op == "register":
                        welcome = {"op": "welcome", "role": role, "rank": 0, "config": job, "layout": layout}
                        sock.send_multipart([ident, *wire.encode(msg.key, welcome)])
                    elif sock is server and server_answer is not None:
                        answer = {"op": "reply", "req": msg.header["req"], **server_answer}
                        sock.send_multipart([ident, *wire.encode(msg.key, answer)])
            out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("role", "job", "server_answer", "expected"),
    [
        ("worker", {"num_keys": "x", "width": 2}, None,
         "worker 0: a malformed welcome from the coordinator at tcp://127.0.0.1:"),
        ("server", {**GOOD_JOB, "lr": "fast"}, None, "server 0: a malformed welcome from the coordinator at tcp://"),
        ("worker", GOOD_JOB, None, "worker 0: no answer from server 0 at tcp://127.0.0.1:"),
        ("worker", GOOD_JOB, {"status": "ok"}, "server 0 answered init of shard 0 with a malformed reply"),
        ("worker", GOOD_JOB, {"status": "error", "code": "bad_request", "error": "no"},
         "server 0 refused init of shard 0: no"),
    ],
    ids=["bad-job-to-worker", "bad-job-to-server", "silent-server", "malformed-reply", "refusal"],
)  # fmt: skip
def test_a_role_that_gets_a_malformed_or_no_answer_exits_1_with_one_line(role, job, server_answer, expected):
    done = _role_against_fakes(role, job, server_answer)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtrain.ps: error: "), lines
    assert expected in lines[0], lines[0]
