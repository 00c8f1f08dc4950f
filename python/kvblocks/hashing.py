"""Block hashes of prompts from the Rust core, exactly as a :class:`KVCacheManager` hashes.

A router matching prompts against instances' ``BlockStored`` events, a tier fetching a
prompt's blocks from a shared store, or an engine probing before admission needs the
hashes an instance would give a prompt without adding it to a manager:

* :class:`BlockHasher` (``block_size``, ``hash_algo``, ``hash_seed``, ``register_lora``)
  hashes a whole prompt in one call (``block_hashes(token_ids, cache_salt=, lora_id=)``),
  every algorithm the manager has, with the GIL released for long prompts;
* :meth:`KVCacheManager.block_hasher` gives one with a manager's own settings and
  registered LoRAs;
* :func:`low64` is the int form vLLM's event streams carry by default.
"""

from __future__ import annotations

from kvblocks._core import BlockHasher
from kvblocks.errors import InvalidTypeError

__all__ = ["BlockHasher", "low64"]


def low64(digest: bytes) -> int:
    """A block hash as vLLM publishes it by default: the digest's last 8 bytes as a
    big-endian unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).

    Raises:
        InvalidTypeError: ``digest`` is not ``bytes`` (``int.from_bytes`` would read a
            list of ints as one, making up a hash).
    """
    if not isinstance(digest, bytes):
        raise InvalidTypeError(f"digest must be bytes, got {type(digest).__name__}")
    return int.from_bytes(digest[-8:], "big")
