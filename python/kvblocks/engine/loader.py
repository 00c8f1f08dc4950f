"""Hugging Face checkpoint directories: ``config.json`` plus ``*.safetensors`` weights.

Reads single-file and sharded checkpoints (``model.safetensors.index.json``), tied
embeddings included, tensor by tensor into a model whose parameters were created
uninitialised on the target device, so loading never initialises weights it will
overwrite. Writes the same format (used by the tests and by anyone who wants to save
the tiny model).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.hf_config import config_from_file, config_from_hf_dict, config_to_hf_dict
from kvblocks.engine.models import CausalLM, build_model
from kvblocks.errors import InvalidArgumentError

__all__ = ["load_checkpoint", "save_checkpoint", "weight_files"]

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
# Buffers some HF exports include; they are recomputed from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index if it has one."""
    path = Path(path)
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InvalidArgumentError(
                f"{index} names shards that do not exist: {', '.join(missing)}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgumentError(
            f"no *.safetensors weights in {path}; expected a Hugging Face checkpoint directory "
            "(PyTorch .bin checkpoints are not supported)"
        )
    return files


def _expected_parameters(model: CausalLM) -> dict[str, torch.nn.Parameter]:
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params


def _summarise(names: set[str]) -> str:
    shown = sorted(names)[:5]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return ", ".join(shown) + more


@torch.no_grad()
def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """Load a checkpoint directory of any supported family (``config.json`` ``model_type``).

    Args:
        path: directory with ``config.json`` and safetensors weights.
        device: where the parameters go.
        dtype: parameter dtype; default the checkpoint's ``torch_dtype`` (float32 if absent).

    Raises:
        InvalidArgumentError: unsupported architecture, missing/unexpected tensors, a shape
            mismatch, or no weights.
    """
    path = Path(path)
    if not path.is_dir():
        raise InvalidArgumentError(f"model path {path} is not a directory")
    config = config_from_file(path)
    if dtype is None:
        dtype = getattr(torch, config.torch_dtype or "float32", torch.float32)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.float32
    files = weight_files(path)
    device = torch.device(device)
    # Parameters are created uninitialised on the target device, then filled shard by shard.
    model = build_model(config, device=device, dtype=dtype)
    expected = _expected_parameters(model)
    loaded: set[str] = set()
    unexpected: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding is the output projection
                param = expected.get(name)
                if param is None:
                    unexpected.add(name)
                    continue
                tensor = shard.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise InvalidArgumentError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
    missing = set(expected) - loaded
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_summarise(unexpected)}")
        raise InvalidArgumentError(
            f"checkpoint {path} does not match its {config.architecture} config "
            f"({'; '.join(parts)})"
        )
    return model.eval()


@torch.no_grad()
def save_checkpoint(
    model: CausalLM,
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write ``model`` as an HF checkpoint directory; return the weight files written.

    With ``max_shard_bytes`` the tensors are split into ``model-0000i-of-0000n`` shards
    plus a ``model.safetensors.index.json``; tied output weights are not stored twice.

    Raises:
        InvalidArgumentError: the model's config has a field its family's ``config.json``
            cannot carry (a Llama with a sliding window, say): the checkpoint would load
            as another model. Nothing is written.
    """
    config = model.config
    raw = {**config_to_hf_dict(config), "torch_dtype": _dtype_name(model)}
    lost = _fields_lost(config, raw)
    if lost:
        raise InvalidArgumentError(
            f"a {config.model_type!r} config.json cannot carry {', '.join(lost)}: the "
            "checkpoint would load as another model"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = {
        name: param.detach().to("cpu").contiguous().clone()
        for name, param in _expected_parameters(model).items()
    }
    if max_shard_bytes is None:
        target = path / _SINGLE_FILE
        save_file(tensors, str(target), metadata={"format": "pt"})
        return [target]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    written = []
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        written.append(path / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / _INDEX_FILE).write_text(json.dumps(index, indent=2))
    return written


def _fields_lost(config: ModelConfig, raw: dict[str, Any]) -> list[str]:
    """The config fields that ``raw`` (its ``config.json``) reads back as other values."""
    back = config_from_hf_dict(json.loads(json.dumps(raw)))
    return [
        f.name
        for f in dataclasses.fields(config)
        if f.name != "torch_dtype" and getattr(back, f.name) != getattr(config, f.name)
    ]


def _dtype_name(model: CausalLM) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
