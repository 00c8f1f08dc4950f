"""HF checkpoint directories: save the tiny models in HF format, load them back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvblocks.engine.dense import dense_logits
from kvblocks.engine.hf_config import config_to_hf_dict
from kvblocks.engine.loader import load_checkpoint, save_checkpoint, weight_files
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError

IDS = torch.arange(40, dtype=torch.long).reshape(1, 40) * 7 % 256


def _assert_same_model(a: LlamaForCausalLM, b: LlamaForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    torch.testing.assert_close(dense_logits(a, IDS), dense_logits(b, IDS), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_round_trip_single_file(family: str, tmp_path: Path) -> None:
    model = build_tiny_model(tiny_config(family))
    files = save_checkpoint(model, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    names = set(load_file(files[0]))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert ("model.layers.1.self_attn.k_proj.bias" in names) == (family == "qwen2")
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == model.config
    _assert_same_model(model, loaded)


def test_round_trip_sharded_with_index(tmp_path: Path) -> None:
    model = build_tiny_model(tiny_config("qwen2"))
    files = save_checkpoint(model, tmp_path, max_shard_bytes=64 * 1024)
    assert len(files) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert weight_files(tmp_path) == sorted(files)
    _assert_same_model(model, load_checkpoint(tmp_path))


def test_tied_embeddings_store_one_matrix(tmp_path: Path) -> None:
    model = build_tiny_model(tiny_config("llama", tie_word_embeddings=True))
    save_checkpoint(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    _assert_same_model(model, loaded)


def test_tied_config_ignores_a_stored_lm_head(tmp_path: Path) -> None:
    model = build_tiny_model(tiny_config("llama", tie_word_embeddings=True))
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    tensors["model.rotary_emb.inv_freq"] = torch.ones(32)  # some exports carry this buffer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_same_model(model, load_checkpoint(tmp_path))


def test_load_casts_dtype(tmp_path: Path) -> None:
    model = build_tiny_model()
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def _rewrite(tmp_path: Path, edit) -> None:
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors_raise(tmp_path: Path) -> None:
    save_checkpoint(build_tiny_model(), tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(InvalidArgumentError, match=r"missing tensors: model\.layers\.1\.mlp"):
        load_checkpoint(tmp_path)

    save_checkpoint(build_tiny_model(), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.9.extra": torch.zeros(2)}))
    with pytest.raises(InvalidArgumentError, match=r"unexpected tensors: model\.layers\.9\.extra"):
        load_checkpoint(tmp_path)

    save_checkpoint(build_tiny_model(), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(InvalidArgumentError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_checkpoint(tmp_path)


def test_qwen2_checkpoint_without_biases_is_rejected(tmp_path: Path) -> None:
    save_checkpoint(build_tiny_model(tiny_config("qwen2")), tmp_path)
    _rewrite(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.endswith(".bias")])
    with pytest.raises(InvalidArgumentError, match=r"missing tensors: .*q_proj\.bias"):
        load_checkpoint(tmp_path)


def test_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf_dict(tiny_config())))
    with pytest.raises(InvalidArgumentError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(InvalidArgumentError, match="shards that do not exist"):
        load_checkpoint(tmp_path)


def test_a_config_its_family_cannot_carry_is_not_saved(tmp_path: Path) -> None:
    """A Llama model object with a sliding window (or Gemma's scalars) runs with them, but a
    Llama ``config.json`` has no key for them: the saved checkpoint reloaded as another
    model, silently. ``save_checkpoint`` refuses it now and writes nothing."""
    model = build_tiny_model(tiny_config("llama", sliding_window=8, attn_logit_softcapping=5.0))
    with pytest.raises(InvalidArgumentError, match="sliding_window, attn_logit_softcapping"):
        save_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
