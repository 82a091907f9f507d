"""A bad ``dtrain train --preset`` (or ``--model``) names the known presets plainly, on one line."""

from __future__ import annotations

import pytest

from dtrain.cli.main import main


def test_an_unknown_preset_lists_the_model_s_presets_by_name(capsys):
    assert main(["train", "--model", "gpt", "--preset", "huge"]) == 2
    captured = capsys.readouterr()
    err = (captured.out + captured.err).strip().splitlines()
    assert err[-1].endswith("no preset 'huge' for model 'gpt'; known: debug, small")
    assert "(" not in err[-1] and "Traceback" not in "\n".join(err)


def test_an_unknown_model_lists_the_models():
    from dtrain.train.models import model_config

    with pytest.raises(ValueError, match=r"known: none \(models: gpt, mlp\)$"):
        model_config("bert", "debug")
