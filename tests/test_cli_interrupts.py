"""A Ctrl-C as the ranks start, or as a command ends: the command's own line stays the last one printed."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_an_interrupted_launch_kills_and_reaps_the_workers_it_had_started(monkeypatch):
    """The agent loses the handles of the workers it had forked when a signal lands while it starts them; the launch
    kills those itself, before this process exits and unlinks the semaphores they would read."""
    import torch.distributed.launcher.api as launcher_api

    from dtrain import launch

    started = []

    def interrupted_launch(config, entrypoint):
        def call(*args):
            worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
            worker.start()
            started.append(worker)
            raise KeyboardInterrupt  # as the agent's SignalException, between two workers' starts

        return call

    monkeypatch.setattr(launch, "start_fork_server", lambda nproc: None)
    monkeypatch.setattr(launcher_api, "elastic_launch", interrupted_launch)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))  # not the launch's
    bystander.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch.run_ranks(print, 2)
        assert started and started[0].exitcode == -9  # killed (quietly) and reaped
        assert started[0] not in multiprocessing.active_children() and bystander.is_alive()
    finally:
        bystander.kill()
        bystander.join()


FORK_SERVER_CHILD = """
import sys
import dtrain.forkserver_exit  # the fork server's last preload: its children keep the excepthook it sets
from multiprocessing import synchronize

class Lock:
    pass

for state in [(0, 1, 1, "/dtrain-test-semaphore-that-is-gone"), None]:
    try:  # what the fork server's child does with an error as it reads the worker's arguments
        if state is None:
            open("/nonexistent/dtrain-test-file")
        synchronize.SemLock.__setstate__(Lock(), state)
    except Exception:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
"""


def test_a_worker_whose_launch_has_ended_leaves_without_a_traceback():
    """The launch's semaphores gone (the launching process ended on a Ctrl-C as the worker read its arguments):
    nothing printed. Any other error of the fork server's child is printed as before."""
    done = subprocess.run([sys.executable, "-c", FORK_SERVER_CHILD], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert "dtrain-test-file" in done.stderr and "dtrain-test-semaphore" not in done.stderr, done.stderr


CTRL_C_AS_IT_ENDS = """
import os, signal, sys
from dtrain.cli import main as cli_main
def done(args):
    print("done", flush=True)
    return 0
cli_main._run = done
sys.argv = ["dtrain", "check"]
status = cli_main.main()
os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C after the command has ended, in its teardown
sys.exit(status)
"""


def test_a_ctrl_c_after_a_command_ended_changes_neither_its_status_nor_its_output():
    done = subprocess.run([sys.executable, "-c", CTRL_C_AS_IT_ENDS], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")
