"""``dtrain.cli.cluster.register``: calc and topology, plus the simulator's commands when they are installed."""

from __future__ import annotations

import argparse
import sys
import types

from dtrain.cli import cluster


def _commands():
    parser = argparse.ArgumentParser(prog="dtrain")
    return parser, parser.add_subparsers(dest="command", required=True)


def test_register_adds_calc_and_topology(monkeypatch):
    monkeypatch.setitem(sys.modules, "dtrain.cli.sim", None)  # as if the simulator's CLI were not installed
    parser, commands = _commands()
    cluster.register(commands)
    assert {"calc", "topology"} <= set(commands.choices)
    assert parser.parse_args(["calc", "links"]).handler is not None


def test_register_hands_the_commands_to_the_simulators_cli_when_present(monkeypatch):
    seen = []
    fake = types.ModuleType("dtrain.cli.sim")
    fake.register = lambda commands: seen.append(commands) or commands.add_parser("simulate")
    monkeypatch.setitem(sys.modules, "dtrain.cli.sim", fake)
    _, commands = _commands()
    cluster.register(commands)
    assert seen == [commands] and "simulate" in commands.choices
