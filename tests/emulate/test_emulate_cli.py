"""``dtrain emulate``: its command line, and the clear refusal without root (no root needed to test)."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from dtrain.cli.emulate import parse_setting
from dtrain.cli.main import build_parser, main

RUN = ["emulate", "run", "--topology", "4-rack", "--set", "racks=2", "--set", "oversubscription=4", "--scale", "2e-3"]


def test_run_takes_the_dtrain_command_after_the_double_dash():
    args = build_parser().parse_args([*RUN, "--gpus-per-server", "2", "--", "bench", "comm", "--max-bytes", "4M"])
    assert args.command == ["--", "bench", "comm", "--max-bytes", "4M"]
    assert args.settings == [("racks", 2), ("oversubscription", 4)]
    assert (args.scale, args.gpus_per_server, args.placement) == (2e-3, 2, "packed")


def test_the_fabric_is_bridged_unless_routed_is_asked_for():
    assert build_parser().parse_args([*RUN, "--", "bench", "comm"]).fabric == "bridged"
    up = build_parser().parse_args(["emulate", "up", "--topology", "4-rack", "--fabric", "routed"])
    assert up.fabric == "routed"


def test_an_unknown_fabric_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*RUN, "--fabric", "ecmp", "--", "bench", "comm"])
    assert "invalid choice: 'ecmp'" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "pair"), [("racks=2", ("racks", 2)), ("scale=0.5", ("scale", 0.5)),
                                            ("nic=ethernet100", ("nic", "ethernet100"))])  # fmt: skip
def test_settings_become_numbers_where_they_are_numbers(text, pair):
    assert parse_setting(text) == pair


def test_a_setting_without_equals_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        parse_setting("racks")


@pytest.fixture
def not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)


@pytest.mark.parametrize(
    "argv",
    [
        [*RUN, "--", "bench", "comm"],
        ["emulate", "up", "--topology", "4-rack", "--set", "racks=2"],
        ["emulate", "down"],
    ],
)
def test_without_root_it_says_so_and_exits_2(not_root, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "uid 1000" in err


def test_without_iproute2_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("shutil.which", lambda tool: None)
    assert main(["emulate", "down"]) == 2
    assert "needs iproute2" in capsys.readouterr().err


def test_a_bad_placement_is_an_error_before_anything_is_built(capsys):
    assert main([*RUN, "--placement", "s0,s9", "--", "bench", "comm"]) == 2
    assert "placement must be" in capsys.readouterr().err


def test_a_run_without_a_command_is_an_error(capsys):
    assert main([*RUN]) == 2
    assert "no dtrain command" in capsys.readouterr().err


@pytest.mark.parametrize("words", [["--nproc", "4"], ["--nproc=4"], ["--npr", "4"]])
def test_a_commands_nproc_is_refused_for_gpus_per_server(capsys, words):
    assert main([*RUN, "--", "bench", "comm", *words]) == 2
    assert "--gpus-per-server" in capsys.readouterr().err


def test_a_rack_hierarchy_needs_racks_kept_together(capsys):
    assert main([*RUN, "--placement", "interleaved", "--hierarchy", "rack", "--", "bench", "comm"]) == 2
    assert "rack-level hierarchy" in capsys.readouterr().err


@pytest.mark.parametrize("tag", ["", "a-b", "dte-x"])
def test_down_with_a_tag_no_emulation_can_have_is_refused_and_removes_nothing(monkeypatch, capsys, tag):
    removed = []
    monkeypatch.setattr("dtrain.emulate.build.teardown_leftovers", lambda prefix="dte-": removed.append(prefix) or [])
    assert main(["emulate", "down", "--tag", tag]) == 2
    assert "--tag must be 1-8 letters or digits" in capsys.readouterr().err
    assert removed == []


class _Signalled(BaseException):
    """SIGTERM that reached the handler the test set, not the command's (the test process must survive it)."""


def _signalled(signum, frame):
    raise _Signalled()


def test_sigterm_while_the_plan_is_made_ends_in_one_line_and_its_status(monkeypatch, capsys):
    def planning(args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr("dtrain.cli.emulate._plan", planning)
    previous = signal.signal(signal.SIGTERM, _signalled)
    try:
        assert main([*RUN, "--", "bench", "comm"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is _signalled  # given back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "stopped by signal 15" in capsys.readouterr().err
