"""``dtrain.cli.cluster.register``: calc and topology, plus the simulator's commands when they are installed."""

from __future__ import annotations

import argparse
import io
import sys
import types

import pytest
from rich.console import Console
from rich.table import Table

from dtrain.cli import cluster
from dtrain.cli.main import main
from dtrain.cluster.report import print_table


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


def _header_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("┃")]


@pytest.mark.parametrize(
    ("argv", "headers"),
    [
        (["calc", "oversubscription", "--topology", "4-rack"], ["switch", "oversubscription", "sending"]),
        (["calc", "paths"], ["path", "copies", "protocol", "bottleneck", "time"]),
        (["calc", "links"], ["kind", "direction", "quoted", "source"]),
        (["calc", "allreduce", "--bytes", "1GB", "--ranks", "8", "--link", "ib-hdr"], ["algorithm", "closed"]),
        (["topology", "4-rack"], ["nodes", "links", "oversubscription"]),
        (["simulate", "ps", "--topology", "4-rack", "--dense-bytes", "20M"], ["replication", "utilisation"]),
    ],
)
def test_tables_keep_every_header_whole_in_80_columns(argv, headers, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = _header_lines(out)
    assert lines and not any("…" in line for line in lines), out
    for word in headers:
        assert any(word in line for line in lines), (word, out)
    assert max(len(line) for line in out.splitlines() if line[:1] in "┏┃┡│└") <= 80, out


def test_a_table_too_wide_for_the_terminal_gives_way_in_its_widest_columns_first():
    console = Console(width=50, file=io.StringIO())
    table = Table("name", "a long description", "utilisation")
    table.add_row("gpudirect-rdma", "words " * 12, "50.4%")
    print_table(console, table)
    out = console.file.getvalue()
    assert "gpudirect-rdma" in out and "utilisation" in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 50


GPU_PAIR = """
name = "pair"
[[node]]
name = "s0/gpu0"
kind = "gpu"
server = "s0"
device = "h100-sxm"{extra}
[[node]]
name = "s0/gpu1"
kind = "gpu"
server = "s0"
device = "h100-sxm"
[[link]]
a = "s0/gpu0"
b = "s0/gpu1"
kind = "nvlink4"
count = 18
"""
NO_GPU = """
[[node]]
name = "s0/cpu0"
kind = "cpu"
server = "s0"
[[node]]
name = "s0/nic0"
kind = "nic"
server = "s0"
[[link]]
a = "s0/cpu0"
b = "s0/nic0"
kind = "pcie4x16"
"""
_FILES = {
    "memory-zero": (GPU_PAIR.format(extra="\nmemory_bytes = 0").encode(),
                    "node[0].memory_bytes = 0: device memory must be a number of bytes >= 1"),
    "not-utf8": ('name = "caf\u00e9"\n[build]\npreset = "h100-node"\n'.encode("latin-1"), "not UTF-8 text"),
    "no-gpu": (NO_GPU.encode(), 'node: no GPU; a topology needs at least one [[node]] with kind = "gpu"'),
}  # fmt: skip
_COMMANDS = [
    ["topology", "{path}"],
    ["simulate", "collective", "--topology", "{path}", "--bytes", "1M"],
    ["simulate", "train", "--topology", "{path}", "--global-batch", "8"],
    ["simulate", "ps", "--topology", "{path}", "--dense-bytes", "1M"],
    ["plan", "--topology", "{path}", "--global-batch", "8"],
]


@pytest.mark.parametrize("case", sorted(_FILES))
@pytest.mark.parametrize("command", _COMMANDS, ids=["topology", "collective", "train", "ps", "plan"])
def test_a_bad_topology_file_is_one_line_naming_the_file_and_key(case, command, tmp_path, capsys):
    content, problem = _FILES[case]
    path = tmp_path / f"{case}.toml"
    path.write_bytes(content)
    assert main([part.format(path=path) for part in command]) == 2
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert said.startswith(f"dtrain: error: {path}: ") and problem in said
    assert said.count("\n") == 1 and "Traceback" not in said
