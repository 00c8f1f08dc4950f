"""A prompt's block hashes outside the manager: the core's one-call ``BlockHasher`` against
the scratch-manager drive ``PromptHasher`` used before it (add, allocate, commit, read the
``BlockStored`` events, free, reset), both measured in the same run.

Run with ``pytest benches/router --benchmark-only``; each group's table compares the two.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvblocks import BlockStored, KVCacheManager
from kvblocks.hashing import BlockHasher

BLOCK_SIZE = 16
TOKENS = 32_768


def scratch_manager_hashes(m: KVCacheManager, tokens: np.ndarray) -> list[bytes]:
    """The old ``PromptHasher.block_hashes``: drive a private manager through a prompt."""
    full = (len(tokens) // BLOCK_SIZE) * BLOCK_SIZE
    m.add_sequence(0, tokens[:full])
    try:
        m.allocate_slots(0, full)
        m.commit(0, full)
    finally:
        m.free(0)
        m.reset_prefix_cache()
    return [h for ev in m.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]


@pytest.mark.parametrize("algo", ["blake3", "sha256_cbor"])
@pytest.mark.parametrize("how", ["block_hasher", "scratch_manager"])
def test_hash_a_32k_prompt(benchmark: Any, algo: str, how: str) -> None:
    benchmark.group = f"32k-token prompt, {algo}"
    tokens = np.random.default_rng(0).integers(0, 32_000, TOKENS)
    if how == "block_hasher":
        hasher = BlockHasher(BLOCK_SIZE, hash_algo=algo)  # type: ignore[arg-type]
        hashes = benchmark(hasher.block_hashes, tokens)
    else:
        m = KVCacheManager(TOKENS // BLOCK_SIZE + 2, BLOCK_SIZE, hash_algo=algo, watermark=0.0)  # type: ignore[arg-type]
        hashes = benchmark(scratch_manager_hashes, m, tokens)
    assert len(hashes) == TOKENS // BLOCK_SIZE
