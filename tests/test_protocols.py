"""The interfaces in :mod:`kvblocks.protocols`: importing them costs no optional
dependency, and the implementations conform to them.

The functions below are checked by ``make typecheck`` (mypy --strict) as well as run: an
implementation that drifts from its protocol fails there, statically.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvblocks import KVCacheManager
from kvblocks.protocols import BlockManager, EventPublisher, TierStore


def test_the_protocols_import_no_optional_dependency() -> None:
    code = (
        "import sys, kvblocks.protocols\n"
        "heavy = {'zmq', 'msgspec', 'torch', 'valkey', 'kvblocks.events', 'kvblocks.tiers'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def as_block_manager(manager: KVCacheManager) -> BlockManager:
    """The compiled manager is a BlockManager (checked by mypy)."""
    return manager


def test_the_compiled_manager_is_a_block_manager() -> None:
    manager = as_block_manager(KVCacheManager(num_blocks=8, block_size=16))
    assert manager.block_size == 16 and manager.num_free_blocks() == 7


def test_the_publishers_are_event_publishers() -> None:
    pytest.importorskip("zmq")
    from kvblocks.events import NullEventPublisher, ZmqEventPublisher

    def publishers(zmq_publisher: ZmqEventPublisher) -> list[EventPublisher]:
        return [NullEventPublisher(), zmq_publisher]  # checked by mypy

    assert callable(publishers)
    for cls in (NullEventPublisher, ZmqEventPublisher):
        assert callable(cls.publish) and callable(cls.close)


def test_the_tiers_are_tier_stores(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    from kvblocks.tiers import DiskTier, HostTier, KVLayout

    layout = KVLayout(1, 1, 16, 64, torch.float16, "m", "0" * 64)
    stores: list[TierStore] = [HostTier(layout, 4), DiskTier(tmp_path, layout, 4)]
    assert all(isinstance(s, TierStore) for s in stores)
