"""Sampling from a CausalLM, and the ``dtrain generate`` command on a saved directory with a BPE tokenizer."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dtrain.cli import generate as cli
from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import build
from dtrain.models.generate import generate
from dtrain.models.hf import save_pretrained

TEXT = ["the quick brown fox jumps over the lazy dog", "a model of words, trained for a moment", "hello world"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=12,
    )
    return build(config).eval()


def _greedy_by_hand(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids[:, -12:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_is_the_argmax_each_step_and_crops_to_the_positions(model):
    prompt = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, max_new_tokens=7, temperature=0)  # 16 tokens: past the 12 positions
    assert out.shape == (2, 16) and out.dtype == torch.long and torch.equal(out[:, :9], prompt)
    assert torch.equal(out, _greedy_by_hand(model, prompt, 7))
    assert torch.equal(generate(model, prompt[0], max_new_tokens=7, temperature=0), out[0])  # (T,) in, (T,) out
    assert torch.equal(generate(model, prompt, max_new_tokens=7, temperature=0.7, top_k=1, seed=3), out)


def test_sampling_is_repeatable_with_a_seed_and_stays_in_the_top_k(model):
    prompt = torch.zeros(4, 3, dtype=torch.long)
    a = generate(model, prompt, max_new_tokens=6, temperature=1.5, seed=7)
    assert torch.equal(a, generate(model, prompt, max_new_tokens=6, temperature=1.5, seed=7))
    assert not torch.equal(a, generate(model, prompt, max_new_tokens=6, temperature=1.5, seed=8))
    out = generate(model, prompt, max_new_tokens=6, temperature=2.0, top_k=3, seed=1)
    for step in range(3, 9):
        with torch.no_grad():
            top = model(out[:, :step]).topk(3, dim=-1).indices[:, -1]  # (B, 3)
        assert (top == out[:, step : step + 1]).any(dim=1).all()
    assert model.training is False


def test_rows_stop_at_eos(model):
    prompt = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    free = generate(model, prompt, max_new_tokens=5, temperature=0)
    eos = int(free[0, 5])  # row 0's second generated token
    out = generate(model, prompt, max_new_tokens=5, temperature=0, eos_id=eos)
    for row in range(3):
        tokens, expected = out[row, 4:].tolist(), free[row, 4:].tolist()
        if eos in expected:  # the free run up to its first eos, then eos to the end
            stop = expected.index(eos) + 1
            assert tokens[:stop] == expected[:stop] and set(tokens[stop:]) <= {eos}
        else:  # a row that never ends keeps the batch going to max_new_tokens
            assert tokens == expected
    if any(eos not in free[row, 4:].tolist() for row in range(3)):
        assert out.shape[1] == 9
    one = generate(model, prompt[:1], max_new_tokens=5, temperature=0, eos_id=eos)
    assert one.tolist() == [free[0, :6].tolist()]  # a lone row stops at its eos


def test_any_of_several_end_ids_ends_a_row(model):
    """Llama 3's configs name several end-of-text ids: any of them ends a row, which is then padded with the
    first."""
    prompt = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    free = generate(model, prompt, max_new_tokens=5, temperature=0)
    second, fourth = int(free[0, 5]), int(free[0, 7])  # row 0's second and fourth generated tokens
    absent = next(i for i in range(60) if i not in free.tolist()[0])
    first_of_row0 = free[0, 4:].tolist().index(second)
    out = generate(model, prompt[:1], max_new_tokens=5, temperature=0, eos_id=[absent, second])
    assert out.tolist() == [free[0, : 4 + first_of_row0 + 1].tolist()]  # stopped at the second id listed
    padded = generate(model, prompt, max_new_tokens=5, temperature=0, eos_id=(absent, fourth, second))
    for row in range(3):
        tokens, expected = padded[row, 4:].tolist(), free[row, 4:].tolist()
        hits = [j for j, t in enumerate(expected) if t in (fourth, second)]
        if hits:  # the free run up to its first end id, then the first id listed
            assert tokens[: hits[0] + 1] == expected[: hits[0] + 1] and set(tokens[hits[0] + 1 :]) <= {absent}
        else:
            assert tokens == expected
    with pytest.raises(ValueError, match="eos_id"):
        generate(model, prompt, max_new_tokens=1, eos_id=[1, -2])


def test_bad_arguments(model):
    ids = torch.zeros(1, 3, dtype=torch.long)
    for kwargs, key in [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 2, "top_k": 0}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=key):
            generate(model, ids, **kwargs)
    with pytest.raises(ValueError, match="ids"):
        generate(model, ids.float(), max_new_tokens=1)


# -- dtrain generate ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtrain")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory with a tiny GPT-2 and a byte-level BPE tokenizer trained on the spot."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        TEXT * 10, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer.save(str(root / "tokenizer.json"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    save_pretrained(build(config), config, root / "model", tokenizer=root / "tokenizer.json")
    return root / "model"


def test_dtrain_generate_prints_the_prompt_and_its_continuation(saved, capsys):
    args = _parser().parse_args(
        ["generate", "--model", str(saved), "--prompt", "hello world", "--max-new-tokens", "5", "--seed", "1"]
    )
    assert args.handler is cli.run
    assert cli.run(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("hello world") and len(text.rstrip("\n")) > len("hello world")
    tokenizer = Tokenizer.from_file(str(saved / "tokenizer.json"))
    assert len(tokenizer.encode(text.removesuffix("\n")).ids) >= len(tokenizer.encode("hello world").ids) + 1
    greedy = ["generate", "--model", str(saved), "--prompt", "the fox", "--temperature", "0", "--device", "cpu"]
    assert cli.run(_parser().parse_args(greedy)) == 0
    first = capsys.readouterr().out
    assert cli.run(_parser().parse_args(greedy)) == 0
    assert capsys.readouterr().out == first


def test_dtrain_generate_stops_at_any_end_id_its_config_lists(saved, tmp_path, capsys):
    """A config whose ``eos_token_id`` is a list (Llama 3's) stops generation at any of its ids inside the
    vocabulary; ids outside it are left out."""
    greedy = ["generate", "--prompt", "the fox", "--temperature", "0", "--device", "cpu", "--max-new-tokens", "8"]
    assert cli.run(_parser().parse_args([*greedy, "--model", str(saved)])) == 0
    free = capsys.readouterr().out.removesuffix("\n")
    tokenizer = Tokenizer.from_file(str(saved / "tokenizer.json"))
    prompt, ids = tokenizer.encode("the fox").ids, tokenizer.encode(free).ids
    end = ids[len(prompt) + 1]  # the second generated token
    listed = tmp_path / "listed"
    shutil.copytree(saved, listed)
    raw = json.loads((listed / "config.json").read_text())
    raw["eos_token_id"] = [10**9, end]
    (listed / "config.json").write_text(json.dumps(raw))
    assert cli.run(_parser().parse_args([*greedy, "--model", str(listed)])) == 0
    stopped = capsys.readouterr().out.removesuffix("\n")
    assert tokenizer.encode(stopped).ids == ids[: ids.index(end, len(prompt)) + 1]


def test_dtrain_generate_stops_at_the_end_ids_of_generation_config_json(saved, tmp_path, capsys):
    """Where the directory has a ``generation_config.json`` with an ``eos_token_id``, those ids end the text, as
    ``transformers``' ``generate`` takes them over ``config.json``'s; a damaged one is one line naming it."""
    greedy = ["generate", "--prompt", "the fox", "--temperature", "0", "--device", "cpu", "--max-new-tokens", "8"]
    assert cli.run(_parser().parse_args([*greedy, "--model", str(saved)])) == 0
    free = capsys.readouterr().out.removesuffix("\n")
    tokenizer = Tokenizer.from_file(str(saved / "tokenizer.json"))
    prompt, ids = tokenizer.encode("the fox").ids, tokenizer.encode(free).ids
    end = ids[len(prompt) + 1]  # the second generated token
    other = next(i for i in range(len(tokenizer.get_vocab())) if i not in ids)
    directory = tmp_path / "generation-config"
    shutil.copytree(saved, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["eos_token_id"] = other
    (directory / "config.json").write_text(json.dumps(raw))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [other, end], "bos_token_id": 0}))
    assert cli.run(_parser().parse_args([*greedy, "--model", str(directory)])) == 0
    stopped = capsys.readouterr().out.removesuffix("\n")
    assert tokenizer.encode(stopped).ids == ids[: ids.index(end, len(prompt)) + 1]
    (directory / "generation_config.json").write_text("{not json")
    assert cli.run(_parser().parse_args([*greedy, "--model", str(directory)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "generation_config.json" in err, err


def test_dtrain_generate_bad_input_is_one_line_and_status_2(saved, tmp_path, capsys):
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((saved / "config.json").read_text())
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    (bad_config / "tokenizer.json").write_text((saved / "tokenizer.json").read_text())
    (bad_config / "config.json").write_text('{"model_type": "gpt2", "n_head": 5}')
    for directory, words in [
        (tmp_path / "missing", "no such directory"),
        (no_tokenizer, "tokenizer.json"),
        (bad_config, "n_head"),
    ]:
        args = _parser().parse_args(["generate", "--model", str(directory), "--prompt", "hi"])
        assert cli.run(args) == 2
        out = capsys.readouterr().err
        assert out.count("\n") == 1 and out.startswith("dtrain generate: ") and words in out, out


def test_dtrain_generate_names_a_prompt_that_is_not_utf8(saved, capsys):
    """A byte that is not UTF-8 on the command line reaches Python as a lone surrogate (surrogateescape)."""
    argv = ["generate", "--model", str(saved), "--prompt", "ab\udcff", "--max-new-tokens", "1"]
    assert cli.run(_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtrain generate: --prompt: not UTF-8 text"), err


def test_dtrain_generate_refuses_sampling_flags_that_greedy_decoding_ignores(saved, capsys):
    for flag in (["--top-k", "3"], ["--seed", "1"]):
        argv = ["generate", "--model", str(saved), "--prompt", "hi", "--temperature", "0", *flag]
        assert cli.run(_parser().parse_args(argv)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dtrain generate: {flag[0]}: ") and "--temperature 0" in err


def test_dtrain_generate_in_a_fresh_process(tmp_path):
    code = (
        "import argparse, sys; from dtrain.cli import generate as g; p = argparse.ArgumentParser(prog='dtrain'); "
        "g.add_parser(p.add_subparsers(dest='command')); a = p.parse_args(sys.argv[1:]); "
        "sys.exit(a.handler(a))"
    )
    missing = tmp_path / "missing"
    result = subprocess.run(
        [sys.executable, "-c", code, "generate", "--model", str(missing), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"dtrain generate: --model: {missing}: no such directory\n"
