"""What ``LLM`` is built from: the device, the model, the cache sizes and the remote tier.

Each function checks one constructor argument (or a group that belongs together) and
turns it into what the engine runs on, raising :class:`~kvblocks.errors.InvalidArgumentError`
with a one-line reason otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import torch

from kvblocks._core import KVCacheManager
from kvblocks.engine.layer_groups import (
    AttentionLayout,
    HybridLayout,
    attention_layout,
    hybrid_layout,
)
from kvblocks.engine.loader import load_checkpoint
from kvblocks.engine.models import CausalLM
from kvblocks.engine.runner import ModelRunner
from kvblocks.engine.state_cache import state_block_bytes
from kvblocks.engine.tiny import build_tiny_model
from kvblocks.engine.weights_identity import checkpoint_weights, model_weights_digest
from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import RemoteTier, TierStore
from kvblocks.tiers.remote_link import RemoteTierLink, RemoteTierOptions
from kvblocks.tiers.weights import CheckpointDigest
from kvblocks.validation import check_int

__all__ = [
    "attention_groups",
    "build_model",
    "cache_sizes",
    "check_max_model_len",
    "check_remote_tier",
    "connect_remote_tier",
    "recurrent_layout",
    "resolve_device",
    "state_bytes",
    "weights_before_load",
]

_CPU_DEFAULT_CACHE_BYTES = 256 << 20
_CPU_DEFAULT_MAX_BLOCKS = 4096
_DEFAULT_SWAP_BYTES = 4 << 30
_GPU_CACHE_FRACTION = 0.85


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The engine's device; anything but a usable CPU or CUDA device is a one-line error."""
    if device is None:
        if torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None:
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"unknown device {str(device)!r}; expected 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidArgumentError(
            f"device {str(device)!r} is not supported; expected 'cpu', 'cuda' or 'cuda:N'"
        )
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device {str(device)!r}: torch sees no CUDA GPU (torch.cuda.is_available() is "
            "False); use --device cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and not 0 <= dev.index < count:
        raise InvalidArgumentError(
            f"device {str(device)!r}: there are {count} CUDA devices (cuda:0..cuda:{count - 1})"
        )
    if importlib.util.find_spec("cupy") is None:
        raise InvalidArgumentError(
            f"device {str(device)!r}: the CUDA kernels need CuPy "
            "(pip install 'kvblocks[cuda12]' or 'kvblocks[cuda13]')"
        )
    return dev


def _default_dtype(model_dtype: str | None, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32
    if model_dtype == "float16":
        return torch.float16
    return torch.bfloat16


def build_model(
    model: str | Path | CausalLM | None,
    device: torch.device,
    dtype: torch.dtype | None,
    seed: int,
) -> CausalLM:
    """The model: the tiny one (``None``, weights from ``seed``), a checkpoint directory,
    or a model object (moved/cast when ``device``/``dtype`` ask for it)."""
    # The sampler seeds an int64 generator; torch casts weights to float dtypes only.
    check_int(seed, "seed", minimum=-(2**63), maximum=2**63 - 1)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgumentError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if isinstance(model, CausalLM):
        if dtype is not None or device != next(model.parameters()).device:
            model = model.to(device=device, dtype=dtype)
        return model.eval()
    if model is None:
        return build_tiny_model(
            seed=seed, device=device, dtype=dtype or _default_dtype(None, device)
        )
    from kvblocks.engine.hf_config import config_from_file

    if not str(model):  # Path("") is the current directory: never meant
        raise InvalidArgumentError("model path is empty; expected a checkpoint directory")
    if not Path(model).is_dir():
        raise InvalidArgumentError(
            f"model path {model} is not a directory; expected a Hugging Face checkpoint "
            "directory (config.json + *.safetensors)"
        )
    if dtype is None:
        dtype = _default_dtype(config_from_file(model).torch_dtype, device)
    return load_checkpoint(model, device=device, dtype=dtype)


def check_max_model_len(value: int | None, model_limit: int) -> int:
    """``max_model_len`` validated against the model's position limit (default: the limit)."""
    if value is None:
        return model_limit
    value = check_int(value, "max_model_len", minimum=2)
    if value > model_limit:
        raise InvalidArgumentError(
            f"max_model_len={value} exceeds the model's max_position_embeddings ({model_limit})"
        )
    return value


def cache_sizes(
    num_blocks: int | None, num_cpu_blocks: int | None, device: torch.device, block_bytes: int
) -> tuple[int, int]:
    """Device and CPU-swap blocks: as given, or by default 85% of the free GPU memory on
    CUDA (up to 256 MiB, at most 4096 blocks, on CPU) and as many swap blocks, at most
    4 GiB."""
    if num_blocks is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            num_blocks = max(2, int(free * _GPU_CACHE_FRACTION) // block_bytes)
        else:
            num_blocks = max(
                2, min(_CPU_DEFAULT_MAX_BLOCKS, _CPU_DEFAULT_CACHE_BYTES // block_bytes)
            )
    if num_cpu_blocks is None:
        num_cpu_blocks = min(num_blocks, max(1, _DEFAULT_SWAP_BYTES // block_bytes))
    if num_blocks < 2:
        raise InvalidArgumentError(
            f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}"
        )
    if num_cpu_blocks < 0:
        raise InvalidArgumentError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
    return num_blocks, num_cpu_blocks


def recurrent_layout(
    model: CausalLM,
    block_size: int,
    checkpoint_blocks: int | None,
) -> HybridLayout | None:
    """The KV cache groups of a hybrid recurrent model (``None`` for an attention-only
    one, which takes no ``checkpoint_blocks``). Its host tier's rows, and a remote
    tier's records, hold a state group's block's states (``KVLayout.state_nbytes``)."""
    layout = hybrid_layout(model.config, block_size, checkpoint_blocks)
    if layout is None:
        if checkpoint_blocks is not None:
            raise InvalidArgumentError(
                "state_checkpoint_blocks applies to models with recurrent layers only"
            )
        return None
    return layout


def attention_groups(model: CausalLM, enabled: bool) -> AttentionLayout | None:
    """The KV cache groups of a model mixing attention kinds, or ``None`` (one group of
    every layer): a model of one kind, or ``enabled=False``. A remote tier keys each
    group's blocks by group and hash (:mod:`kvblocks.tiers.remote_groups`)."""
    if not isinstance(enabled, bool):
        raise InvalidArgumentError(f"kv_cache_groups must be a bool, got {enabled!r}")
    if not enabled:
        return None
    return attention_layout(model.config)


def state_bytes(model: CausalLM, layout: HybridLayout | None) -> int:
    """Bytes of one block's recurrent states (0 without a layout)."""
    mixers = getattr(model, "mixers", [])
    return 0 if layout is None or not mixers else state_block_bytes(mixers[0], layout)


def check_remote_tier(remote_tier: RemoteTier | None, options: RemoteTierOptions | None) -> None:
    """Checked before the model is built: a wrong object fails at once, and options given
    without a tier are a mistake, not something to ignore."""
    if options is not None and not isinstance(options, RemoteTierOptions):
        raise InvalidArgumentError(
            f"remote_tier_options must be RemoteTierOptions or None, got {type(options).__name__}"
        )
    if remote_tier is None and options is not None:
        raise InvalidArgumentError("remote_tier_options given without a remote_tier")
    if remote_tier is not None and not (
        isinstance(remote_tier, TierStore) or callable(remote_tier)
    ):
        raise InvalidArgumentError(
            "remote_tier must be a TierStore (e.g. ValkeyTier) or a factory taking the "
            f"host layout, got {type(remote_tier).__name__}"
        )


def _needs_digest(remote_tier: RemoteTier | None) -> bool:
    """Whether the weights must be hashed for ``remote_tier`` (all but a store that opts
    out with ``trust_model_id``)."""
    return remote_tier is not None and not (
        isinstance(remote_tier, TierStore) and remote_tier.layout.trust_model_id
    )


def weights_before_load(model: object, remote_tier: RemoteTier | None) -> CheckpointDigest | None:
    """A checkpoint's digest, read from its files before they are loaded (cached across
    processes), when a remote tier needs it; None otherwise."""
    if _needs_digest(remote_tier) and isinstance(model, (str, Path)):
        return checkpoint_weights(model)
    return None


def connect_remote_tier(
    remote_tier: RemoteTier,
    options: RemoteTierOptions | None,
    on_disk: CheckpointDigest | None,
    model: CausalLM,
    manager: KVCacheManager,
    runner: ModelRunner,
) -> RemoteTierLink:
    """The link to ``remote_tier`` (a store, or a factory called with the engine's layout),
    its layout naming the weights by their digest (``on_disk``'s, else the model's).

    Raises:
        InvalidArgumentError: the checkpoint changed since ``on_disk`` was read, or the
            store does not fit the engine
            (:func:`~kvblocks.tiers.remote_link.check_store_layout`).
    """
    if on_disk is not None and not on_disk.unchanged():
        raise InvalidArgumentError(
            "the checkpoint changed while it was loaded; load it once it is completely written"
        )
    digest = ""
    if on_disk is not None:
        digest = on_disk.digest
    elif _needs_digest(remote_tier):
        digest = model_weights_digest(model)
    layout = dataclasses.replace(runner.tier_layout, weights_digest=digest)
    if callable(remote_tier) and not isinstance(remote_tier, TierStore):
        # A factory: the store's layout is only known once the model is built.
        remote_tier = remote_tier(layout)
    return RemoteTierLink(remote_tier, manager, runner.host_pool, layout, options)
