"""Bad input to ``dtrain`` commands: one line naming the flag, key or file, exit status 2, no traceback, and nothing
written or started first. Each case ends before any rank starts (most before torch is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def _refused(capsys, argv: list[str]) -> str:
    """Run ``dtrain argv`` in this process; its one stderr line (argparse's own refusals exit through SystemExit)."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, (status, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "Infinity" not in out and "NaN" not in out, out
    return err


@pytest.fixture
def area(tmp_path):
    """A folder holding one regular file, ``file``, and one folder, ``dir``."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    return tmp_path


def _contents(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


UNTOUCHED = ["dir", "file"]


# -- output paths, checked before anything runs ---------------------------------------------------------------------


def test_check_file_out_refuses_a_folder_a_file_above_and_a_device(area):
    from dtrain.cli.paths import check_dir_out, check_file_out

    with pytest.raises(ValueError, match=r"^--out .*dir: is a directory"):
        check_file_out("--out", area / "dir")
    with pytest.raises(ValueError, match=r"^--out .*file/x/y.json: .*file is a file, not a directory"):
        check_file_out("--out", area / "file" / "x" / "y.json")
    with pytest.raises(ValueError, match=r"^--save /dev/null: not a regular file"):
        check_file_out("--save", "/dev/null")
    with pytest.raises(ValueError, match=r"^--out .*file: exists and is not a directory"):
        check_dir_out("--out", area / "file")
    check_file_out("--out", area / "new" / "deeper" / "x.json")  # made when written
    check_dir_out("--out", area / "new" / "run")
    assert _contents(area) == UNTOUCHED


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(area):
    from dtrain.cli.paths import atomic_path, write_atomic

    target = area / "dir" / "out.json"
    write_atomic(target, "old\n")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("failed while writing")
    assert target.read_text() == "old\n" and _contents(area / "dir") == ["out.json"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "comm", "--out", "{dir}"], "--out {dir}: is a directory"),
        (["bench", "comm", "--out", "{file}/x.jsonl"], "--out {file}/x.jsonl: {file} is a file"),
        (["bench", "comm", "--out", "{tmp}/new/x.jsonl", "--rules-out", "{file}/r.json"], "--rules-out {file}/r.json"),
        (["bench", "comm", "--out", "{tmp}/new/x.jsonl", "--rules-out", "{dir}"], "--rules-out {dir}: is a directory"),
        (["bench", "comm", "--out", "{tmp}/x"], "--out (its plot) {tmp}/x.png: is a directory"),
        (["bench", "calibrate", "--out", "{file}/c.json"], "--out {file}/c.json"),
        (["bench", "calibrate", "--rules", "--out", "{tmp}/r.json", "--records-out", "{file}/r.jsonl"],
         "--records-out {file}/r.jsonl"),
        (["bench", "calibrate", "--records-out", "{tmp}/r.jsonl"], "--records-out: needs --rules"),
    ],
)  # fmt: skip
def test_bench_comm_and_calibrate_refuse_outputs_they_cannot_write_before_any_rank_starts(area, capsys, argv, said):
    (area / "x.png").mkdir()
    names = {"dir": str(area / "dir"), "file": str(area / "file"), "tmp": str(area)}
    err = _refused(capsys, [word.format(**names) for word in argv])
    assert err.startswith("dtrain: error: ") and said.format(**names) in err, err
    assert _contents(area) == ["dir", "file", "x.png"]


def test_bench_comm_refuses_an_unwritable_out_in_a_fresh_process_without_importing_torch(area):
    code = (
        "import sys\nfrom dtrain.cli.main import main\n"
        f"status = main(['bench', 'comm', '--nproc', '2', '--out', {str(area / 'dir')!r}])\n"
        "sys.exit(status if 'torch' not in sys.modules else 99)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"dtrain: error: --out {area / 'dir'}: is a directory (give a file name)\n"


def test_bench_comm_over_mpi_outside_mpirun_is_refused_before_writing(area, capsys, monkeypatch):
    """A process mpirun did not start is an MPI world of one rank: nothing to measure between ranks."""
    from types import SimpleNamespace

    from dtrain.comm.mpi import group

    world = SimpleNamespace(COMM_WORLD=SimpleNamespace(Get_size=lambda: 1))
    monkeypatch.setattr(group, "mpi", lambda: world)
    out = area / "new" / "bench.jsonl"
    err = _refused(capsys, ["bench", "comm", "--transport", "mpi", "--out", str(out)])
    assert "--transport mpi" in err and "start it with mpirun" in err, err
    err = _refused(capsys, ["bench", "calibrate", "--rules", "--transport", "mpi", "--out", str(area / "r.json")])
    assert "--transport mpi" in err and "mpirun" in err, err
    assert _contents(area) == UNTOUCHED


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["ps", "--model", "synthetic", "--out", "{file}/ps"], "--out {file}/ps: {file} is a file"),
        (["ps", "--model", "synthetic", "--out", "{file}"], "--out {file}: exists and is not a directory"),
        (["export", "{tmp}/run", "--out", "{file}/e"], "--out {file}/e: {file} is a file"),
        (["bench", "pipeline", "--out", "{file}/p.jsonl"], "--out {file}/p.jsonl: {file} is a file"),
        (["bench", "pipeline", "--profile", "{file}"], "--profile {file}: exists and is not a directory"),
        (["plan", "--topology", "dgx-a100", "--config", "{tmp}/c.toml", "--write", "{dir}"], "--write {dir}: is a dir"),
        (["plan", "--topology", "dgx-a100", "--config", "{tmp}/c.toml", "--write", "{file}/c"], "--write {file}/c"),
        (["data", "prepare", "{file}", "--out", "{file}/d", "--train-tokenizer", "300"], "--out {file}/d: {file} is"),
    ],
)  # fmt: skip
def test_an_out_under_a_regular_file_names_the_flag_and_path(area, capsys, argv, said):
    names = {"dir": str(area / "dir"), "file": str(area / "file"), "tmp": str(area)}
    err = _refused(capsys, [word.format(**names) for word in argv])
    assert said.format(**names) in err and "Errno" not in err, err
    assert _contents(area) == UNTOUCHED


# -- numbers out of range -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["calc", "allreduce", "--bytes", "1e400", "--ranks", "4", "--link", "ib-hdr"], "--bytes"),
        (["calc", "allreduce", "--params", "1e400", "--ranks", "4", "--link", "ib-hdr"], "--params"),
        (["calc", "transfer", "--bytes", "1e400", "--link", "ib-hdr", "--json"], "--bytes"),
        (["calc", "transfer", "--bytes", "2e24", "--link", "ib-hdr", "--json"], "--bytes"),
        (["calc", "gradients", "--params", "1e20", "--bytes-per-param", "1e300", "--link", "ib-hdr"],
         "--bytes-per-param"),
        (["calc", "oversubscription", "--servers", "4", "--nics", "0", "--link", "ib-hdr", "--uplink-link", "ib-hdr"],
         "--nics"),
        (["bench", "comm", "--max-bytes", "99999999999G"], "--max-bytes"),
        (["check", "--pipeline", "0"], "--pipeline"),
        (["check", "--pipeline", "-1"], "--pipeline"),
        (["check", "--max-world", "100000"], "--max-world"),
        (["ps", "--model", "synthetic", "--lr", "inf"], "--lr"),
        (["ps", "--model", "synthetic", "--momentum", "inf"], "--momentum"),
        (["ps", "--model", "synthetic", "--dead-after-s", "inf"], "--dead-after-s"),
        (["ps", "--model", "synthetic", "--servers", "100000"], "--servers"),
        (["bench", "pipeline", "--batch", "0"], "--batch"),
        (["topology", "4-rack", "--set", "racks=100000"], "--set racks=100000"),
        (["simulate", "collective", "--topology", "dgx-a100", "--bytes", "1M", "--collective", "nosuch"],
         "--collective nosuch"),
        (["simulate", "collective", "--topology", "dgx-a100", "--bytes", "1M", "--placement", "nosuch"],
         "--placement nosuch"),
        (["simulate", "collective", "--topology", "dgx-a100", "--bytes", "1M", "--placement", "s0/gpu0"],
         "--placement s0/gpu0"),
        (["data", "prepare", "in", "--out", "o", "--train-tokenizer", "99999999999"], "--train-tokenizer"),
        (["data", "prepare", "in", "--out", "o", "--train-tokenizer", "100"], "--train-tokenizer"),
        (["data", "prepare", "in", "--out", "o", "--train-tokenizer", "300", "--seed", "-1"], "--seed"),
    ],
)  # fmt: skip
def test_a_value_out_of_range_names_its_flag(tmp_path, monkeypatch, capsys, argv, flag):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, argv)
    assert flag in err, err
    assert list(tmp_path.iterdir()) == []


def test_calc_json_never_prints_an_infinity(capsys):
    err = _refused(capsys, ["calc", "transfer", "--bytes", "1e12", "--gbit-per-s", "1e-320", "--json"])
    assert "seconds comes out as inf" in err, err
    assert main(["calc", "transfer", "--bytes", "1e24", "--link", "ib-hdr", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == 1e24


def test_sizes_and_counts_are_bounded():
    import argparse

    from dtrain.cli.units import MAX_BYTES, parse_bytes, parse_count, parse_quantity

    assert parse_bytes("1073741824G") == MAX_BYTES
    for parse, text in [(parse_bytes, "1073741825G"), (parse_quantity, "1e400"), (parse_count, "1e25"),
                        (parse_count, "2000000000000T")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match="above the largest"):
            parse(text)


# -- generate -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0 (0: greedy)"),
        (["--temperature", "inf"], "--temperature: must be a finite number >= 0 (0: greedy)"),
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0 (0: greedy)"),
        (["--seed", "99999999999999999999999"], "--seed: must be a whole number from 0 to 2**63 - 1"),
        (["--seed", "-1"], "--seed: must be a whole number from 0 to 2**63 - 1"),
    ],
)
def test_generate_refuses_flags_before_loading_the_model(tmp_path, capsys, flags, said):
    (tmp_path / "tokenizer.json").write_text("not read before the flags are checked")
    err = _refused(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi", *flags])
    assert err == f"dtrain generate: {said}, got {flags[1] if flags[0] == '--seed' else float(flags[1])}\n", err


def test_generate_names_the_weights_file_that_holds_nan(tmp_path, capsys):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dtrain.models.config import GPT2Config
    from dtrain.models.decoder import build
    from dtrain.models.hf import save_pretrained

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=260, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world"] * 4, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = build(config)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    save_pretrained(model, config, tmp_path / "model", tokenizer=tmp_path / "tokenizer.json")
    argv = ["generate", "--model", str(tmp_path / "model"), "--prompt", "hello", "--device", "cpu"]
    err = _refused(capsys, argv)
    assert err.startswith(f"dtrain generate: {tmp_path / 'model' / 'model.safetensors'}: the weights hold NaN"), err


def test_sampling_at_a_tiny_temperature_is_greedy_not_nan():
    import torch

    from dtrain.models.config import LlamaConfig
    from dtrain.models.decoder import build
    from dtrain.models.generate import generate

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)  # fmt: skip
    model = build(config).eval()
    ids = torch.tensor([[1, 2, 3]])
    greedy = generate(model, ids, max_new_tokens=3, temperature=0)
    assert torch.equal(generate(model, ids, max_new_tokens=3, temperature=1e-300, seed=1), greedy)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            generate(model, ids, max_new_tokens=1, temperature=bad)
    with pytest.raises(ValueError, match="seed"):
        generate(model, ids, max_new_tokens=1, temperature=1.0, seed=2**63)


# -- other flags ----------------------------------------------------------------------------------------------------


def test_bench_compute_names_a_device_it_cannot_use(capsys):
    import torch

    err = _refused(capsys, ["bench", "compute", "--quick", "--device", "nosuch"])
    assert err == "dtrain: error: --device nosuch: not a torch device; use cpu, cuda or cuda:N\n", err
    if not torch.cuda.is_available():
        err = _refused(capsys, ["bench", "compute", "--quick", "--device", "cuda"])
        assert err.startswith("dtrain: error: --device cuda: CUDA is not available"), err


def test_topology_checks_every_output_and_route_before_writing_any(area, capsys):
    d, f = area / "dir", area / "file"
    for argv, said in [
        (["--draw", str(d)], f"--draw {d}: is a directory"),
        (["--save", str(d)], f"--save {d}: is a directory"),
        (["--draw", str(area / "x.txt")], "format 'txt' is not one matplotlib writes"),
        (["--draw", str(area / "x")], "the name has no format suffix"),
        (["--draw", str(area / "x.png"), "--save", str(f / "s.toml")], f"--save {f}/s.toml"),
        (["--save", str(area / "s.toml"), "--route", "a", "b"], "--route: dgx-a100 has no node 'a'"),
        (["--save", str(area / "s.png"), "--draw", str(area / "s.png")], "--draw and --save: both name"),
    ]:
        err = _refused(capsys, ["topology", "dgx-a100", *argv])
        assert said in err, err
    assert _contents(area) == UNTOUCHED


def test_export_checks_the_tokenizer_is_one(area, capsys):
    err = _refused(capsys, ["export", str(area / "run"), "--out", str(area / "e"), "--tokenizer", str(area / "file")])
    assert err.startswith(f"dtrain export: --tokenizer {area / 'file'}: not a tokenizers tokenizer.json"), err
    err = _refused(capsys, ["export", str(area / "run"), "--out", str(area / "e"), "--tokenizer", str(area / "no")])
    assert err == f"dtrain export: --tokenizer {area / 'no'}: no such file\n", err
    assert _contents(area) == UNTOUCHED


def test_emulate_run_checks_the_command_and_out_before_building_anything(area, capsys, monkeypatch):
    from dtrain.emulate import build, netns

    monkeypatch.setattr(build, "Emulation", lambda plan: pytest.fail("an emulation was built"))
    monkeypatch.setattr(netns, "require_root", lambda: pytest.fail("the root check was reached"))
    topology = ["emulate", "run", "--topology", "4-rack", "--set", "racks=2", "--set", "servers_per_rack=1"]
    err = _refused(capsys, [*topology, "--out", str(area / "e"), "--", "nosuchcmd"])
    assert err.startswith("dtrain: error: the command after -- (nosuchcmd): argument command: invalid choice"), err
    err = _refused(capsys, [*topology, "--out", str(area / "e"), "--", "bench", "comm", "--nproc", "x"])
    assert "the command after -- (bench comm --nproc x): argument --nproc" in err, err
    err = _refused(capsys, [*topology, "--out", str(area / "file"), "--", "bench", "comm"])
    assert err == f"dtrain: error: --out {area / 'file'}: exists and is not a directory\n", err
    assert _contents(area) == UNTOUCHED


# -- bench: each refusal names its flag, before any rank starts ------------------------------------------------------

NO_CURVES = "[1, 2]"  # JSON, but no curve file


def test_bench_flags_are_named_and_refused_before_any_rank_starts(area, capsys, monkeypatch):
    import torch

    from dtrain import launch

    monkeypatch.setattr(launch, "start_fork_server", lambda nproc: pytest.fail("a rank was started"))
    monkeypatch.chdir(area)
    (area / "list.json").write_text(NO_CURVES)
    (area / "text.json").write_text("not json")
    cpu = not torch.cuda.is_available()
    comm, rules = ["bench", "comm", "--out", "b.jsonl"], ["bench", "calibrate", "--rules", "--out", "r.json"]
    overlap = ["bench", "overlap", "--out", "o.jsonl"]
    cases = [
        ([*comm, "--min-bytes", "8K", "--max-bytes", "1K"], "--min-bytes 8192 is above --max-bytes 1024"),
        ([*comm, "--min-bytes", "0"], "--min-bytes must be"),
        ([*comm, "--factor", "1"], "--factor must be"),
        ([*comm, "--iters", "0"], "--iters must be"),
        ([*comm, "--trials", "0"], "--trials must be"),
        ([*comm, "--warmup", "-1"], "--warmup must be"),
        ([*comm, "--warm-s", "inf"], "--warm-s must be"),
        ([*comm, "--nproc", "0"], "argument --nproc: expected a whole number >= 1"),
        ([*comm, "--collectives", ","], "--collectives: none given"),
        ([*comm, "--algorithms", ""], "--algorithms: none given"),
        ([*comm, "--collectives", "all_reduce,broadcast,all_reduce"], "--collectives: all_reduce given twice"),
        ([*comm, "--algorithms", "ring,native,ring"], "--algorithms: ring given twice"),
        ([*comm, "--iters", "5", "--sizes-iters"], "--iters and --sizes-iters"),
        (["bench", "verify", "--nproc", "0"], "argument --nproc: expected a whole number >= 1"),
        (["bench", "calibrate", "--out", "c.json", "--min-bytes", "4K"], "--min-bytes: needs --rules"),
        (["bench", "calibrate", "--out", "c.json", "--fresh"], "--fresh: needs --rules"),
        ([*rules, "--repeats", "3"], "--repeats: not with --rules"),
        ([*rules, "--min-bytes", "8K", "--max-bytes", "1K"], "--min-bytes 8192 is above --max-bytes 1024"),
        ([*rules, "--rounds", "0"], "--rounds must be"),
        ([*rules, "--collectives", "all_reduce,all_reduce"], "--collectives: all_reduce given twice"),
        ([*rules, "--collectives", ","], "--collectives: none given"),
        ([*overlap, "--seconds", "inf"], "--seconds must be"),
        ([*overlap, "--collectives", "all-reduce,all-reduce"], "--collectives: all-reduce given twice"),
        ([*overlap, "--write-curves", "list.json"], "--write-curves list.json: not a compute-curve file"),
        ([*overlap, "--write-curves", "text.json"], "--write-curves text.json: not JSON"),
        (["bench", "compute", "--quick", "--write-curves", "text.json"], "--write-curves text.json: not JSON"),
        (["bench", "pipeline", "--microbatches", "4,x"], "--microbatches: not a whole number: 'x'"),
        (["bench", "pipeline", "--warmup", "0"], "--warmup must be"),
        (["bench", "pipeline", "--layers", "1"], "--layers 1"),
    ]
    if cpu:  # the CPU's own limits: no CUDA graphs, and the machine's memory
        cases += [
            ([*comm, "--graphs"], "--graphs: CUDA graphs need GPUs"),
            (["bench", "pipeline", "--graphs"], "--graphs: CUDA graphs need GPUs"),
            ([*comm, "--max-bytes", "1048576G"], "--max-bytes 1125899906842624: "),
            ([*rules, "--max-bytes", "1048576G"], "--max-bytes 1125899906842624: "),
            ([*overlap, "--bytes", "1048576G"], "--bytes 1125899906842624: "),
        ]
    for argv, said in cases:
        err = _refused(capsys, argv)
        assert said in err, (argv, err)
    assert _contents(area) == ["dir", "file", "list.json", "text.json"]


def test_bench_comm_names_a_rules_file_auto_cannot_read_before_any_rank_starts(area, capsys, monkeypatch):
    from dtrain import launch

    monkeypatch.setattr(launch, "start_fork_server", lambda nproc: pytest.fail("a rank was started"))
    (area / "rules.json").write_text("not json")
    monkeypatch.setenv("DTRAIN_COMM_RULES", str(area / "rules.json"))
    err = _refused(capsys, ["bench", "comm", "--algorithms", "auto", "--out", str(area / "b.jsonl")])
    assert err.startswith(f"dtrain: error: DTRAIN_COMM_RULES: {area / 'rules.json'}: not a dtrain rules file"), err
    assert _contents(area) == ["dir", "file", "rules.json"]
