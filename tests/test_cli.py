"""The ``dtrain`` command: the checker table, argument errors, and a real two-rank benchmark."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from dtrain.cli.check import check_all
from dtrain.cli.main import main, parse_bytes
from dtrain.comm.cost.model import load_params
from dtrain.comm.cost.rules import load_rules

REPO = Path(__file__).resolve().parents[1]


def test_check_proves_every_algorithm_up_to_eight_ranks(capsys):
    assert main(["check", "--max-world", "8"]) == 0
    out = capsys.readouterr().out
    assert "ring" in out and "W=8" in out and "FAIL" not in out


def test_check_ends_with_a_summary_line(capsys):
    assert main(["check", "--max-world", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"dtrain check: \d+ checks passed, 0 failed", last), last


def test_check_table_keeps_its_headers_and_names_whole_on_a_narrow_console():
    console = Console(width=80, record=True, file=io.StringIO())
    assert check_all(8, console=console)
    text = console.export_text()
    assert "collective" in text and "algorithm" in text and "W=8" in text and "recursive_doubling" in text
    assert "…" not in text  # rich's ellipsis marks a cut cell


def test_check_with_pipelined_schedules(capsys):
    assert main(["check", "--max-world", "5", "--pipeline", "3"]) == 0


@pytest.mark.parametrize(("text", "nbytes"), [("4096", 4096), ("64K", 65536), ("1MiB", 1 << 20), ("1g", 1 << 30)])
def test_parse_bytes_reads_binary_units(text, nbytes):
    assert parse_bytes(text) == nbytes


def test_bench_rejects_an_unknown_collective_before_starting_ranks(capsys):
    assert main(["bench", "comm", "--collectives", "all_reduce,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_an_error_is_one_line_on_stderr_and_leaves_json_output_clean():
    command = [sys.executable, "-m", "dtrain", "calc", "transfer", "--bytes", "1TB", "--json"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == "dtrain: error: give --link KIND, --gbit-per-s or --gbyte-per-s\n", done.stderr


def test_bench_rejects_a_bad_size():
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--max-bytes", "lots"])


def _without_rank_variables(monkeypatch) -> None:
    """The command below starts its own ranks (real processes, spawned with this environment)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_bench_comm_runs_two_ranks_and_writes_json_lines_and_a_plot(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.jsonl"
    command = ["bench", "comm", "--nproc", "2", "--min-bytes", "4096"]
    command += ["--max-bytes", "4096", "--iters", "2", "--warmup", "1", "--out", str(out), "--rules-out"]
    command += ["--warm-s", "0.2"]  # the GPU warm-up, asked for on the CPU: ranks must stay in step through it
    _without_rank_variables(monkeypatch)
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setenv("DTRAIN_COMM_RULES", str(tmp_path / "rules.json"))
    assert main(command) == 0, capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"auto", "native", "ring"} <= {r["algorithm"] for r in records}
    for r in records:
        assert r["collective"] == "all_reduce" and r["world_size"] == 2 and r["nbytes"] == 4096
        assert 0 < r["host_us"] <= r["time_us"]  # issuing the calls is part of the timed loop
        assert r["time_us"] > 0 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 at n=2
        assert r["backend"] == "gloo" and r["torch_version"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the rules name the fastest path measured at the one size, native or ours, for auto to follow
    paths = {r["algorithm"]: r["time_us"] for r in records if r["algorithm"] != "auto"}
    made = load_rules("cpu", tmp_path / "rules.json")
    assert made.covers("cpu", 2, None) and made.pick("all_reduce", 4096) == min(paths, key=paths.get)


def test_bench_calibrate_saves_parameters_the_cost_model_loads(tmp_path, monkeypatch):
    out = tmp_path / "cal.json"
    _without_rank_variables(monkeypatch)
    assert main(["bench", "calibrate", "--nproc", "2", "--repeats", "2", "--out", str(out)]) == 0
    params = load_params(out)
    assert params.intra.beta_s_per_byte > 0
    assert json.loads(out.read_text())["meta"]["world_size"] == 2


def test_a_size_sweep_ends_at_its_largest_size():
    from dtrain.bench.comm import BenchConfig

    assert BenchConfig().sizes("cuda") == [8 << 10 << 2 * k for k in range(9)] + [1 << 30]  # 8 KiB .. 512 MiB, 1 GiB
    assert BenchConfig().sizes("cpu") == [1 << 10 << 2 * k for k in range(9)]  # 1 KiB .. 64 MiB in steps of 4
    assert BenchConfig(min_bytes=4096, max_bytes=4096).sizes("cpu") == [4096]


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"min_bytes": 0, "max_bytes": 1024}, "--min-bytes must be a whole number of bytes >= 1"),  # else no end
        ({"max_bytes": -1}, "--max-bytes must be"),
        ({"algorithms": ["butterfly", "ring"]}, "--algorithms ['butterfly'] run none of all_reduce"),
        ({"collectives": ["broadcast"], "algorithms": ["one_shot"]}, "run none of broadcast"),
    ],
)
def test_a_sweep_refuses_sizes_without_an_end_and_names_that_run_nothing(config, problem):
    from dtrain.bench.comm import BenchConfig

    with pytest.raises(ValueError, match=re.escape(problem)):
        BenchConfig(**config)
    assert BenchConfig(collectives=["all_reduce", "broadcast"], algorithms=["torch", "one_shot", "star@peer"])


DROPPED_CTRL_C = """
import signal, sys, weakref
from dtrain.interrupts import note_interrupts, raise_noted_interrupt
if sys.argv[1] == "noted":
    note_interrupts()
class Box: ...
box = Box()
ref = weakref.ref(box, lambda _: [signal.raise_signal(signal.SIGINT), sum(range(3))])
del box  # the SIGINT's KeyboardInterrupt is raised in the weakref callback, which Python prints and drops
ref = weakref.ref(Box(), lambda _: 1 / 0)  # another error a callback raises: printed as before
print("went on", flush=True)
raise_noted_interrupt()
"""


@pytest.mark.parametrize("mode", ["noted", "plain"])
def test_a_ctrl_c_that_python_drops_in_a_callback_still_stops_the_launch(mode):
    """A KeyboardInterrupt raised in a callback (importlib's module-lock weakrefs, as torch imports) is printed
    and dropped by Python; with the interrupts noted (``dtrain`` does so first), it is not printed and the launch
    raises it before any worker starts, where without they would go on. Other errors of callbacks print as before."""
    done = subprocess.run([sys.executable, "-c", DROPPED_CTRL_C, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stdout == "went on\n" and "ZeroDivisionError" in done.stderr, done.stderr
    if mode == "noted":
        assert done.returncode != 0 and done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr
        assert done.stderr.count("Exception ignored") == 1, done.stderr  # the division's, not the interrupt's
    else:
        assert done.returncode == 0 and done.stderr.count("Exception ignored") == 2, done.stderr


SECOND_CTRL_C = """
import os, signal, sys
from dtrain.cli import main as cli_main
def interrupted(args):
    raise KeyboardInterrupt
cli_main._run = interrupted
sys.argv = ["dtrain", "check"]
status = cli_main.main()
os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C as the command ends
sys.exit(status)
"""


def test_a_second_ctrl_c_as_the_interrupted_command_ends_changes_nothing():
    done = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert done.stderr == "dtrain: interrupted (signal 2); the ranks were stopped\n"


CTRL_C_IN_GENERATED_CODE = """
import sys
from dtrain.cli import main as cli_main
def interrupted(args):
    exec("raise KeyboardInterrupt")  # where a Ctrl-C lands in code made from text: a dataclass's __init__ as it is made
cli_main._run = interrupted
sys.argv = ["dtrain", "check"]
raise SystemExit(cli_main.main())
"""


def test_a_ctrl_c_in_code_made_from_text_still_exits_130_under_python_m(tmp_path):
    """``python -m`` ends the process by SIGINT, whatever status it returned, once a KeyboardInterrupt has left code
    Python compiled from text (exec, eval: the methods dataclasses and namedtuples make as torch imports)."""
    (tmp_path / "ctrl_c_module.py").write_text(CTRL_C_IN_GENERATED_CODE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "ctrl_c_module"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert done.stderr == "dtrain: interrupted (signal 2); the ranks were stopped\n"


@pytest.mark.parametrize("bad", ["nproc", "out"])
def test_the_command_line_is_built_and_bad_flags_refused_without_importing_torch(tmp_path, bad):
    """Flag checks stay fast: torch (seconds to import) waits for a command that runs. An --out under a file cannot
    be written, and is refused without anything made."""
    (tmp_path / "file").write_text("")
    flags = ["--nproc", "0"] if bad == "nproc" else ["--out", str(tmp_path / "file" / "run")]
    code = (
        f"import sys\nfrom dtrain.cli.main import main\nstatus = main(['train', *{flags!r}])\n"
        "sys.exit(status if 'torch' not in sys.modules else 99)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    said = {
        "nproc": "--nproc: must be a positive int, got 0",
        "out": f"--out {tmp_path}/file/run: cannot create or write the output directory (Not a directory)",
    }[bad]
    assert done.returncode == 2 and done.stderr == f"dtrain: error: {said}\n", done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bus_bandwidth_factors_are_nccl_tests_definitions():
    """nccl-tests' doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
    reduce-scatter and all-to-all, 1 for broadcast and reduce; gather and scatter move (n-1)/n of the buffer
    through the root."""
    from dtrain.bench.comm import BUS_FACTORS, bus_factor

    want = {4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "gather": 0.75,
                "scatter": 0.75, "broadcast": 1.0, "reduce": 1.0, "scan": 1.0},
            8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875,
                "gather": 0.875, "scatter": 0.875, "broadcast": 1.0, "reduce": 1.0, "scan": 1.0}}  # fmt: skip
    for world, factors in want.items():
        assert {c: bus_factor(c, world) for c in BUS_FACTORS} == factors


def test_bench_overlaps_default_is_every_collective_it_times_and_the_attention_backends_those_it_runs():
    from dtrain.bench.overlap import COLLECTIVES
    from dtrain.cli.main import build_parser

    args = build_parser().parse_args(["bench", "overlap"])
    assert tuple(args.collectives.split(",")) == COLLECTIVES
    from dtrain.bench.compute import ATTENTION_BACKENDS

    compute = build_parser()._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0]
    choices = next(a.choices for a in compute.choices["compute"]._actions if a.dest == "attention_backend")
    assert tuple(choices) == tuple(ATTENTION_BACKENDS)


def test_a_ctrl_c_wrapped_by_a_class_definition_still_exits_130_in_one_line(monkeypatch, capsys):
    """Python 3.11 turns a ``KeyboardInterrupt`` raised inside a class body's ``__set_name__`` (a dataclass field,
    as a module loads) into a ``RuntimeError`` raised from it; the command still ends as interrupted. Any other
    error is not taken for one."""
    from dtrain.cli import main as cli_main

    def interrupted_while_importing(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from exc

    monkeypatch.setattr(cli_main, "_run", interrupted_while_importing)
    assert main(["check"]) == 130
    assert capsys.readouterr().err == "dtrain: interrupted (signal 2); the ranks were stopped\n"

    def failed(args):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(cli_main, "_run", failed)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        main(["check"])
