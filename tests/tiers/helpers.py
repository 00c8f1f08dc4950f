"""Random blocks for the tier tests."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
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


TIERS_LOGGER = "kvblocks.tiers"
"""The logger the tiers report operational faults on (outages, disk errors, rejected records)."""


@contextmanager
def logs_warning(caplog: pytest.LogCaptureFixture, match: str) -> Iterator[None]:
    """Assert that the block logs one or more tier warnings matching ``match`` (a regex)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=TIERS_LOGGER):
        yield
    messages = tier_warnings(caplog)
    assert any(re.search(match, m) for m in messages), messages


def tier_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages logged at WARNING or above on the tiers' logger so far."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == TIERS_LOGGER and r.levelno >= logging.WARNING
    ]
