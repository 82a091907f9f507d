"""dtrain.env: every DTRAIN_* variable parsed and checked in one place, and documented."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from dtrain import env
from dtrain.env import CommEnv, EmulateEnv, EnvError, PsEnv

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def _variables_in_source() -> set[str]:
    """Every DTRAIN_* name written in the package's code (outside comments of env.py's own docs)."""
    names = set()
    for path in (ROOT / "dtrain").rglob("*.py"):
        names |= set(re.findall(r"\bDTRAIN_[A-Z_]*[A-Z]\b", path.read_text()))
    return names


def test_every_variable_is_documented():
    documented = set(re.findall(r"`(DTRAIN_[A-Z_]+)`", DOC.read_text()))
    assert set(env.ALL_VARIABLES) <= documented, set(env.ALL_VARIABLES) - documented
    assert _variables_in_source() <= documented, _variables_in_source() - documented


def test_every_variable_the_code_names_is_one_env_reads():
    assert _variables_in_source() <= set(env.ALL_VARIABLES)


def test_no_module_but_env_reads_a_dtrain_variable_from_the_environment():
    reads = re.compile(r"(environ|getenv)\b[^\n]*DTRAIN_|DTRAIN_[^\n]*\benviron\b")
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "dtrain").rglob("*.py")
        if path.name != "env.py" and reads.search(path.read_text())
    ]
    assert offenders == []


def test_the_job_configuration_keys_are_documented():
    from dataclasses import fields

    from dtrain.ps.config import JobConfig

    text = DOC.read_text()
    missing = [f.name for f in fields(JobConfig) if f"`{f.name}`" not in text]
    assert missing == [], f"JobConfig: {missing}"


def _train_rows() -> dict[str, dict[str, str]]:
    """The rows of each ``[section]`` table of the ``dtrain train`` part: {section: {`key`: row}}."""
    part = DOC.read_text().split("## `dtrain train`", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for chunk in part.split("### `[")[1:]:
        section = chunk.split("]", 1)[0]
        tables[section] = {line.split("|")[1].strip(): line for line in chunk.splitlines() if line.startswith("| `")}
    return tables


def test_every_train_key_is_documented_with_its_flag_and_default():
    from dtrain.train.config import SECTIONS, flag_name, keys

    tables = _train_rows()
    assert list(tables) == list(SECTIONS)
    for key, f in keys():
        section, name = key.split(".")
        row = tables[section].get(f"`{name}`", "")
        assert f"`{flag_name(key)}`" in row, f"{key}: its flag {flag_name(key)} is not in its row"
        default = ("true" if f.default else "false") if isinstance(f.default, bool) else f.default
        shown = f'"{default}"' if isinstance(default, str) and f.type in ("str", str) else str(default)
        assert f"`{shown}`" in row, f"{key}: its default {shown} is not in its row"
    documented = {(s, k.strip("`")) for s, rows in tables.items() for k in rows}
    assert documented == {tuple(key.split(".")) for key, _ in keys()}


def test_the_train_tables_are_the_generated_ones():
    from dtrain.train.config import markdown_reference

    assert markdown_reference() in DOC.read_text(), "regenerate with dtrain.train.config.markdown_reference()"


def test_defaults_when_nothing_is_set():
    assert CommEnv.from_env({}) == CommEnv()
    assert CommEnv.from_env({}).captures
    assert PsEnv.from_env({}) == PsEnv()
    assert EmulateEnv.from_env({}) == EmulateEnv()
    assert CommEnv.from_env({"DTRAIN_COMM_TRANSPORT": ""}).transport == "auto"  # empty counts as unset


def test_comm_values_parse():
    parsed = CommEnv.from_env(
        {
            "DTRAIN_COMM_TRANSPORT": "peer",
            "DTRAIN_COMM_PERSISTENT": "0",
            "DTRAIN_COMM_PEER_MODE": "push",
            "DTRAIN_COMM_PEER_WINDOW_BYTES": "64MiB",
            "DTRAIN_COMM_TIMEOUT": "2.5",
            "DTRAIN_COMM_RULES": "/tmp/rules.json",
            "DTRAIN_CALIBRATION": "/tmp/cal.json",
            "DTRAIN_COMM_LANES": "2",
            "DTRAIN_COMM_TRITON": "0",
        }
    )
    assert parsed == CommEnv(
        transport="peer",
        persistent="0",
        peer_mode="push",
        peer_window_bytes=64 << 20,
        timeout_s=2.5,
        rules=Path("/tmp/rules.json"),
        calibration=Path("/tmp/cal.json"),
        lanes=2,
        triton=False,
    )
    with pytest.raises(FrozenInstanceError):
        parsed.lanes = 3


def test_a_timeout_of_zero_is_off_and_a_timeout_turns_captures_off():
    assert CommEnv.from_env({"DTRAIN_COMM_TIMEOUT": "0"}).timeout_s is None
    assert not CommEnv.from_env({"DTRAIN_COMM_TIMEOUT": "1"}).captures


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("DTRAIN_COMM_TRANSPORT", "fast", "auto, p2p, peer or mpi"),
        ("DTRAIN_COMM_PERSISTENT", "yes", "0, 1 or auto"),
        ("DTRAIN_COMM_PEER_MODE", "sideways", "pull, push or auto"),
        ("DTRAIN_COMM_PEER_WINDOW_BYTES", "lots", "a size such as"),
        ("DTRAIN_COMM_TIMEOUT", "soon", "a number of seconds"),
        ("DTRAIN_COMM_TIMEOUT", "inf", "a number of seconds"),
        ("DTRAIN_COMM_LANES", "0", "a whole number of lanes >= 1"),
        ("DTRAIN_COMM_LANES", "two", "a whole number of lanes >= 1"),
        ("DTRAIN_COMM_TRITON", "off", "0 or 1"),
    ],
)
def test_a_bad_comm_value_is_one_line_naming_the_variable_the_value_and_what_is_accepted(name, value, accepted):
    with pytest.raises(EnvError) as caught:
        CommEnv.from_env({name: value})
    message = str(caught.value)
    assert name in message and repr(value) in message and accepted in message and "\n" not in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("variables", "match"),
    [
        ({"DTRAIN_PS_ROLE": "boss"}, "DTRAIN_PS_ROLE='boss' is not accepted; use coordinator, server or worker"),
        ({"DTRAIN_PS_RANK": "-1"}, "DTRAIN_PS_RANK='-1'"),
        ({"DTRAIN_PS_COORDINATOR": "10.0.0.1:9100"}, "tcp://HOST:PORT"),
        ({"DTRAIN_PS_SECRET": "zz" * 16}, "must be hex"),
        ({"DTRAIN_PS_SECRET": "ab" * 4}, "at least 16 bytes"),
        ({"DTRAIN_EMULATE_LOCAL_SIZE": "0"}, "DTRAIN_EMULATE_LOCAL_SIZE='0'"),
        ({"DTRAIN_EMULATE_NODE_RANK": "x"}, "DTRAIN_EMULATE_NODE_RANK='x'"),
    ],
)
def test_bad_ps_and_emulate_values(variables, match):
    cls = EmulateEnv if next(iter(variables)).startswith("DTRAIN_EMULATE") else PsEnv
    with pytest.raises(EnvError, match=re.escape(match)):
        cls.from_env(variables)


def test_the_secret_is_never_repeated_in_an_error():
    secret = "ab" * 8 + "zz"
    with pytest.raises(EnvError) as caught:
        PsEnv.from_env({"DTRAIN_PS_SECRET": secret})
    assert secret not in str(caught.value)


def test_a_role_asks_for_what_it_needs():
    ps = PsEnv.from_env({"DTRAIN_PS_ROLE": "server", "DTRAIN_PS_SECRET": "ab" * 16})
    assert ps.need("role") == "server" and ps.need("secret") == bytes.fromhex("ab" * 16)
    with pytest.raises(EnvError, match="DTRAIN_PS_RANK is not set"):
        ps.need("rank")


def test_comm_env_follows_the_environment(monkeypatch):
    monkeypatch.setenv("DTRAIN_COMM_LANES", "3")
    assert env.comm_env().lanes == 3
    monkeypatch.setenv("DTRAIN_COMM_LANES", "4")
    assert env.comm_env().lanes == 4
    monkeypatch.delenv("DTRAIN_COMM_LANES")
    assert env.comm_env().lanes == 1


def test_the_cli_stops_on_a_bad_variable_with_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "dtrain", "check", "--max-world", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DTRAIN_COMM_TRANSPORT": "fast"},
    )
    assert run.returncode != 0
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert lines == [
        "dtrain: error: DTRAIN_COMM_TRANSPORT='fast' is not accepted; use auto, p2p, peer or mpi (default auto)"
    ]


def test_a_parameter_server_process_stops_on_a_bad_variable_with_one_line():
    run = subprocess.run(
        [sys.executable, "-m", "dtrain.ps"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DTRAIN_PS_ROLE": "boss"},
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "dtrain.ps: error: DTRAIN_PS_ROLE='boss' is not accepted; use coordinator, server or worker"
    ]


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("", (None, False, 0.0)),
        ("1:3", ((1, 3), False, 0.0)),
        ("1:2:node", ((1, 2), True, 0.0)),
        ("1:3:+2", ((1, 3), False, 2.0)),
        ("0:5:node:+0.5", ((0, 5), True, 0.5)),
    ],
)
def test_the_fault_injection_variable_parses(value, parsed):
    environ = {env.KILL_AT: value}
    assert (env.kill_at(environ), env.kill_node(environ), env.kill_delay(environ)) == parsed


@pytest.mark.parametrize("value", ["1", "1:", "a:3", "1:3:", "1:3:rack", "1:3:+0", "1:3:+x", "1:3:+inf", "1:3:+1:+2"])
def test_a_bad_fault_injection_value_names_the_variable(value):
    with pytest.raises(env.EnvError, match=rf"^{env.KILL_AT}='{re.escape(value)}': must be RANK:STEP"):
        env.kill_at({env.KILL_AT: value})
