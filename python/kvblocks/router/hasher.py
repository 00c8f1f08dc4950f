"""A prompt's block hashes, computed exactly as an instance computes them.

:class:`PromptHasher` is the router's view of :class:`kvblocks.hashing.BlockHasher`: the
core's own hash function (so the hashes match the instances' ``BlockStored`` events bit
for bit, for every hash algorithm, ``hash_seed``, ``cache_salt`` and LoRA), plus the int
form of vLLM's default event streams. One Rust call per prompt; no manager involved.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks._core import BlockHasher, KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int

__all__ = ["PromptHasher"]


class PromptHasher:
    """Block hashes of prompts, without touching any instance.

    Args:
        block_size: tokens per block of the instances.
        hash_algo: the instances' hash algorithm.
        hash_seed: the instances' ``hash_seed`` (``sha256_cbor`` only; ``None`` as the
            manager: ``PYTHONHASHSEED`` when set, else vLLM's default).

    Instances that name LoRAs (``register_lora``) need the same mapping here, or use
    :meth:`from_manager` on a manager configured like them.

    Raises:
        InvalidArgumentError: a bad block size, algorithm or seed.
    """

    def __init__(
        self, block_size: int, hash_algo: str = "blake3", *, hash_seed: str | None = None
    ) -> None:
        block_size = check_int(block_size, "block_size", minimum=1)
        self._hasher = BlockHasher(block_size, hash_algo=hash_algo, hash_seed=hash_seed)  # type: ignore[arg-type]

    @classmethod
    def from_manager(cls, manager: KVCacheManager) -> PromptHasher:
        """A hasher with ``manager``'s block size, algorithm, seed and registered LoRAs.

        Raises:
            InvalidArgumentError: ``manager`` is not a :class:`kvblocks.KVCacheManager`.
        """
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgumentError(
                f"manager must be a KVCacheManager, got {type(manager).__name__}"
            )
        hasher = cls(manager.block_size, manager.hash_algo)
        hasher._hasher = manager.block_hasher()
        return hasher

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._hasher.block_size

    @property
    def hash_algo(self) -> str:
        """The hash algorithm."""
        return self._hasher.hash_algo

    def register_lora(self, lora_id: int, lora_name: str, lora_path: str | None = None) -> None:
        """Map ``lora_id`` as the instances do (``KVCacheManager.register_lora``)."""
        self._hasher.register_lora(lora_id, lora_name, lora_path)

    def block_hashes(
        self,
        token_ids: npt.ArrayLike,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        hash_format: str = "bytes",
    ) -> list[bytes] | list[int]:
        """Hashes of the prompt's full blocks, in order (empty for a prompt under one block).

        ``hash_format="int"`` gives each as vLLM's event streams carry it by default (and
        :class:`kvblocks.events.ZmqEventPublisher` with ``hash_format="int"``): the digest's
        last 8 bytes as a big-endian unsigned int.

        Raises:
            InvalidArgumentError: token ids the core rejects (negative, too large, not 1-D),
                a bad ``hash_format``, or a salt / LoRA the algorithm cannot key.
        """
        if not isinstance(hash_format, str) or hash_format not in ("bytes", "int"):
            raise InvalidArgumentError(f"hash_format must be 'bytes' or 'int', got {hash_format!r}")
        tokens = token_ids if isinstance(token_ids, (list, np.ndarray)) else np.asarray(token_ids)
        hashes = self._hasher.block_hashes(tokens, cache_salt=cache_salt, lora_id=lora_id)
        if hash_format == "int":
            # low64 without its type check: the core's own bytes, one per block.
            return [int.from_bytes(h[-8:], "big") for h in hashes]
        return hashes
