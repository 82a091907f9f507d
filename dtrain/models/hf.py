"""Hugging Face model directories: ``config.json``, safetensors weights (one file or shards) and ``tokenizer.json``.

A directory written by ``transformers``' ``save_pretrained`` loads into a :class:`~dtrain.models.decoder.CausalLM`
(:func:`load_pretrained`), and :func:`save_pretrained` writes one that ``transformers.AutoModelForCausalLM``
loads. Only local paths are read; nothing is downloaded.

Tensor names follow ``transformers``' ``LlamaForCausalLM`` and ``GPT2LMHeadModel``:

- Llama: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}``,
  ``model.layers.{i}.mlp.{gate,up,down}_proj.{weight,bias}``, ``model.layers.{i}.input_layernorm.weight``
  (dtrain's ``attn_norm``), ``model.layers.{i}.post_attention_layernorm.weight`` (``mlp_norm``),
  ``model.norm.weight``, ``lm_head.weight`` (absent when tied to the embedding).
- GPT-2: ``transformer.wte``, ``transformer.wpe``, ``transformer.h.{i}.ln_1`` / ``ln_2``,
  ``transformer.h.{i}.attn.c_attn`` (the fused query-key-value projection), ``attn.c_proj``, ``mlp.c_fc``,
  ``mlp.c_proj``, ``transformer.ln_f``; the names are also accepted without the ``transformer.`` prefix. GPT-2's
  projections are ``Conv1D`` layers whose weight is ``(in, out)``, the transpose of ``nn.Linear``'s. The
  attention-mask buffers ``attn.bias`` / ``attn.masked_bias`` of older checkpoints are skipped, as are the
  ``rotary_emb.inv_freq`` buffers of older Llama ones.

Weights are written as ``transformers`` writes them (``huggingface_hub``'s state-dict splitting): one
``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards filled in tensor order up to
``max_shard_bytes`` each, with ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). A tied
head is stored once, as the embedding. Files are read with ``safetensors`` only (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.files import new_directory, write_atomically
from dtrain.models.config import CONFIGS, GPT2Config, LlamaConfig, ModelConfig, ModelConfigError, config_fields
from dtrain.models.decoder import Attention, CausalLM, rope_frequencies
from dtrain.models.dropout import number_sites
from dtrain.models.flops import parameter_count

__all__ = [
    "CARRIED_FILES",
    "CONFIG_NAME",
    "INDEX_NAME",
    "TOKENIZER_NAME",
    "WEIGHTS_NAME",
    "carried_settings",
    "check_pretrained",
    "dtrain_shapes",
    "from_hf_state_dict",
    "hf_shapes",
    "load_config",
    "load_pretrained",
    "save_config",
    "save_pretrained",
    "to_hf_state_dict",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}

#: The files of a model directory about its tokenizer and generation (transformers' ``GenerationConfig``, the
#: special tokens and a chat template) that a model trained on from it keeps: :func:`save_pretrained`'s ``carry_from``.
CARRIED_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
#: The token ids of ``config.json`` a model trained on from another directory keeps.
CARRIED_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Keys of transformers' config.json files that do not change the computation (metadata, generation and
# fine-tuning settings); so do the output_* flags (what transformers' forward returns).
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "use_cache",
        "pretraining_tp",  # a slicing of the matmuls in transformers' forward, the same result
        "_name_or_path",
        "name_or_path",
        "return_dict",
        "tokenizer_class",
        "prefix",
        "id2label",
        "label2id",
        "problem_type",
        "task_specific_params",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "initializer_factor",
        "_attn_implementation_autoset",
        "_num_labels",  # distilgpt2's: the labels of a classification head
        "gradient_checkpointing",  # older transformers' training setting, saved with the config
        "n_special",  # OpenAI GPT's, left in GPT-2's released configs (gpt2-medium, -large, -xl); GPT-2 never reads it
        "predict_special_tokens",  # likewise
    }
)
# Keys accepted only with the value that dtrain's decoder computes.
_REQUIRED_VALUES = {
    "gpt2": {"reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    "llama": {},
}


def _config_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / CONFIG_NAME if path.is_dir() else path


def _read_json(file: Path) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: invalid JSON ({exc})") from None


def _llama_rope(raw: dict[str, Any], fields: dict[str, Any], file: Path) -> None:
    """transformers 5 writes ``rope_parameters`` (``rope_theta`` and the scaling together); earlier versions
    ``rope_theta`` and ``rope_scaling``. Either becomes ``rope_theta`` + ``rope_scaling``."""
    params = raw.get("rope_parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"{file}: rope_parameters: must be an object, got {params!r}")
    params = dict(params)
    if "rope_theta" in params:
        fields["rope_theta"] = params.pop("rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" and set(params) <= {"rope_type", "type"}:
        fields.setdefault("rope_scaling", None)
    else:
        fields["rope_scaling"] = params


def _check_types(kind: type, fields: dict[str, Any], file: Path) -> None:
    """Each value of the JSON type of its field's default (a number for a float, an int or null for a field
    whose default is null), so that the config's own checks see values of the right kind."""
    for field in dataclasses.fields(kind):
        if field.name not in fields:
            continue
        value, default = fields[field.name], field.default
        if default is None:
            ok = value is None or (isinstance(value, dict) if field.name == "rope_scaling" else _is_int(value))
            wanted = "an object or null" if field.name == "rope_scaling" else "an integer or null"
        elif isinstance(default, bool):
            ok, wanted = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, wanted = _is_int(value), "an integer"
        elif isinstance(default, float):
            ok, wanted = isinstance(value, int | float) and not isinstance(value, bool), "a number"
        else:
            ok, wanted = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"{file}: {field.name}: must be {wanted}, got {value!r}")
    for key, value in (fields.get("rope_scaling") or {}).items():
        numeric = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if key in numeric and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise ValueError(f"{file}: rope_scaling: {key} must be a number, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_from_dict(raw: Any, file: str | os.PathLike = "config.json") -> ModelConfig:
    """A config from the parsed contents of a ``config.json``; errors name ``file`` and the key."""
    file = Path(file)
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIGS:
        raise ValueError(f"{file}: model_type: {model_type!r} is not one of {', '.join(map(repr, CONFIGS))}")
    kind = CONFIGS[model_type]
    known = set(config_fields(kind))
    required = _REQUIRED_VALUES[model_type]
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        if key in known:
            fields[key] = value
        elif key in required:
            if value != required[key]:
                raise ValueError(f"{file}: {key}: only {json.dumps(required[key])} is supported, got {value!r}")
        elif key == "n_ctx" and model_type == "gpt2":
            continue  # checked against n_positions below
        elif key == "rope_parameters" and model_type == "llama":
            continue  # read by _llama_rope
        elif key not in _IGNORED_KEYS and key != "model_type" and not key.startswith("output_"):
            raise ValueError(f"{file}: {key}: unknown key for a {model_type} config")
    if model_type == "llama":
        _llama_rope(raw, fields, file)
    _check_types(kind, fields, file)
    try:
        config = kind(**fields)
    except ModelConfigError as exc:
        raise ValueError(f"{file}: {exc}") from None
    except (TypeError, AttributeError) as exc:  # a value of the wrong JSON type inside rope_scaling
        raise ValueError(f"{file}: rope_scaling: {' '.join(str(exc).split())}") from None
    if model_type == "gpt2" and "n_ctx" in raw and raw["n_ctx"] != config.n_positions:
        raise ValueError(f"{file}: n_ctx: {raw['n_ctx']!r} must equal n_positions {config.n_positions}")
    return config


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`LlamaConfig` or :class:`GPT2Config` of a ``config.json`` (``path`` is the file or its
    directory). One-line ValueError naming the file for unreadable JSON, an unknown ``model_type`` or key, or
    fields the config rejects."""
    file = _config_file(path)
    return config_from_dict(_read_json(file), file)


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` contents for ``config``: ``model_type``, ``architectures`` and every field."""
    if not isinstance(config, LlamaConfig | GPT2Config):
        raise TypeError(f"expected a LlamaConfig or GPT2Config, got {type(config).__name__}")
    out: dict[str, Any] = {"model_type": config.model_type, "architectures": [_ARCHITECTURES[config.model_type]]}
    out.update(dataclasses.asdict(config))
    if isinstance(config, GPT2Config):
        out["n_ctx"] = config.n_positions
    return out


def save_config(config: ModelConfig, directory: str | os.PathLike) -> Path:
    """Write ``directory/config.json`` (atomically) in the form transformers reads; returns its path."""
    directory = Path(directory)
    data = (json.dumps(config_to_dict(config), indent=2, sort_keys=True) + "\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / CONFIG_NAME
    write_atomically(file, data)
    return file


# ----------------------------------------------------------------------------------------------------------------
# Tensor names


def dtrain_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of a :class:`CausalLM`'s parameters for ``config`` (a tied head listed once, as the
    embedding), as ``named_parameters()`` gives them; computed from the config, no model built."""
    last = config.num_layers + 1
    if isinstance(config, GPT2Config):
        dim, inner = config.n_embd, config.n_inner
        shapes = {
            "0.embed_tokens.weight": (config.vocab_size, dim),
            "0.embed_positions.weight": (config.n_positions, dim),
        }
        for i in range(config.n_layer):
            d = f"{i + 1}."
            for norm in ("attn_norm", "mlp_norm"):
                shapes[f"{d}{norm}.weight"] = shapes[f"{d}{norm}.bias"] = (dim,)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[f"{d}attn.{proj}.weight"], shapes[f"{d}attn.{proj}.bias"] = (dim, dim), (dim,)
            shapes[f"{d}mlp.up_proj.weight"], shapes[f"{d}mlp.up_proj.bias"] = (inner, dim), (inner,)
            shapes[f"{d}mlp.down_proj.weight"], shapes[f"{d}mlp.down_proj.bias"] = (dim, inner), (dim,)
        shapes[f"{last}.norm.weight"] = shapes[f"{last}.norm.bias"] = (dim,)
        return shapes
    dim, hidden = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"0.embed_tokens.weight": (config.vocab_size, dim)}
    for i in range(config.num_hidden_layers):
        d = f"{i + 1}."
        shapes[f"{d}attn_norm.weight"] = shapes[f"{d}mlp_norm.weight"] = (dim,)
        for proj, out, inp in (("q_proj", q, dim), ("k_proj", kv, dim), ("v_proj", kv, dim), ("o_proj", dim, q)):
            shapes[f"{d}attn.{proj}.weight"] = (out, inp)
            if config.attention_bias:
                shapes[f"{d}attn.{proj}.bias"] = (out,)
        for proj, out, inp in (("gate_proj", hidden, dim), ("up_proj", hidden, dim), ("down_proj", dim, hidden)):
            shapes[f"{d}mlp.{proj}.weight"] = (out, inp)
            if config.mlp_bias:
                shapes[f"{d}mlp.{proj}.bias"] = (out,)
    shapes[f"{last}.norm.weight"] = (dim,)
    if not config.tie_word_embeddings:
        shapes[f"{last}.lm_head.weight"] = (config.vocab_size, dim)
    return shapes


def _llama_pairs(config: LlamaConfig) -> list[tuple[str, str]]:
    """(dtrain name, HF name) for every Llama tensor; GPT-2's fused ones are handled separately."""
    last = config.num_hidden_layers + 1
    pairs = [("0.embed_tokens.weight", "model.embed_tokens.weight")]
    suffixes = ["weight"] + (["bias"] if config.attention_bias else [])
    mlp_suffixes = ["weight"] + (["bias"] if config.mlp_bias else [])
    for i in range(config.num_hidden_layers):
        d, h = f"{i + 1}.", f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs += [(f"{d}attn.{proj}.{s}", f"{h}self_attn.{proj}.{s}") for s in suffixes]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            pairs += [(f"{d}mlp.{proj}.{s}", f"{h}mlp.{proj}.{s}") for s in mlp_suffixes]
        pairs += [
            (f"{d}attn_norm.weight", f"{h}input_layernorm.weight"),
            (f"{d}mlp_norm.weight", f"{h}post_attention_layernorm.weight"),
        ]
    pairs.append((f"{last}.norm.weight", "model.norm.weight"))
    if not config.tie_word_embeddings:
        pairs.append((f"{last}.lm_head.weight", "lm_head.weight"))
    return pairs


def _take(state_dict: Mapping[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"{source}: {name}: missing tensor")
    return state_dict[name]


def _dtrain_state(state_dict: Mapping[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Check a dtrain-named state dict against ``config``; the tied head folded into the embedding."""
    expected = dtrain_shapes(config)
    last = config.num_layers + 1
    state = dict(state_dict)
    if config.tie_word_embeddings:
        head = state.pop(f"{last}.lm_head.weight", None)
        if head is not None:
            state.setdefault("0.embed_tokens.weight", head)
    for name, tensor in state.items():
        if name not in expected:
            raise ValueError(f"{source}: {name}: unexpected tensor for this {config.model_type} config")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{source}: {name}: shape {tuple(tensor.shape)}, the config needs {expected[name]}")
    for name in expected:
        _take(state, name, source)
    return state


def to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: ModelConfig, *, source: str = "state dict"
) -> dict[str, torch.Tensor]:
    """dtrain's names (``model.state_dict()``, or a full state dict gathered from sharded ranks) -> transformers'
    names and layouts. A tied head may be present or not; it is stored once, as the embedding. One-line
    ValueError naming ``source`` and the tensor for a missing, unexpected or misshapen tensor."""
    state = _dtrain_state(state_dict, config, source)
    if isinstance(config, LlamaConfig):
        return {hf: state[d] for d, hf in _llama_pairs(config)}
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": state["0.embed_tokens.weight"],
        "transformer.wpe.weight": state["0.embed_positions.weight"],
    }
    for i in range(config.n_layer):
        d, h = f"{i + 1}.", f"transformer.h.{i}."
        qkv = [state[f"{d}attn.{p}_proj.weight"] for p in "qkv"]
        out[f"{h}ln_1.weight"], out[f"{h}ln_1.bias"] = state[f"{d}attn_norm.weight"], state[f"{d}attn_norm.bias"]
        out[f"{h}attn.c_attn.weight"] = torch.cat(qkv, dim=0).t().contiguous()  # Conv1D: (in, 3 C)
        out[f"{h}attn.c_attn.bias"] = torch.cat([state[f"{d}attn.{p}_proj.bias"] for p in "qkv"])
        out[f"{h}attn.c_proj.weight"] = state[f"{d}attn.o_proj.weight"].t().contiguous()
        out[f"{h}attn.c_proj.bias"] = state[f"{d}attn.o_proj.bias"]
        out[f"{h}ln_2.weight"], out[f"{h}ln_2.bias"] = state[f"{d}mlp_norm.weight"], state[f"{d}mlp_norm.bias"]
        out[f"{h}mlp.c_fc.weight"] = state[f"{d}mlp.up_proj.weight"].t().contiguous()
        out[f"{h}mlp.c_fc.bias"] = state[f"{d}mlp.up_proj.bias"]
        out[f"{h}mlp.c_proj.weight"] = state[f"{d}mlp.down_proj.weight"].t().contiguous()
        out[f"{h}mlp.c_proj.bias"] = state[f"{d}mlp.down_proj.bias"]
    last = config.n_layer + 1
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (
        state[f"{last}.norm.weight"],
        state[f"{last}.norm.bias"],
    )
    return out


def _canonical(name: str, config: ModelConfig) -> str | None:
    """transformers' name in the form this module writes it; None for a buffer that is not a weight (GPT-2's
    attention masks, the rotary frequencies older Llama checkpoints store, which transformers skips too)."""
    if isinstance(config, LlamaConfig) and name.endswith("rotary_emb.inv_freq"):
        return None
    if isinstance(config, GPT2Config):
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            return f"transformer.{name}"
    return name


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for ``config`` (a tied head left out)."""
    shapes = dtrain_shapes(config)
    if isinstance(config, LlamaConfig):
        return {hf: shapes[d] for d, hf in _llama_pairs(config)}
    dim, inner, last = config.n_embd, config.n_inner, config.n_layer + 1
    out = {
        "transformer.wte.weight": shapes["0.embed_tokens.weight"],
        "transformer.wpe.weight": (config.n_positions, dim),
    }
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        for name, shape in (
            ("ln_1.weight", (dim,)),
            ("ln_1.bias", (dim,)),
            ("attn.c_attn.weight", (dim, 3 * dim)),
            ("attn.c_attn.bias", (3 * dim,)),
            ("attn.c_proj.weight", (dim, dim)),
            ("attn.c_proj.bias", (dim,)),
            ("ln_2.weight", (dim,)),
            ("ln_2.bias", (dim,)),
            ("mlp.c_fc.weight", (dim, inner)),
            ("mlp.c_fc.bias", (inner,)),
            ("mlp.c_proj.weight", (inner, dim)),
            ("mlp.c_proj.bias", (dim,)),
        ):
            out[h + name] = shape
    out["transformer.ln_f.weight"] = out["transformer.ln_f.bias"] = shapes[f"{last}.norm.weight"]
    return out


def from_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig, *, source: str = "state dict"
) -> dict[str, torch.Tensor]:
    """transformers' names and layouts -> dtrain's (for ``CausalLM.load_state_dict``; a tied head is absent, the
    embedding's ``Parameter`` serves it). GPT-2 names may lack the ``transformer.`` prefix. One-line ValueError
    naming ``source`` and the tensor for a missing, unexpected or misshapen tensor."""
    expected = hf_shapes(config)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state_dict.items():
        key = _canonical(name, config)
        if key is None:
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head stored twice: the embedding is the one loaded
        if key not in expected:
            raise ValueError(f"{source}: {name}: unexpected tensor for this {config.model_type} config")
        if tuple(tensor.shape) != expected[key]:
            raise ValueError(f"{source}: {name}: shape {tuple(tensor.shape)}, the config needs {expected[key]}")
        state[key] = tensor
    for key in expected:
        _take(state, key, source)
    if isinstance(config, LlamaConfig):
        return {d: state[hf] for d, hf in _llama_pairs(config)}
    c = config.n_embd
    out = {
        "0.embed_tokens.weight": state["transformer.wte.weight"],
        "0.embed_positions.weight": state["transformer.wpe.weight"],
    }
    for i in range(config.n_layer):
        d, h = f"{i + 1}.", f"transformer.h.{i}."
        q, k, v = state[f"{h}attn.c_attn.weight"].split(c, dim=1)
        qb, kb, vb = state[f"{h}attn.c_attn.bias"].split(c)
        out.update(
            {
                f"{d}attn_norm.weight": state[f"{h}ln_1.weight"],
                f"{d}attn_norm.bias": state[f"{h}ln_1.bias"],
                f"{d}attn.q_proj.weight": q.t(),
                f"{d}attn.k_proj.weight": k.t(),
                f"{d}attn.v_proj.weight": v.t(),
                f"{d}attn.q_proj.bias": qb,
                f"{d}attn.k_proj.bias": kb,
                f"{d}attn.v_proj.bias": vb,
                f"{d}attn.o_proj.weight": state[f"{h}attn.c_proj.weight"].t(),
                f"{d}attn.o_proj.bias": state[f"{h}attn.c_proj.bias"],
                f"{d}mlp_norm.weight": state[f"{h}ln_2.weight"],
                f"{d}mlp_norm.bias": state[f"{h}ln_2.bias"],
                f"{d}mlp.up_proj.weight": state[f"{h}mlp.c_fc.weight"].t(),
                f"{d}mlp.up_proj.bias": state[f"{h}mlp.c_fc.bias"],
                f"{d}mlp.down_proj.weight": state[f"{h}mlp.c_proj.weight"].t(),
                f"{d}mlp.down_proj.bias": state[f"{h}mlp.c_proj.bias"],
            }
        )
    last = config.n_layer + 1
    out[f"{last}.norm.weight"], out[f"{last}.norm.bias"] = (
        state["transformer.ln_f.weight"],
        state["transformer.ln_f.bias"],
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Loading


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _open_safetensors(file: Path):
    from safetensors import safe_open

    if not file.is_file():
        raise ValueError(f"{file}: no such file")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, or a Rust panic
        raise ValueError(f"{file}: not a readable safetensors file ({_one_line(exc)})") from None


def _weight_files(directory: Path) -> dict[str, Path]:
    """Each stored tensor name -> the safetensors file holding it."""
    single = directory / WEIGHTS_NAME
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    index = directory / INDEX_NAME
    if not index.is_file():
        raise ValueError(f"{single}: no such file (nor a sharded {INDEX_NAME})")
    raw = _read_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map: expected an object of tensor name -> file name")
    files = {name: directory / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if shard.parent != directory:
            raise ValueError(f"{index}: weight_map: {shard.name!r} is not a file of {directory}")
        with _open_safetensors(shard) as f:
            stored = set(f.keys())  # noqa: SIM118
        for name, where in files.items():
            if where == shard and name not in stored:
                raise ValueError(f"{shard}: {name}: missing tensor (listed in {INDEX_NAME})")
    return files


def _read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, wanted in by_file.items():
        try:
            with _open_safetensors(file) as f:
                for name in wanted:
                    out[name] = f.get_tensor(name)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({_one_line(exc)})") from None
    return out


def _file_shapes(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    out = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            for name in names:
                try:
                    out[name] = (tuple(f.get_slice(name).get_shape()), file)
                except Exception as exc:
                    raise ValueError(f"{file}: {name}: unreadable ({_one_line(exc)})") from None
    return out


# Models up to this many parameters are built in place (initialised, then overwritten); larger ones on the meta
# device first, so that no memory or time goes into weights about to be replaced.
DIRECT_BUILD_LIMIT = 1 << 26


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A model of ``config`` on ``device`` in ``dtype`` whose weights are to be loaded (their values arbitrary)."""
    if parameter_count(config) <= DIRECT_BUILD_LIMIT:
        with device:
            model = CausalLM(config).to(dtype=dtype)
    else:
        with torch.device("meta"):
            model = CausalLM(config)
        model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # leaving the meta device makes a Parameter per module: tie them again
        model[-1].lm_head.weight = model[0].embed_tokens.weight
    for module in model.modules():  # the rotary frequencies are computed in float32, not stored
        if isinstance(module, Attention) and module.inv_freq is not None:
            module.inv_freq = rope_frequencies(config).to(device)
    return number_sites(model)  # the dropouts' salts, left unset by the meta device


def _checked_weights(directory: Path) -> tuple[ModelConfig, dict[str, Path], list[str]]:
    """(config, each stored tensor's file, the names to load) of a Hugging Face directory, every safetensors
    header read and every tensor's name and shape checked against the config; no tensor data read."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    config = load_config(directory)
    files = _weight_files(directory)
    shapes = _file_shapes(files)
    expected = hf_shapes(config)
    default_file = directory / (WEIGHTS_NAME if (directory / WEIGHTS_NAME).is_file() else INDEX_NAME)
    wanted = []
    for name, (shape, file) in shapes.items():
        key = _canonical(name, config)
        if key is None or (key == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if key not in expected:
            raise ValueError(f"{file}: {name}: unexpected tensor for this {config.model_type} config")
        if shape != expected[key]:
            raise ValueError(f"{file}: {name}: shape {shape}, the config needs {expected[key]}")
        wanted.append(name)
    present = {_canonical(n, config) for n in wanted}
    for key in expected:
        if key not in present:
            raise ValueError(f"{default_file}: {key}: missing tensor")
    return config, files, wanted


def check_pretrained(directory: str | os.PathLike) -> ModelConfig:
    """The config of a Hugging Face directory whose weights :func:`load_pretrained` would load: ``config.json``
    read, every safetensors header parsed (the JSON header, the data it describes all there) and every tensor's
    name and shape checked against the config, without reading a tensor. The same one-line ValueErrors as
    :func:`load_pretrained`."""
    return _checked_weights(Path(directory))[0]


def load_pretrained(
    directory: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """The model of a Hugging Face directory: ``config.json`` and ``model.safetensors`` (or the shards of
    ``model.safetensors.index.json``), on ``device`` (default CPU) in ``dtype`` (default float32), in eval mode.

    Every stored tensor is checked before any is loaded: one-line ValueError naming the file and the tensor for
    a missing, unexpected or misshapen one, and naming the file for a missing or unreadable one.
    """
    directory = Path(directory)
    config, files, wanted = _checked_weights(directory)
    default_file = directory / (WEIGHTS_NAME if (directory / WEIGHTS_NAME).is_file() else INDEX_NAME)
    dtype = dtype or torch.float32
    state = from_hf_state_dict(_read_tensors(files, wanted), config, source=str(default_file))
    model = _empty_model(config, torch.device(device or "cpu"), dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = {n for n, _ in model.named_parameters()} - set(state)
    if missing:  # every parameter comes from the file: a gap here is a mapping fault, not a file's
        raise RuntimeError(f"parameters left unloaded: {sorted(missing)}")
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# Saving


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """huggingface_hub's split: tensors in order, a new shard when the next would pass the limit; a tensor larger
    than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_shard_bytes:
            shards.append({name: tensor})
            continue
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _write_weights(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object ``file`` holds; ValueError naming the file otherwise."""
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: {exc}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{file}: not a JSON object")
    return content


def carried_settings(directory: str | os.PathLike, vocab_size: int) -> tuple[dict[str, Any], list[Path]]:
    """What a model trained on from ``directory`` keeps of it (:data:`CARRIED_IDS` of its ``config.json``, each an
    id or a list of ids below ``vocab_size``; the :data:`CARRIED_FILES` it has, each a JSON object): the ids and
    the files' paths. ValueError naming the file and key at fault."""
    directory = Path(directory)
    file = directory / CONFIG_NAME
    raw = _json_object(file)
    ids: dict[str, Any] = {}
    for key in CARRIED_IDS:
        value = raw.get(key)
        if value is None:
            continue
        listed = value if isinstance(value, list) else [value]
        if not listed or not all(_is_int(i) and 0 <= i < vocab_size for i in listed):
            raise ValueError(f"{file}: {key} must be a token id below {vocab_size} or a list of them, got {value!r}")
        ids[key] = value
    files = [directory / name for name in CARRIED_FILES if (directory / name).is_file()]
    for path in files:
        _json_object(path)
    return ids, files


def _ends_with(eos_token_id: int, ends: Any) -> int | list[int]:
    """``eos_token_id`` first, then the other ids of ``ends`` (an id, a list of them or None): one id alone as an int,
    as transformers writes it."""
    others = [e for e in (ends if isinstance(ends, list) else [] if ends is None else [ends]) if e != eos_token_id]
    return [eos_token_id, *others] if others else eos_token_id


def save_pretrained(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    config: ModelConfig,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    eos_token_id: int | None = None,
    carry_from: str | os.PathLike | None = None,
) -> Path:
    """Write ``directory`` as transformers does: ``config.json``, ``model.safetensors`` or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, and ``tokenizer.json`` copied from ``tokenizer``.
    ``eos_token_id`` (the end-of-text id the model was trained with) goes into ``config.json``, where
    ``dtrain generate`` and ``transformers``' ``generate`` stop. ``carry_from``: the directory of the weights a
    fine-tune started from, whose tokenizer it trained with: its :data:`CARRIED_FILES` are copied and its
    ``config.json``'s :data:`CARRIED_IDS` kept (:func:`carried_settings`), ``eos_token_id`` first among its end
    ids, in ``config.json`` and in ``generation_config.json`` alike, so the model generates and chats as the one it
    came from.

    ``model_or_state_dict`` is a :class:`CausalLM` or a full state dict in dtrain's names; tensors are stored in
    ``dtype`` (default: as they are). The directory is built beside ``directory`` under a temporary name and
    renamed into place once complete; an existing ``directory`` is replaced only then, and a failure leaves
    nothing behind. Bad input is a one-line ValueError raised before anything is written.
    """
    directory = Path(directory)
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be a positive int, got {max_shard_bytes!r}")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ValueError(f"{tokenizer}: no such tokenizer file")
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a directory")
    if eos_token_id is not None and (not _is_int(eos_token_id) or not 0 <= eos_token_id < config.vocab_size):
        raise ValueError(f"eos_token_id: must be a token id below vocab_size {config.vocab_size}, got {eos_token_id!r}")
    carried_ids, carried_files = carried_settings(carry_from, config.vocab_size) if carry_from else ({}, [])
    if isinstance(model_or_state_dict, nn.Module):
        state_dict = model_or_state_dict.state_dict()
        source = f"{type(model_or_state_dict).__name__} state dict"
    else:
        state_dict, source = model_or_state_dict, "state dict"
    hf = to_hf_state_dict(state_dict, config, source=source)
    tensors = {}
    for name, tensor in hf.items():
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype)
        tensors[name] = tensor.contiguous()
    raw = config_to_dict(config)
    raw["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")  # the weights' (as transformers)
    raw.update(carried_ids)
    if eos_token_id is not None:
        raw["eos_token_id"] = _ends_with(eos_token_id, carried_ids.get("eos_token_id"))
    config_bytes = (json.dumps(raw, indent=2, sort_keys=True) + "\n").encode()
    carried = {path.name: path.read_bytes() for path in carried_files}
    if eos_token_id is not None and "generation_config.json" in carried:
        # transformers' generate stops at generation_config.json's end ids rather than config.json's
        settings = json.loads(carried["generation_config.json"])
        settings["eos_token_id"] = _ends_with(eos_token_id, settings.get("eos_token_id"))
        carried["generation_config.json"] = (json.dumps(settings, indent=2) + "\n").encode()
    parent = directory.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = new_directory(parent, f".{directory.name}.", ".tmp")
    old = None
    try:
        _write_weights(tensors, tmp, max_shard_bytes)
        (tmp / CONFIG_NAME).write_bytes(config_bytes)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        for name, data in carried.items():
            (tmp / name).write_bytes(data)
        if directory.exists():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{directory.name}.", suffix=".old"))
            os.replace(directory, old / "previous")
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / "previous").exists() and not directory.exists():
            os.replace(old / "previous", directory)  # put the previous directory back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return directory
