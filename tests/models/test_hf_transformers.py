"""dtrain's Hugging Face directories against ``transformers`` itself: random tiny transformers models load into
dtrain with the same logits, dtrain's saves load back into transformers with the same logits, sharded saves
load in both, and greedy generation picks the same tokens as transformers' ``generate``."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from dtrain.models.decoder import build  # noqa: E402
from dtrain.models.generate import generate  # noqa: E402
from dtrain.models.hf import INDEX_NAME, WEIGHTS_NAME, load_config, load_pretrained, save_pretrained  # noqa: E402
from dtrain.models.presets import preset  # noqa: E402

VOCAB = 96
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
# original_max_position_embeddings 64 with head_dim 8: the four rotary wavelengths (6.3 .. 6283) fall in each of
# llama3's regions (kept, blended, slowed by `factor`)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
GPT2 = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def _hf_model(kind: str):
    torch.manual_seed({"llama": 1, "llama-tied": 2, "llama3-rope": 3, "gpt2": 4}[kind])
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    else:
        fields = dict(LLAMA, tie_word_embeddings=kind == "llama-tied")
        if kind == "llama3-rope":
            fields.update(rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0, attention_bias=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (the random transformers model, the directory its save_pretrained wrote), each made once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            directory = tmp_path_factory.mktemp(kind)
            reference = _hf_model(kind)
            reference.save_pretrained(directory)
            made[kind] = reference, directory
        return made[kind]

    return get


def _ids(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def _from_pretrained(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "llama3-rope", "gpt2"])
def test_transformers_directory_loads_with_the_same_logits_and_saves_back(kind, saved, tmp_path):
    reference, directory = saved(kind)
    ids = _ids()
    expected = _hf_logits(reference, ids)

    model = load_pretrained(directory)
    assert model.tied == (kind in ("llama-tied", "gpt2"))
    if kind == "llama3-rope":
        assert model.config.rope_scaling["rope_type"] == "llama3" and model.config.attention_bias
    torch.testing.assert_close(_logits(model, ids), expected, atol=1e-5, rtol=0)

    save_pretrained(model, model.config, tmp_path / "ours")
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == ["config.json", WEIGHTS_NAME]
    again = _from_pretrained(tmp_path / "ours")
    torch.testing.assert_close(_hf_logits(again, ids), expected, atol=1e-5, rtol=0)


def test_a_dtrain_model_saved_in_shards_loads_in_transformers_and_in_dtrain(tmp_path):
    config = preset("llama", "tiny", vocab_size=VOCAB, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = build(config).eval()
    ids = _ids(length=24)
    expected = _logits(model, ids)

    # a plain state dict in dtrain's names, as a trainer gathers one
    save_pretrained(model.state_dict(), config, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "sharded" / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert not (tmp_path / "sharded" / WEIGHTS_NAME).exists()

    hf = _from_pretrained(tmp_path / "sharded")
    torch.testing.assert_close(_hf_logits(hf, ids), expected, atol=1e-5, rtol=0)
    back = load_pretrained(tmp_path / "sharded")
    assert load_config(tmp_path / "sharded") == config
    torch.testing.assert_close(_logits(back, ids), expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_generation_matches_transformers_generate(kind, saved):
    reference, directory = saved(kind)
    model = load_pretrained(directory)
    prompt = _ids(batch=1, length=6)
    with torch.no_grad():
        expected = reference.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    ours = generate(model, prompt, max_new_tokens=8, temperature=0)
    assert ours.shape == (1, 14)
    assert ours.tolist() == expected.tolist()


def test_rotary_frequencies_stored_by_older_llama_checkpoints_are_skipped_as_transformers_skips_them(saved, tmp_path):
    """Older Llama conversions store each layer's ``rotary_emb.inv_freq`` buffer; transformers leaves it unloaded
    (it computes the frequencies from the config) and so does dtrain."""
    import shutil

    from safetensors.torch import load_file, save_file

    reference, directory = saved("llama")
    old = tmp_path / "old"
    shutil.copytree(directory, old)
    tensors = load_file(old / WEIGHTS_NAME)
    for i in range(LLAMA["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    save_file(tensors, old / WEIGHTS_NAME, metadata={"format": "pt"})
    _from_pretrained(old)
    ids = _ids()
    torch.testing.assert_close(_logits(load_pretrained(old), ids), _hf_logits(reference, ids), atol=1e-5, rtol=0)
