"""A prompt's block hashes, computed exactly as an instance computes them.

The binding exposes no hash function, only the hashes of blocks that enter a prefix
cache (``BlockStored`` events). :class:`PromptHasher` keeps a private scratch
:class:`KVCacheManager` with the instances' ``block_size`` and ``hash_algo``: it adds the
prompt, "computes" its full blocks (``allocate_slots`` + ``commit``; no KV exists, only
the bookkeeping), reads the ``BlockStored`` hashes, and then frees the sequence and clears
its cache so the next prompt is hashed from scratch. The hashes are the core's own, so
they match the instances' bit for bit, for every hash algorithm, ``cache_salt`` and
``lora_id``. Cost: one hashing pass over the prompt plus a few binding calls.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks._core import BlockStored, KVCacheManager
from kvblocks.errors import InvalidArgumentError

__all__ = ["PromptHasher"]


class PromptHasher:
    """Block hashes of prompts, without touching any instance.

    Args:
        block_size: tokens per block of the instances.
        hash_algo: the instances' hash algorithm.
        max_tokens: prompt length the scratch pool is first sized for (it grows on demand).
    """

    def __init__(self, block_size: int, hash_algo: str = "blake3", max_tokens: int = 4096) -> None:
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._manager = self._scratch(max(max_tokens, block_size))

    def _scratch(self, tokens: int) -> KVCacheManager:
        blocks = -(-tokens // self.block_size) + 2  # + the null block + slack
        return KVCacheManager(
            blocks,
            self.block_size,
            enable_prefix_caching=True,
            hash_algo=self.hash_algo,  # type: ignore[arg-type]
            watermark=0.0,
            record_events=True,
        )

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
            InvalidArgumentError: token ids the core rejects (negative, too large, not 1-D).
        """
        if hash_format not in ("bytes", "int"):
            raise InvalidArgumentError(f"hash_format must be 'bytes' or 'int', got {hash_format!r}")
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"token_ids must be 1-D, got shape {tokens.shape}")
        full = (len(tokens) // self.block_size) * self.block_size
        if full == 0:
            return []
        if full > (self._manager.num_blocks - 2) * self.block_size:
            self._manager = self._scratch(2 * full)
        m = self._manager
        m.add_sequence(0, tokens[:full], cache_salt=cache_salt, lora_id=lora_id)
        try:
            if m.allocate_slots(0, full) is None:  # pragma: no cover - sized above
                raise InvalidArgumentError("scratch pool too small for the prompt")
            m.commit(0, full)
        finally:
            m.free(0)
            m.reset_prefix_cache()
        hashes: list[bytes] = []
        for ev in m.take_events():
            if isinstance(ev, BlockStored):
                hashes.extend(ev.block_hashes)
        if hash_format == "int":
            return [int.from_bytes(h[-8:], "big") for h in hashes]
        return hashes
