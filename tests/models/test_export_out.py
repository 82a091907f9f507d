"""``dtrain export --out``: a directory that is not a Hugging Face model directory (the run's own, its checkpoint, a
folder of other files) is refused in one line before anything is read or written, since the export replaces
``--out`` whole."""

from __future__ import annotations

import json

import pytest

from dtrain.cli.main import main


@pytest.fixture
def run(tmp_path):
    """A run directory with one checkpoint as its files look (its contents never read: the refusal comes first)."""
    out = tmp_path / "run"
    step = out / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"index")
    (step / "__0_0.distcp").write_bytes(b"tensors")
    (step / "meta.json").write_text(json.dumps({"step": 3}))
    (out / "metrics.jsonl").write_text("{}\n")
    return out


def _files(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_an_out_that_is_not_a_model_directory_is_refused_before_anything_is_written(run, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    before = _files(tmp_path)
    step = run / "checkpoints" / "step-00000003"
    for checkpoint, out in [(run, step), (step, step), (run, run), (run, other), (run, tmp_path)]:
        assert main(["export", str(checkpoint), "--out", str(out)]) == 2
        printed = capsys.readouterr()
        assert not printed.out and printed.err.count("\n") == 1, printed
        assert printed.err.startswith(f"dtrain export: --out {out}: "), printed.err
        assert _files(tmp_path) == before


@pytest.mark.parametrize("meta", ["[1, 2]", '{"model": {"model_type": "llama"}, "tokenizer": 5}'])
def test_a_checkpoint_description_of_the_wrong_kind_is_one_line(run, tmp_path, capsys, meta):
    step = run / "checkpoints" / "step-00000003"
    (step / "meta.json").write_text(meta)
    assert main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    printed = capsys.readouterr()
    assert not printed.out and printed.err.count("\n") == 1, printed
    assert printed.err.startswith(f"dtrain export: {step / 'meta.json'}: "), printed.err
    assert not (tmp_path / "hf").exists()
