"""Fixtures of the manager tests: every behavioural test runs on the Rust manager and
on the pure-Python reference model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvblocks
from oracle.reference_manager import ReferenceKVCacheManager

IMPLEMENTATIONS = {
    "rust": kvblocks.KVCacheManager,
    "reference": ReferenceKVCacheManager,
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def make(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """A constructor of the implementation under test (watermark 0 unless given)."""
    cls = IMPLEMENTATIONS[request.param]

    def build(num_blocks: int = 32, block_size: int = 4, **kwargs: Any) -> Any:
        kwargs.setdefault("watermark", 0.0)
        return cls(num_blocks, block_size, **kwargs)

    return build
