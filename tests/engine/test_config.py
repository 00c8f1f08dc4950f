"""ModelConfig: parsing HF config.json for the three families, and rejecting the rest."""

from __future__ import annotations

import json

import pytest

from kvblocks.engine.config import ModelConfig, RopeScaling
from kvblocks.engine.hf_config import config_from_file, config_from_hf_dict, config_to_hf_dict
from kvblocks.errors import InvalidArgumentError

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_llama3_config_fields() -> None:
    c = config_from_hf_dict(LLAMA3_8B)
    assert c.head_dim == 128
    assert c.num_key_value_heads == 8
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert not c.attention_bias
    assert c.layer_sliding_windows() == [None] * 32
    assert c.architecture == "LlamaForCausalLM"


def test_mistral_window_applies_to_every_layer() -> None:
    raw = {**LLAMA3_8B, "model_type": "mistral", "sliding_window": 4096, "rope_scaling": None}
    c = config_from_hf_dict(raw)
    assert c.layer_sliding_windows() == [4096] * 32
    assert c.uniform_sliding_window() == 4096


def test_qwen2_biases_and_window_layers() -> None:
    raw = {
        **LLAMA3_8B,
        "model_type": "qwen2",
        "rope_scaling": None,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    }
    c = config_from_hf_dict(raw)
    assert c.attention_bias
    assert c.sliding_window is None  # use_sliding_window is off
    c = config_from_hf_dict({**raw, "use_sliding_window": True})
    windows = c.layer_sliding_windows()
    assert windows[:28] == [None] * 28 and windows[28:] == [4096] * 4
    assert c.uniform_sliding_window() is None  # mixed layers: the manager keeps every block


def test_explicit_head_dim_and_missing_kv_heads() -> None:
    raw = {**LLAMA3_8B, "head_dim": 64, "rope_scaling": None}
    del raw["num_key_value_heads"]
    c = config_from_hf_dict(raw)
    assert c.head_dim == 64
    assert c.num_key_value_heads == c.num_attention_heads


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_hf_dict_round_trip(model_type: str, tmp_path) -> None:
    window = 128 if model_type != "llama" else None
    c = ModelConfig(model_type=model_type, sliding_window=window, eos_token_ids=(3, 4))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf_dict(c)))
    assert config_from_file(tmp_path) == ModelConfig(
        model_type=model_type,
        sliding_window=window,
        eos_token_ids=(3, 4),
        attention_bias=model_type == "qwen2",
        torch_dtype="float32",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            "rope_scaling type 'longrope'",
        ),
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"hidden_size": "big"}, "malformed field"),
    ],
)
def test_bad_configs_raise(change: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_hf_dict({**LLAMA3_8B, **change})


def test_missing_field_and_missing_file(tmp_path) -> None:
    raw = dict(LLAMA3_8B)
    del raw["vocab_size"]
    with pytest.raises(InvalidArgumentError, match="'vocab_size'"):
        config_from_hf_dict(raw)
    with pytest.raises(InvalidArgumentError, match=r"no config\.json"):
        config_from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        config_from_file(tmp_path)


def _v5_layout(raw: dict) -> dict:
    """The same config as transformers >= 5 writes it: one ``rope_parameters`` dict."""
    out = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    scaling = raw.get("rope_scaling") or {"rope_type": "default"}
    out["rope_parameters"] = {**scaling, "rope_theta": raw["rope_theta"]}
    return out


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_rope_is_read_from_both_layouts(layout: str) -> None:
    """Issue 7, item 12: transformers 5's rope_parameters used to be ignored (theta 10000)."""
    raw = LLAMA3_8B if layout == "v4" else _v5_layout(LLAMA3_8B)
    c = config_from_hf_dict(raw)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    plain = {**LLAMA3_8B, "rope_scaling": None}
    c = config_from_hf_dict(plain if layout == "v4" else _v5_layout(plain))
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    linear = {**LLAMA3_8B, "rope_scaling": {"type": "linear", "factor": 2.0}}
    c = config_from_hf_dict(linear if layout == "v4" else _v5_layout(linear))
    assert c.rope_scaling == RopeScaling("linear", 2.0)


def test_rope_layout_precedence_and_defaults() -> None:
    v5 = _v5_layout(LLAMA3_8B)
    # A theta inside rope_parameters wins over a stale top-level one (as in transformers 5).
    assert config_from_hf_dict({**v5, "rope_theta": 10000.0}).rope_theta == 500000.0
    # No theta anywhere: the Llama default.
    del v5["rope_parameters"]["rope_theta"]
    assert config_from_hf_dict(v5).rope_theta == 10000.0
    # llama3 without original_max_position_embeddings: max_position_embeddings (transformers 5).
    params = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}
    c = config_from_hf_dict({**v5, "rope_parameters": params})
    assert c.rope_scaling is not None
    assert c.rope_scaling.original_max_position_embeddings == LLAMA3_8B["max_position_embeddings"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "rope_parameters type 'dynamic'",
        ),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "type 'longrope'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "one entry per layer type",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_parameters": "llama3"}, "must be an object"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta must be"),
    ],
)
def test_unsupported_rope_is_rejected(change: dict, message: str) -> None:
    base = {k: v for k, v in LLAMA3_8B.items() if k not in ("rope_scaling", "rope_theta")}
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_hf_dict({**base, **change})
