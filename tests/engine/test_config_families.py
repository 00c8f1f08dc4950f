"""ModelConfig for Gemma 2/3, gpt-oss, Qwen3, OLMo 3 and Ministral: real configs, YaRN,
per-layer windows and ropes, and the switches that are refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvblocks.engine import LLM, CausalLM
from kvblocks.engine.config import SUPPORTED_MODEL_TYPES, AttentionSpec, ModelConfig, RopeScaling
from kvblocks.engine.hf_config import config_from_file, config_from_hf_dict, config_to_hf_dict
from kvblocks.engine.models import model_class
from kvblocks.engine.models.layers import _inverse_frequencies
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError

SLIDE, FULL = "sliding_attention", "full_attention"

# The config.json files of google/gemma-2-2b, google/gemma-3-1b-it and openai/gpt-oss-20b
# (as published, trimmed of fields no implementation reads).
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attention_bias": False,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "vocab_size": 256000,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": [SLIDE, FULL] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_gemma2_2b() -> None:
    c = config_from_hf_dict(GEMMA2_2B)
    assert c.architecture == "Gemma2ForCausalLM"
    assert c.layer_types_resolved() == [SLIDE, FULL] * 13
    assert c.layer_sliding_windows()[:4] == [4096, None, 4096, None]
    assert c.uniform_sliding_window() is None
    assert c.tie_word_embeddings  # Gemma's default
    assert c.layer_attention()[0] == AttentionSpec(4096, 1 / 16, 50.0, False)
    assert c.final_logit_softcapping == 30.0 and c.hidden_act == "gelu_pytorch_tanh"
    assert c.sliding_rope_theta is None and c.rope_theta == 10000.0
    assert model_class(c).__name__ == "GemmaForCausalLM"
    # Gemma 2's soft-cap defaults apply when the fields are absent.
    bare = {k: v for k, v in GEMMA2_2B.items() if "softcapping" not in k}
    c = config_from_hf_dict(bare)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)


def test_gemma3_1b() -> None:
    c = config_from_hf_dict(GEMMA3_1B)
    assert c.architecture == "Gemma3ForCausalLM"
    full = [i for i, kind in enumerate(c.layer_types_resolved()) if kind == FULL]
    assert full == [5, 11, 17, 23]  # 5 local layers per global one
    assert c.eos_token_ids == (1, 106) and c.torch_dtype == "bfloat16"
    assert c.attention_scale == 1 / 16 and c.attn_logit_softcapping is None
    assert c.layer_rope(0) == (10000.0, None) and c.layer_rope(5) == (1_000_000.0, None)
    # transformers 5's layout of the same model: one rope dict per layer type.
    v5 = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq")}
    v5["layer_types"] = config_from_hf_dict(GEMMA3_1B).layer_types_resolved()
    del v5["sliding_window_pattern"]
    v5["rope_parameters"] = {
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        SLIDE: {"rope_type": "default", "rope_theta": 10_000.0},
    }
    c5 = config_from_hf_dict(v5)
    assert c5.layer_rope(5) == (1_000_000.0, RopeScaling("linear", 8.0))
    assert c5.layer_rope(0) == (10_000.0, None)
    # v4's rope_scaling applies to the global layers only.
    c4 = config_from_hf_dict({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert c4.layer_rope(5) == c5.layer_rope(5) and c4.layer_rope(0) == c5.layer_rope(0)
    # A sliding_window_pattern other than 6 sets the kinds.
    c = config_from_hf_dict({**GEMMA3_1B, "sliding_window_pattern": 2})
    assert c.layer_types_resolved()[:4] == [SLIDE, FULL, SLIDE, FULL]


def test_gpt_oss_20b() -> None:
    with pytest.raises(InvalidArgumentError, match=r"quantized checkpoints.*'mxfp4'"):
        config_from_hf_dict(GPT_OSS_20B)
    c = config_from_hf_dict({k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    assert c.architecture == "GptOssForCausalLM"
    assert (c.num_local_experts, c.num_experts_per_tok, c.swiglu_limit) == (32, 4, 7.0)
    assert c.attention_bias and c.out_proj_bias and c.has_attention_sinks
    assert c.layer_sliding_windows()[:3] == [128, None, 128]
    assert c.layer_attention()[1] == AttentionSpec(None, 1 / 8, None, True)
    assert c.rope_scaling == RopeScaling(
        "yarn", 32.0, original_max_position_embeddings=4096, truncate=False
    )
    assert c.rope_scaling.yarn_attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    # No rope dict at all: transformers' default YaRN for gpt-oss.
    bare = {
        k: v for k, v in GPT_OSS_20B.items() if k not in ("quantization_config", "rope_scaling")
    }
    assert config_from_hf_dict(bare).rope_scaling == c.rope_scaling


@pytest.mark.parametrize(
    ("params", "truncate"),
    [
        ({"factor": 32.0, "original_max_position_embeddings": 4096}, False),
        ({"factor": 4.0, "original_max_position_embeddings": 2048}, True),
        ({"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0}, True),
        (
            {
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            True,
        ),
        ({"factor": 8.0, "original_max_position_embeddings": 4096, "attention_factor": 1.5}, True),
    ],
)
def test_yarn_matches_transformers(params: dict, truncate: bool) -> None:
    """Inverse frequencies and attention factor equal transformers' YaRN."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "truncate": truncate, **params}
    hf_config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
        rope_parameters=rope,
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    scaling = RopeScaling.from_dict(rope, default_original_max_position_embeddings=131072)
    assert scaling is not None
    torch.testing.assert_close(
        _inverse_frequencies(64, 150000.0, scaling).float(), inv_freq, rtol=1e-6, atol=0
    )
    assert scaling.yarn_attention_factor == pytest.approx(factor)


def test_yarn_llama_matches_transformers(tmp_path: Path) -> None:
    """A Llama with YaRN rope: same logits as transformers (cos/sin scaled too)."""
    transformers = pytest.importorskip("transformers")
    from kvblocks.engine.dense import dense_logits
    from kvblocks.engine.loader import save_checkpoint

    scaling = RopeScaling("yarn", 8.0, original_max_position_embeddings=16)
    model = build_tiny_model(tiny_config("llama", rope_scaling=scaling, rope_theta=500000.0))
    save_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(dense_logits(model, ids), expected, rtol=1e-4, atol=1e-4)


def test_llama_family_layer_types() -> None:
    """Qwen3 (windows from max_window_layers, or layer_types), OLMo 3 (3 sliding per full
    by default) and Ministral (layer_types) mix sliding and full layers per layer."""
    base = {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    }  # fmt: skip
    qwen3 = config_from_hf_dict(
        {
            **base,
            "model_type": "qwen3",
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 6,
        }
    )
    assert qwen3.layer_sliding_windows() == [None] * 6 + [64] * 2
    off = config_from_hf_dict({**base, "model_type": "qwen3", "sliding_window": 64})
    assert off.layer_sliding_windows() == [None] * 8  # use_sliding_window is off
    olmo3 = config_from_hf_dict({**base, "model_type": "olmo3", "sliding_window": 64})
    assert olmo3.layer_sliding_windows() == [64, 64, 64, None] * 2
    assert olmo3.rope_theta == 500000.0 and olmo3.sliding_rope_theta is None
    kinds = [SLIDE, FULL, FULL, SLIDE] * 2
    ministral = config_from_hf_dict(
        {
            **base,
            "model_type": "ministral",
            "sliding_window": 64,
            "layer_types": kinds,
            "attention_bias": True,
        }
    )
    assert ministral.layer_types_resolved() == kinds
    assert not ministral.attention_bias  # transformers builds Ministral without biases
    assert config_from_hf_dict({**base, "model_type": "ministral"}).sliding_window == 4096


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**GEMMA3_1B, "model_type": "gemma3"}, "multimodal Gemma3ForConditionalGeneration"),
        ({**GEMMA2_2B, "model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ({**GEMMA2_2B, "layer_types": [SLIDE, "chunked_attention"] * 13}, "'chunked_attention'"),
        ({**GEMMA2_2B, "layer_types": [SLIDE, FULL]}, "layer_types lists 2 layers"),
        ({**GEMMA2_2B, "layer_types": "alternate"}, "layer_types must be a list"),
        ({**GEMMA2_2B, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**GEMMA2_2B, "hidden_activation": "relu"}, "hidden_act 'relu'"),
        ({**GEMMA3_1B, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({**GEMMA3_1B, "sliding_window_pattern": 0}, "sliding_window_pattern"),
        (
            {**GEMMA3_1B, "rope_parameters": {FULL: {"rope_type": "dynamic", "factor": 2.0}}},
            "rope_parameters.full_attention type 'dynamic'",
        ),
        ({**GEMMA3_1B, "rope_local_base_freq": -1}, "rope_local_base_freq"),
        ({**GPT_OSS_20B, "quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes"),
        (
            {
                **{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"},
                "num_experts_per_tok": 40,
            },
            "num_experts_per_tok",
        ),
        (
            {
                **{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"},
                "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
            },
            "rope_scaling type 'longrope'",
        ),
        (
            {
                "model_type": "mistral",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 1,
                "vocab_size": 10,
                "sliding_window": 8,
                "layer_types": [SLIDE, FULL],
            },
            "use model_type 'ministral'",
        ),
        (
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 1,
                "vocab_size": 10,
                "rope_parameters": {FULL: {"rope_type": "default"}},
            },
            "one entry per layer type",
        ),
    ],
)
def test_unsupported_switches_are_refused_by_name(raw: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_hf_dict(raw)


def test_constructor_refuses_layer_types_where_transformers_ignores_them() -> None:
    with pytest.raises(InvalidArgumentError, match="use model_type 'ministral'"):
        ModelConfig(model_type="mistral", sliding_window=8, layer_types=(SLIDE, FULL))
    with pytest.raises(InvalidArgumentError, match="num_local_experts applies to gpt_oss"):
        ModelConfig(model_type="llama", num_local_experts=4)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_family_round_trips(model_type: str, tmp_path: Path) -> None:
    config = tiny_config(model_type, eos_token_ids=(3, 4))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf_dict(config)))
    assert config_from_file(tmp_path) == config


def test_llm_takes_a_model_object_of_any_family() -> None:
    model = build_tiny_model(tiny_config("gpt_oss"))
    assert isinstance(model, CausalLM)
    llm = LLM(model, num_blocks=32, block_size=8, device="cpu")
    from kvblocks.engine.dense import dense_greedy_generate
    from kvblocks.sampling_params import SamplingParams

    prompts = [list(range(3, 33)), list(range(40, 45))]
    expected = dense_greedy_generate(model, prompts, 10)
    out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


def test_llama_attention_bias_covers_the_output_projection(tmp_path: Path) -> None:
    """transformers' Llama biases o_proj too when attention_bias is set (the engine's did
    not: such checkpoints failed to load, and its own saved ones lacked the bias)."""
    transformers = pytest.importorskip("transformers")
    from kvblocks.engine.dense import dense_logits
    from kvblocks.engine.loader import load_checkpoint, save_checkpoint

    model = build_tiny_model(tiny_config("llama", attention_bias=True))
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    save_checkpoint(model, tmp_path)
    assert load_checkpoint(tmp_path).config == model.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(dense_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
