"""Fixtures of the scheduler tests: block managers (Rust core and Python reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvblocks import KVCacheManager
from oracle.reference_manager import ReferenceKVCacheManager

ManagerFactory = Callable[..., Any]


@pytest.fixture(params=["rust", "reference"])
def make_manager(request: pytest.FixtureRequest) -> ManagerFactory:
    """Build a block manager of either implementation: ``make_manager(num_blocks, bs, ...)``."""
    cls = KVCacheManager if request.param == "rust" else ReferenceKVCacheManager
    return lambda *args, **kwargs: cls(*args, **kwargs)


@pytest.fixture
def rust_manager() -> ManagerFactory:
    """Build a Rust block manager."""
    return lambda *args, **kwargs: KVCacheManager(*args, **kwargs)
