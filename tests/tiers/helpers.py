"""Random blocks for the tier tests."""

from __future__ import annotations

import hashlib

import torch

from kvblocks.tiers import KVLayout


def block_hash(i: int, salt: str = "") -> bytes:
    """A distinct 32-byte block hash per ``(i, salt)`` (what the core's blake3 hashes look like)."""
    return hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=32).digest()


def digest_of(name: str) -> str:
    """A stand-in weights digest for the weights called ``name`` (hex, as
    ``KVLayout.weights_digest`` takes it)."""
    return hashlib.blake2b(f"weights:{name}".encode(), digest_size=32).hexdigest()


def random_payload(layout: KVLayout, seed: int) -> torch.Tensor:
    """A random uint8 payload of ``layout.payload_nbytes`` bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.payload_nbytes,), dtype=torch.uint8, generator=gen)
