"""Llama 4 configs: a Scout-shaped ``config.json`` and its KV cache groups, transformers'
defaults for missing fields, refusals by name, and a saved checkpoint directory loaded by
the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvblocks import GroupSpec
from kvblocks.engine import LLM
from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.hf_config import config_from_hf_dict
from kvblocks.engine.loader import save_checkpoint
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

from .llama4_cases import CHUNKED, _options

# -- configs and refusals -----------------------------------------------------------------

# A Llama-4-Scout-shaped text config (the fields transformers reads; Scout writes its
# temperature switch as the int 4 and an empty no_rope_layers list).
SCOUT_TEXT = {
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": 4,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "interleave_moe_layer_step": 1,
    "max_position_embeddings": 10485760,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "use_qk_norm": True,
    "vocab_size": 202048,
}


def test_scout_shaped_config_and_its_groups() -> None:
    from kvblocks.engine.layer_groups import attention_layout

    c = config_from_hf_dict(SCOUT_TEXT)
    assert c.architecture == "Llama4ForCausalLM"
    assert c.llama4 is not None and c.llama4.attn_temperature_tuning
    assert c.llama4.moe_layers == tuple(range(48))  # interleave_moe_layer_step 1
    chunks = c.layer_attention_chunks()
    assert chunks[:4] == [8192, 8192, 8192, None]  # a NoPE layer every 4 (the default)
    assert chunks.count(None) == 12
    layout = attention_layout(c)
    assert layout is not None and layout.layers_per_group == 12
    assert (
        layout.groups()
        == [GroupSpec.full_attention()] + [GroupSpec.chunked_local_attention(8192)] * 3
    )
    assert c.layer_attention()[0] == AttentionSpec(None, 1 / math.sqrt(128), None, False, 8192)


def test_missing_fields_take_transformers_defaults() -> None:
    """A config.json with only the required fields reads as transformers reads it."""
    transformers = pytest.importorskip("transformers")
    required = ("model_type", "vocab_size", "hidden_size", "intermediate_size")
    raw = {k: SCOUT_TEXT[k] for k in (*required, "num_hidden_layers", "num_attention_heads")}
    c = config_from_hf_dict(raw)
    hf = transformers.Llama4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert c.llama4 is not None
    assert (c.head_dim, c.num_key_value_heads, c.rms_norm_eps) == (
        hf.head_dim,
        hf.num_key_value_heads,
        hf.rms_norm_eps,
    )
    assert (c.bos_token_id, c.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.rope_theta == hf.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert (
        (c.num_local_experts, c.num_experts_per_tok)
        == (16, 1)
        == (
            hf.num_local_experts,
            hf.num_experts_per_tok,
        )
    )
    assert c.attention_chunk_size == hf.attention_chunk_size
    assert c.layer_types_resolved() == hf.layer_types
    assert list(c.llama4.no_rope_layers) == hf.no_rope_layers
    assert list(c.llama4.moe_layers) == hf.moe_layers
    assert c.llama4.intermediate_size_mlp == hf.intermediate_size_mlp
    assert (c.llama4.floor_scale, c.llama4.attn_scale) == (hf.floor_scale, hf.attn_scale)
    assert c.llama4.use_qk_norm == hf.use_qk_norm
    assert c.llama4.attn_temperature_tuning == hf.attn_temperature_tuning
    assert c.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {**SCOUT_TEXT, "model_type": "llama4", "architectures": None},
            "Llama4ForConditionalGeneration; only the text-only Llama4ForCausalLM",
        ),
        (
            {**SCOUT_TEXT, "architectures": ["Llama4ForConditionalGeneration"]},
            r"architectures \['Llama4ForConditionalGeneration'\] are not supported",
        ),
        (
            {**SCOUT_TEXT, "layer_types": ["sliding_attention"] * 48},
            "'sliding_attention' are not supported for llama4_text",
        ),
        (
            {**SCOUT_TEXT, "attention_chunk_size": None, "layer_types": [CHUNKED] * 48},
            "chunked_attention layers but attention_chunk_size is None",
        ),
        ({**SCOUT_TEXT, "sliding_window": 128}, "sliding_window is not supported"),
        ({**SCOUT_TEXT, "no_rope_layers": [1, 2]}, "no_rope_layers must list 0 or 1"),
        ({**SCOUT_TEXT, "moe_layers": [48]}, "moe_layers"),
        ({**SCOUT_TEXT, "floor_scale": 0}, "floor_scale"),
        ({**SCOUT_TEXT, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({**SCOUT_TEXT, "rope_scaling": {"rope_type": "dynamic"}}, "'dynamic' is not supported"),
    ],
)
def test_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_hf_dict(raw)


def test_llama4_fields_belong_to_llama4() -> None:
    with pytest.raises(InvalidArgumentError, match="llama4_text needs llama4"):
        tiny_config("llama4_text", llama4=None)
    with pytest.raises(InvalidArgumentError, match="applies to llama4_text, not to llama"):
        tiny_config("llama", attention_chunk_size=16)
    with pytest.raises(InvalidArgumentError, match="applies to llama4_text, not to llama"):
        tiny_config("llama", llama4=_options())


@pytest.mark.parametrize("kv_cache_groups", [True, False])
def test_chunk_not_a_multiple_of_the_block_size_is_refused(kv_cache_groups: bool) -> None:
    model = build_tiny_model(tiny_config("llama4_text", attention_chunk_size=24))
    with pytest.raises(
        InvalidArgumentError,
        match=r"attention_chunk_size \(24\) must be a multiple of block_size \(16\)",
    ):
        LLM(model, num_blocks=32, block_size=16, device="cpu", kv_cache_groups=kv_cache_groups)
    # 24 is a multiple of 8: the same model runs in blocks of 8.
    llm = LLM(model, num_blocks=32, block_size=8, device="cpu", kv_cache_groups=kv_cache_groups)
    prompt = list(range(1, 60))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = dense_greedy_generate(model, [prompt], 8)[0]
    assert llm.generate([prompt], params)[0].token_ids == want


def test_generate_cli_loads_the_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvblocks generate --model DIR`` on a saved tiny Llama 4: one full and three
    chunked groups, the dense model's tokens; blocks larger than the chunk are refused
    by name."""
    from kvblocks.cli import main

    model = build_tiny_model(tiny_config("llama4_text"))
    save_checkpoint(model, tmp_path)
    prompt = [(7 * i) % 250 + 1 for i in range(40)]  # three 16-token chunks
    argv = ["generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-tokens", "6", "--device", "cpu"]
    assert main([*argv, "--block-size", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_cache_groups"] == 4
    assert (
        doc["outputs"][0]["completions"][0]["token_ids"]
        == (dense_greedy_generate(model, [prompt], 6)[0])
    )
    assert main([*argv, "--block-size", "32"]) == 1
    assert "attention_chunk_size (16) must be a multiple of --block-size (32)" in (
        capsys.readouterr().err
    )
