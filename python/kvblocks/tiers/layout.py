"""The byte layout of one KV block's payload, and the fingerprint that names it.

A payload holds a block's K and V for every layer, in the order ``layer 0 K, layer 0 V,
layer 1 K, ...``; each piece is one ``[num_kv_heads, block_size, head_size]`` tile of
:mod:`kvblocks.ops`' per-layer cache layout ``[num_blocks, num_kv_heads, block_size,
head_size]``, C-contiguous, in the cache's dtype. A payload is therefore exactly
``2 * num_layers`` contiguous tiles, and a tier stores it as ``payload_nbytes`` raw bytes.

The fingerprint hashes the model identity and every layout field, so that a stored block is
only ever loaded into a cache of the same model and shape: tiers key blocks by fingerprint
plus block hash and reject a value whose header carries another fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from kvblocks.errors import InvalidArgumentError

__all__ = ["FINGERPRINT_SIZE", "KVLayout"]

#: Bytes of a layout fingerprint (a 128-bit BLAKE2b digest).
FINGERPRINT_SIZE = 16


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and model identity of the blocks a tier holds.

    ``model_id`` is any string that names the weights (a checkpoint path, a name plus a
    revision): two engines share blocks only when their ``model_id`` and shapes agree.
    """

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    model_id: str = ""
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.model_id, str):
            raise InvalidArgumentError(f"model_id must be a str, got {self.model_id!r}")
        text = (
            f"kvblocks-layout-v1|{self.model_id}|{self.num_layers}|{self.num_kv_heads}|"
            f"{self.block_size}|{self.head_size}|{self.dtype}"
        )
        digest = hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_SIZE).digest()
        object.__setattr__(self, "fingerprint", digest)

    @classmethod
    def from_caches(
        cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], model_id: str = ""
    ) -> KVLayout:
        """The layout of a per-layer ``[(key_cache, value_cache), ...]`` list."""
        if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
            raise InvalidArgumentError("kv_caches must be a non-empty list of (key, value) pairs")
        for layer, pair in enumerate(kv_caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidArgumentError(f"kv_caches[{layer}] must be a (key, value) pair")
            for cache in pair:
                if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                    got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else cache
                    raise InvalidArgumentError(
                        f"kv_caches[{layer}]: a cache must be a tensor [num_blocks, "
                        f"num_kv_heads, block_size, head_size], got {got!r}"
                    )
        key = kv_caches[0][0]
        for layer, pair in enumerate(kv_caches):
            for cache in pair:
                # A payload holds one tile shape and dtype for every layer, K and V.
                if cache.shape[1:] != key.shape[1:] or cache.dtype != key.dtype:
                    raise InvalidArgumentError(
                        f"kv_caches[{layer}] {tuple(cache.shape)} {cache.dtype} differs from "
                        f"layer 0's {tuple(key.shape)} {key.dtype} in tile shape or dtype"
                    )
        _, heads, block_size, head_size = key.shape
        return cls(len(kv_caches), int(heads), int(block_size), int(head_size), key.dtype, model_id)

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) tile of a block."""
        return (self.num_kv_heads, self.block_size, self.head_size)

    @property
    def tile_nbytes(self) -> int:
        """Bytes of one layer's K (or V) tile of a block."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.block_size * self.head_size * itemsize

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one block's payload: K and V tiles for every layer."""
        return 2 * self.num_layers * self.tile_nbytes
