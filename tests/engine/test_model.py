"""The decoder itself: agreement with Hugging Face transformers, rope, windows, batching."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks.engine.config import RopeScaling
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.loader import load_checkpoint, save_checkpoint
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.tiny import build_tiny_model, tiny_config

LLAMA3_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)

FAMILIES = [
    pytest.param(tiny_config("llama"), id="llama"),
    pytest.param(tiny_config("llama", tie_word_embeddings=True), id="llama-tied"),
    pytest.param(tiny_config("llama", rope_scaling=LLAMA3_SCALING), id="llama3-rope"),
    pytest.param(tiny_config("qwen2"), id="qwen2"),
    pytest.param(tiny_config("mistral", sliding_window=8), id="mistral-window8"),
]


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(transformers: Any, path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of Hugging Face's own implementation loaded from the checkpoint at ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("config", FAMILIES)
def test_matches_transformers(config, tmp_path: Path) -> None:
    """Same checkpoint, same logits as HF's reference implementation (eager attention)."""
    transformers = pytest.importorskip("transformers")
    model = build_tiny_model(config)
    save_checkpoint(model, tmp_path)
    ids = _ids(2, 30)
    expected = _hf_logits(transformers, tmp_path, ids)
    torch.testing.assert_close(dense_logits(model, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "scaling",
    [None, RopeScaling("linear", 4.0), LLAMA3_SCALING],
    ids=["theta-only", "linear", "llama3"],
)
@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_rope_layouts_match_transformers(scaling, layout: str, tmp_path: Path) -> None:
    """Issue 7, item 12: a config in either layout loads with the rope HF computes.

    ``v4`` is ``rope_theta`` + ``rope_scaling`` at the top level (what transformers 4
    writes), ``v5`` one ``rope_parameters`` dict (transformers 5). A large theta and
    100 positions make a wrong theta or a dropped scaling visible in the logits.
    """
    transformers = pytest.importorskip("transformers")
    major = int(transformers.__version__.split(".")[0])
    if layout == "v5" and major < 5:
        pytest.skip("transformers < 5 does not read rope_parameters (parsed in test_config)")
    config = tiny_config("llama", rope_theta=500000.0, rope_scaling=scaling)
    model = build_tiny_model(config)
    save_checkpoint(model, tmp_path)
    if layout == "v5":
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        params = raw.pop("rope_scaling") or {"rope_type": "default"}
        raw["rope_parameters"] = {**params, "rope_theta": raw.pop("rope_theta")}
        path.write_text(json.dumps(raw))
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == config
    ids = _ids(2, 100)
    expected = _hf_logits(transformers, tmp_path, ids)
    torch.testing.assert_close(dense_logits(loaded, ids), expected, rtol=1e-4, atol=1e-4)


def test_batch_rows_are_independent(tiny_llama: LlamaForCausalLM) -> None:
    ids = _ids(3, 17)
    together = dense_logits(tiny_llama, ids)
    for row in range(3):
        alone = dense_logits(tiny_llama, ids[row : row + 1])
        torch.testing.assert_close(together[row : row + 1], alone, rtol=1e-5, atol=1e-5)


def test_logits_are_causal(tiny_llama: LlamaForCausalLM) -> None:
    ids = _ids(1, 20)
    full = dense_logits(tiny_llama, ids)
    prefix = dense_logits(tiny_llama, ids[:, :12])
    torch.testing.assert_close(full[:, :12], prefix, rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_what_a_token_sees() -> None:
    """With window W, changing a token more than W back has no effect; nearer tokens do."""
    model = build_tiny_model(tiny_config("mistral", sliding_window=6))
    ids = _ids(1, 16)
    base = dense_logits(model, ids)[0, -1]
    # Two layers of window 6 reach at most 2 * (6 - 1) = 10 positions back.
    far = ids.clone()
    far[0, 16 - 1 - 11] = (far[0, 16 - 1 - 11] + 1) % 256
    torch.testing.assert_close(dense_logits(model, far)[0, -1], base, rtol=0, atol=0)
    near = ids.clone()
    near[0, -3] = (near[0, -3] + 1) % 256
    assert not torch.allclose(dense_logits(model, near)[0, -1], base)


def test_llama3_rope_scaling_changes_long_range_only() -> None:
    """Llama 3 scaling keeps the highest frequencies and slows the lowest ones."""
    from kvblocks.engine.model import _inverse_frequencies

    plain = _inverse_frequencies(64, 10000.0, None)
    scaled = _inverse_frequencies(64, 10000.0, LLAMA3_SCALING)
    assert torch.equal(scaled[:4], plain[:4])
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)
    linear = _inverse_frequencies(64, 10000.0, RopeScaling("linear", 2.0))
    torch.testing.assert_close(linear, plain / 2.0)


def test_tiny_model_is_deterministic_and_seeded() -> None:
    a = build_tiny_model(seed=0)
    b = build_tiny_model(seed=0)
    c = build_tiny_model(seed=1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tiny_greedy_margins_are_clear(tiny_llama: LlamaForCausalLM) -> None:
    """The equality tests need argmax choices far above float32 noise."""
    logits = dense_logits(tiny_llama, _ids(4, 40))
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4
