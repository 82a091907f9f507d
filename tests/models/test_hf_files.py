"""Hugging Face directories without transformers: config.json parsing, the name mapping both ways, and every kind
of bad input as a one-line ValueError naming the file (and the key or tensor); saves are atomic."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtrain.models import hf
from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import build
from dtrain.models.hf import (
    from_hf_state_dict,
    load_config,
    load_pretrained,
    save_config,
    save_pretrained,
    to_hf_state_dict,
)
from dtrain.models.presets import preset

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def _one_line_naming(exc_info, *parts) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, (part, message)
    return message


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA)
    directory = tmp_path_factory.mktemp("llama") / "model"
    save_pretrained(build(config), config, directory)
    return directory


def _copy(directory, tmp_path):
    target = tmp_path / "copy"
    target.mkdir()
    for p in directory.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    return target


def _edit_config(directory, **changes):
    file = directory / "config.json"
    raw = json.loads(file.read_text())
    raw.update(changes)
    file.write_text(json.dumps(raw))
    return file


# -- config.json -------------------------------------------------------------------------------------------------


def test_config_round_trip_and_transformers_metadata(tmp_path):
    llama = preset("llama", "1b")
    save_config(llama, tmp_path / "l")
    raw = json.loads((tmp_path / "l" / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["architectures"] == ["LlamaForCausalLM"]
    assert load_config(tmp_path / "l") == llama
    assert load_config(tmp_path / "l" / "config.json") == llama
    gpt2 = preset("gpt2", "tiny")
    save_config(gpt2, tmp_path / "g")
    assert json.loads((tmp_path / "g" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert load_config(tmp_path / "g") == gpt2
    # transformers 5's rope_parameters, and the metadata keys transformers writes, are read
    file = _edit_config(
        tmp_path / "l",
        rope_parameters={"rope_theta": 1234.0, "rope_type": "default"},
        transformers_version="5.0.0",
        dtype="bfloat16",
        use_cache=True,
        bos_token_id=1,
        eos_token_id=[2, 3],
        pretraining_tp=1,
        output_attentions=False,
    )
    raw = json.loads(file.read_text())
    del raw["rope_theta"], raw["rope_scaling"]
    file.write_text(json.dumps(raw))
    config = load_config(file)
    assert config.rope_theta == 1234.0 and config.rope_scaling is None


def test_keys_of_released_gpt2_configs_that_change_nothing_are_accepted(tmp_path):
    """gpt2-medium's config.json (and gpt2-large's, gpt2-xl's) carries OpenAI GPT's n_special and
    predict_special_tokens, distilgpt2's _num_labels, older saves output_past and gradient_checkpointing: keys
    GPT-2's computation never reads, which transformers loads past."""
    save_config(preset("gpt2", "tiny"), tmp_path)
    released = dict(n_special=0, predict_special_tokens=True, _num_labels=1, output_past=True)
    file = _edit_config(tmp_path, **released, gradient_checkpointing=False)
    assert load_config(file) == preset("gpt2", "tiny")


def test_gpt2_config_keys_that_must_keep_their_value(tmp_path):
    save_config(preset("gpt2", "tiny"), tmp_path)
    file = _edit_config(tmp_path, n_ctx=256, reorder_and_upcast_attn=False, summary_type="cls_index")
    assert load_config(file).n_positions == 256
    _edit_config(tmp_path, n_ctx=128)
    with pytest.raises(ValueError) as e:
        load_config(file)
    _one_line_naming(e, file, "n_ctx")
    _edit_config(tmp_path, n_ctx=256, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError) as e:
        load_config(file)
    _one_line_naming(e, file, "scale_attn_by_inverse_layer_idx")
    for epsilon in (-1e-5, float("inf")):
        _edit_config(tmp_path, scale_attn_by_inverse_layer_idx=False, layer_norm_epsilon=epsilon)
        with pytest.raises(ValueError) as e:
            load_config(file)
        _one_line_naming(e, file, "layer_norm_epsilon")


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"attention_sink": 4}, "attention_sink"),
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"model_type": "mistral"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": "llama3"}, "rope_scaling"),
        ({"hidden_size": "32"}, "hidden_size"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"head_dim": 8.0}, "head_dim"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": "x",
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8,
                }
            },
            "rope_scaling",
        ),
        ({"model_type": ["llama"]}, "model_type"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
        ({"initializer_range": -1.0}, "initializer_range"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 0,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8,
                }
            },
            "low_freq_factor",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 0,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8,
                }
            },
            "factor",
        ),
    ],
)
def test_bad_config_is_one_line_naming_the_file_and_key(changes, key, tmp_path):
    save_config(LlamaConfig(**LLAMA), tmp_path)
    file = _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        load_config(tmp_path)
    _one_line_naming(e, file, key)


def test_bad_json_and_missing_config(tmp_path):
    file = tmp_path / "config.json"
    file.write_text('{"model_type": "llama",')
    with pytest.raises(ValueError) as e:
        load_config(tmp_path)
    _one_line_naming(e, file, "invalid JSON")
    file.write_text("[1, 2]")
    with pytest.raises(ValueError) as e:
        load_config(file)
    _one_line_naming(e, file)
    with pytest.raises(ValueError) as e:
        load_config(tmp_path / "nowhere")
    _one_line_naming(e, tmp_path / "nowhere", "no such file")


# -- the name mapping --------------------------------------------------------------------------------------------


def test_name_mapping_is_transformers_layout_and_inverts():
    torch.manual_seed(1)
    gpt2 = GPT2Config(vocab_size=50, n_positions=16, n_embd=24, n_layer=2, n_head=3)
    model = build(gpt2)
    state = model.state_dict()
    out = to_hf_state_dict(state, gpt2)
    assert "lm_head.weight" not in out and out["transformer.wte.weight"] is state["0.embed_tokens.weight"]
    # Conv1D layout: (in, out), q, k, v side by side
    attn = model[1].attn
    c_attn = out["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.shape == (24, 72)
    torch.testing.assert_close(c_attn[:, 24:48], attn.k_proj.weight.t(), atol=0, rtol=0)
    torch.testing.assert_close(out["transformer.h.0.mlp.c_fc.weight"], model[1].mlp.up_proj.weight.t())
    # without the "transformer." prefix, and with the attention-mask buffers of older checkpoints
    bare = {k.removeprefix("transformer."): v for k, v in out.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    bare["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    back = from_hf_state_dict(bare, gpt2)
    assert set(back) == {n for n, _ in model.named_parameters()}
    for name, tensor in back.items():
        torch.testing.assert_close(tensor, state[name], atol=0, rtol=0)

    llama = LlamaConfig(**LLAMA, tie_word_embeddings=True)
    state = build(llama).state_dict()
    out = to_hf_state_dict(state, llama)
    assert "lm_head.weight" not in out and "model.layers.1.post_attention_layernorm.weight" in out
    assert out["model.layers.1.input_layernorm.weight"] is state["2.attn_norm.weight"]
    del state["0.embed_tokens.weight"]  # a gathered dict may hold the tied weight under the head's name only
    assert to_hf_state_dict(state, llama)["model.embed_tokens.weight"] is state["3.lm_head.weight"]


def test_bad_state_dict_names_the_tensor():
    config = LlamaConfig(**LLAMA)
    state = build(config).state_dict()
    with pytest.raises(ValueError) as e:
        to_hf_state_dict({k: v for k, v in state.items() if k != "1.attn.k_proj.weight"}, config)
    _one_line_naming(e, "1.attn.k_proj.weight", "missing")
    with pytest.raises(ValueError) as e:
        to_hf_state_dict({**state, "1.attn.extra": torch.zeros(1)}, config)
    _one_line_naming(e, "1.attn.extra", "unexpected")
    hf_state = to_hf_state_dict(state, config)
    hf_state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as e:
        from_hf_state_dict(hf_state, config, source="ckpt")
    _one_line_naming(e, "ckpt", "model.layers.0.mlp.up_proj.weight", "(3, 3)", "(40, 32)")


# -- load_pretrained: bad files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("via_meta", [False, True])
def test_loads_in_the_asked_dtype(via_meta, llama_dir, tmp_path, monkeypatch):
    config = LlamaConfig(**{**LLAMA, "tie_word_embeddings": True})
    torch.manual_seed(2)
    reference = build(config).eval()
    save_pretrained(reference, config, tmp_path / "tied")
    if via_meta:  # the path of models too large to initialise before loading
        monkeypatch.setattr(hf, "DIRECT_BUILD_LIMIT", 0)
    ids = torch.randint(0, 64, (1, 8))
    model = load_pretrained(tmp_path / "tied")
    assert model.tied and not model.training
    assert torch.equal(model(ids), reference(ids))
    model = load_pretrained(tmp_path / "tied", dtype=torch.bfloat16)
    assert model.tied and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model[1].attn.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model(ids).float(), reference(ids), atol=0.1, rtol=0.05)


def test_missing_and_truncated_safetensors(llama_dir, tmp_path):
    directory = _copy(llama_dir, tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, weights, "safetensors")
    weights.write_bytes(data[:5])
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, weights)
    weights.unlink()
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, weights, "no such file")
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path / "nowhere")
    _one_line_naming(e, tmp_path / "nowhere")


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_bad_tensor_names_the_file_and_tensor(fault, llama_dir, tmp_path):
    directory = _copy(llama_dir, tmp_path)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.self_attn.v_proj.weight"
    if fault == "missing":
        del tensors[name]
    elif fault == "unexpected":
        name = "model.layers.2.self_attn.v_proj.weight"
        tensors[name] = torch.zeros(16, 32)
    else:
        tensors[name] = torch.zeros(32, 32)
    save_file(tensors, weights)
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, weights, name, {"missing": "missing", "unexpected": "unexpected", "shape": "(32, 32)"}[fault])


def test_bad_shards(llama_dir, tmp_path):
    model = load_pretrained(llama_dir)
    directory = tmp_path / "sharded"
    save_pretrained(model, model.config, directory, max_shard_bytes=8 * 1024)
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = directory / weight_map["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, shard, "model.norm.weight", "missing")
    shard.unlink()
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, shard, "no such file")
    index.write_text("{not json")
    with pytest.raises(ValueError) as e:
        load_pretrained(directory)
    _one_line_naming(e, index, "invalid JSON")


# -- save_pretrained: atomic -------------------------------------------------------------------------------------


def _siblings(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_failed_saves_leave_nothing_behind(llama_dir, tmp_path, monkeypatch):
    model = load_pretrained(llama_dir)
    config = model.config
    state = {k: v for k, v in model.state_dict().items() if k != "2.mlp.down_proj.weight"}
    with pytest.raises(ValueError) as e:
        save_pretrained(state, config, tmp_path / "out")
    _one_line_naming(e, "2.mlp.down_proj.weight")
    with pytest.raises(ValueError) as e:
        save_pretrained(model, config, tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    _one_line_naming(e, tmp_path / "tokenizer.json")
    with pytest.raises(ValueError) as e:
        save_pretrained(model, preset("llama", "tiny"), tmp_path / "out")
    _one_line_naming(e, "0.embed_tokens.weight", "(512, 64)")  # the tiny preset is wider
    assert _siblings(tmp_path) == []

    # a failure half-way through writing the shards: no directory, no temporary one, the old one intact
    save_pretrained(model, config, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    import safetensors.torch  # dtrain.models.hf imports save_file from it when writing

    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            raise OSError("disk full")
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, config, tmp_path / "out", max_shard_bytes=4 * 1024)
    assert len(calls) == 3 and os.path.exists(calls[0]) is False
    assert _siblings(tmp_path) == ["out"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, config, tmp_path / "new", max_shard_bytes=4 * 1024)
    assert _siblings(tmp_path) == ["out"]


def test_save_replaces_an_existing_directory_and_copies_the_tokenizer(llama_dir, tmp_path):
    model = load_pretrained(llama_dir)
    out = tmp_path / "out"
    save_pretrained(model, model.config, out, max_shard_bytes=4 * 1024)
    assert (out / "model.safetensors.index.json").exists()
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text('{"version": "1.0"}')
    save_pretrained(model, model.config, out, tokenizer=tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == tokenizer.read_text()
    assert _siblings(tmp_path) == ["out", "tok.json"]
    loaded = load_pretrained(out)
    for (name, a), (_, b) in zip(loaded.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_save_records_the_end_of_text_id_generation_stops_at(llama_dir, tmp_path):
    model = load_pretrained(llama_dir)
    save_pretrained(model, model.config, tmp_path / "eos", eos_token_id=5)
    assert json.loads((tmp_path / "eos" / "config.json").read_text())["eos_token_id"] == 5
    assert load_config(tmp_path / "eos") == model.config
    save_pretrained(model, model.config, tmp_path / "none")
    assert "eos_token_id" not in json.loads((tmp_path / "none" / "config.json").read_text())
    with pytest.raises(ValueError) as exc_info:
        save_pretrained(model, model.config, tmp_path / "bad", eos_token_id=LLAMA["vocab_size"])
    _one_line_naming(exc_info, "eos_token_id", LLAMA["vocab_size"])
    assert not (tmp_path / "bad").exists()


def test_a_fine_tune_keeps_the_generation_and_tokenizer_settings_of_its_source(llama_dir, tmp_path):
    """``carry_from``: the source's generation_config.json, tokenizer_config.json (a chat template) and
    special_tokens_map.json are copied, its config's token ids kept, the trained end-of-text id first among its
    end ids; a source whose ids lie outside the vocabulary is refused naming the file and key, nothing written."""
    source = tmp_path / "source"
    shutil.copytree(llama_dir, source)
    raw = json.loads((source / "config.json").read_text())
    raw.update(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0)
    (source / "config.json").write_text(json.dumps(raw))
    carried = {
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 7], "temperature": 0.6},
        "tokenizer_config.json": {"chat_template": "{{ messages }}", "model_max_length": 64},
        "special_tokens_map.json": {"eos_token": "<eos>"},
    }
    for name, content in carried.items():
        (source / name).write_text(json.dumps(content))
    model = load_pretrained(llama_dir)
    save_pretrained(model, model.config, tmp_path / "tuned", eos_token_id=7, carry_from=source)
    config = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, [7, 2], 0)
    for name, content in carried.items():
        if name == "generation_config.json":  # where transformers' generate reads its end ids: the trained one first
            content = {**content, "eos_token_id": [7, 2]}
        assert json.loads((tmp_path / "tuned" / name).read_text()) == content, name
    assert load_config(tmp_path / "tuned") == model.config
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True}))
    save_pretrained(model, model.config, tmp_path / "tuned", eos_token_id=7, carry_from=source)
    settings = json.loads((tmp_path / "tuned" / "generation_config.json").read_text())
    assert settings == {"eos_token_id": [7, 2], "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    save_pretrained(model, model.config, tmp_path / "tuned", eos_token_id=7, carry_from=source)
    assert json.loads((tmp_path / "tuned" / "generation_config.json").read_text()) == {"eos_token_id": 7}
    raw["bos_token_id"] = LLAMA["vocab_size"]
    (source / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as exc_info:
        save_pretrained(model, model.config, tmp_path / "bad", carry_from=source)
    _one_line_naming(exc_info, source / "config.json", "bos_token_id")
    assert not (tmp_path / "bad").exists()
    (source / "config.json").write_text(json.dumps({**raw, "bos_token_id": 1}))
    (source / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not a JSON object"):
        save_pretrained(model, model.config, tmp_path / "bad", carry_from=source)


def test_save_in_another_dtype_records_it(llama_dir, tmp_path):
    model = load_pretrained(llama_dir)
    save_pretrained(model, model.config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    loaded = load_pretrained(tmp_path / "bf16")  # float32 unless asked
    assert torch.equal(loaded[0].embed_tokens.weight, model[0].embed_tokens.weight.bfloat16().float())


def test_a_saved_directory_has_the_mode_of_the_umask(llama_dir, tmp_path):
    """The directory and its config.json are readable as the umask lets any new file be (as transformers writes
    them), not private to the owner as temporary ones are made."""
    model = load_pretrained(llama_dir)
    old = os.umask(0o022)
    try:
        save_pretrained(model, model.config, tmp_path / "out")
        save_config(model.config, tmp_path / "config")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "config.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "config" / "config.json").stat().st_mode & 0o777 == 0o644
