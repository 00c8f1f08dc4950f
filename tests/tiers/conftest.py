"""Fixtures of the tier tests: a real Valkey/Redis server on 127.0.0.1, and a small layout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvblocks.tiers import KVLayout  # noqa: E402
from tiers.helpers import digest_of  # noqa: E402
from tiers.valkey_server import ServerProcess, running_server  # noqa: E402


@pytest.fixture
def layout() -> KVLayout:
    """Two layers, two KV heads, 16-token blocks, head size 64, fp16: 16 KiB payloads."""
    return KVLayout(2, 2, 16, 64, torch.float16, "test-model", digest_of("test-model"))


@pytest.fixture
def valkey_server() -> Iterator[ServerProcess]:
    """A fresh server process for one test (killed and removed afterwards)."""
    with running_server() as server:
        yield server
